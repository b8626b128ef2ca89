"""Soak: a real agent under steady simulated load for a long time; RSS and open descriptors stay flat.

The agent runs with 8 emulated GPUs polled at 10 Hz, the host collector, the events receiver fed at
the nominal node rate (~50k events/s from 8 ranks and 64 loader workers through the real client), and
an nginx-format spoke log appended to and rotated every few minutes. Prometheus is played by a scrape
every second. Every `--sample` seconds the agent's RSS and open file descriptors are recorded; the
report gives first, last and max, and the growth from the first to the last quarter of the run.

    .venv/bin/python benchmarks/soak.py [--seconds 3600] [--rate 50000] [--sample 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from stallwatch.harness import scrape, start_agent, stop_agent, timed_scrape, total

ROTATE_SECONDS = 300


def nginx_line(now: float, n: int) -> str:
    cache = "HIT" if n % 4 else "MISS"
    upstream = "-" if cache == "HIT" else "0.012"
    return (f"msec:{now:.3f}\trequest_time:0.013\tstatus:200\tbytes:1048576\tcache:{cache}\t"
            f"upstream_time:{upstream}\tupstream_status:{'-' if cache == 'HIT' else '200'}\tslice:-\t"
            f"range:-\turi:/shards/{n % 5000:05d}.tar\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--rate", type=int, default=50_000, help="client events per second (default: nominal)")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between RSS/fd samples")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="sw-soak-"))
    socket_path, log = str(workdir / "events.sock"), workdir / "access.log"
    log.touch()
    agent = start_agent(["--gpu.fake-devices", "8", "--gpu.interval", "0.1", "--collector.spoke_nginx",
                         "--spoke_nginx.log", str(log), "--events.socket", socket_path], workdir / "agent.log")
    process = psutil.Process(agent.process.pid)
    client = subprocess.Popen([sys.executable, str(Path(__file__).parent / "flood.py"), "client", socket_path,
                               str(args.rate), str(args.seconds)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    samples: list[tuple[float, float, int]] = []
    scrapes: list[float] = []
    lines, next_rotation, next_sample = 0, ROTATE_SECONDS, 0.0
    start = time.monotonic()
    try:
        while (elapsed := time.monotonic() - start) < args.seconds:
            with log.open("a") as out:
                out.writelines(nginx_line(time.time(), lines + i) for i in range(50))
            lines += 50
            if elapsed >= next_rotation:  # rename rotation, as logrotate does; the agent follows the new file
                log.rename(log.with_suffix(".log.1"))
                log.touch()
                next_rotation += ROTATE_SECONDS
            scrapes.append(timed_scrape(agent.url)[0])
            if elapsed >= next_sample:
                samples.append((elapsed, process.memory_info().rss / 2**20, process.num_fds()))
                next_sample += args.sample
            time.sleep(max(0.0, 1.0 - (time.monotonic() - start - elapsed)))
        metrics = scrape(agent.url)
        samples.append((time.monotonic() - start, process.memory_info().rss / 2**20, process.num_fds()))
    finally:
        client.wait(timeout=args.seconds + 120)
        stop_agent(agent)
    quarter = max(1, len(samples) // 4)
    rss = [s[1] for s in samples]
    fds = [s[2] for s in samples]
    print(json.dumps({
        "seconds": round(samples[-1][0], 1), "samples": len(samples), "rate": args.rate,
        "rss_mib": {"first": round(rss[0], 1), "last": round(rss[-1], 1), "max": round(max(rss), 1),
                    "first_quarter_mean": round(statistics.mean(rss[:quarter]), 1),
                    "last_quarter_mean": round(statistics.mean(rss[-quarter:]), 1)},
        "open_fds": {"first": fds[0], "last": fds[-1], "max": max(fds)},
        "scrape_ms": {"median": round(statistics.median(scrapes) * 1e3, 2),
                      "max": round(max(scrapes) * 1e3, 2)},
        "events_accepted": total(metrics, "stallwatch_receiver_events_total"),
        "events_dropped_by_agent": total(metrics, "stallwatch_receiver_dropped_events_total"),
        "events_dropped_by_clients": total(metrics, "stallwatch_client_dropped_events_total"),
        "spoke_lines_written": lines,
        "spoke_requests_counted": total(metrics, "stallwatch_spoke_requests_total"),
        "spoke_errors": total(metrics, "stallwatch_spoke_collector_errors_total"),
    }, indent=2))


if __name__ == "__main__":
    main()
