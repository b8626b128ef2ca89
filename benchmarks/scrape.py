"""Scrape cost of the agent at 8 GPUs, side by side with a bare prometheus_client registry.

Starts a real agent (8 emulated GPUs polled at 10 Hz, host collector on) and a bare
prometheus_client HTTP server holding as many gauge series, scrapes each alternately over HTTP,
and measures the agent's CPU share while idle-scraped. Prints ratios measured in this one run.

    python benchmarks/scrape.py [--scrapes 200] [--cpu-seconds 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil

from stallwatch.harness import start_agent, stop_agent

BARE_SERVER = textwrap.dedent(
    """
    import sys, time
    from prometheus_client import CollectorRegistry, Gauge, start_http_server
    series = int(sys.argv[1])
    registry = CollectorRegistry()
    gauge = Gauge("bare_series", "A series.", ["n"], registry=registry)
    for n in range(series):
        gauge.labels(str(n)).set(n)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    print(server.server_address[1], flush=True)
    time.sleep(3600)
    """
)


def get(url: str) -> tuple[float, bytes]:
    start = time.perf_counter()
    body = urllib.request.urlopen(url, timeout=10).read()
    return time.perf_counter() - start, body


def series_count(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--cpu-seconds", type=float, default=20.0)
    options = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="sw-bench-"))
    agent = start_agent(["--gpu.fake-devices", "8", "--gpu.interval", "0.1"], workdir / "agent.log")
    agent_url = agent.url
    try:
        time.sleep(2)  # let the poller fill every GPU's readings
        series = series_count(get(agent_url)[1])
        bare = subprocess.Popen([sys.executable, "-c", BARE_SERVER, str(series)], stdout=subprocess.PIPE, text=True)
        try:
            assert bare.stdout is not None
            bare_url = f"http://127.0.0.1:{bare.stdout.readline().strip()}/metrics"
            agent_times, bare_times = [], []
            for _ in range(options.scrapes):  # alternate so both see the same machine noise
                agent_times.append(get(agent_url)[0])
                bare_times.append(get(bare_url)[0])
        finally:
            bare.kill()
        process = psutil.Process(agent.process.pid)
        before, wall = process.cpu_times(), time.monotonic()
        rss_before = process.memory_info().rss
        scrapes_during = 0
        while time.monotonic() - wall < options.cpu_seconds:
            time.sleep(1.0)
            get(agent_url)  # one scrape a second, a fast Prometheus
            scrapes_during += 1
        after, elapsed = process.cpu_times(), time.monotonic() - wall
        cpu_share = (after.user + after.system - before.user - before.system) / elapsed
        rss = process.memory_info().rss
    finally:
        stop_agent(agent)

    def ms(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if q < 100 else max(values) * 1000

    print(f"series per scrape: {series} (agent: 8 GPUs + host), bare registry: {series}")
    print(f"{'':28}{'median ms':>10}{'p99 ms':>10}")
    print(f"{'agent /metrics':28}{statistics.median(agent_times) * 1000:10.2f}{ms(agent_times, 99):10.2f}")
    print(f"{'bare prometheus_client':28}{statistics.median(bare_times) * 1000:10.2f}{ms(bare_times, 99):10.2f}")
    print(f"ratio agent/bare (median): {statistics.median(agent_times) / statistics.median(bare_times):.2f}")
    print(f"agent CPU at 8 GPUs polled at 10 Hz, scraped at 1 Hz: {cpu_share * 100:.2f} % of one core "
          f"over {elapsed:.0f} s; RSS {rss / 2**20:.1f} MiB (was {rss_before / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
