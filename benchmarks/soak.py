"""Soak: a real agent under steady simulated load for a long time; RSS and open descriptors stay flat.

The agent runs with 8 emulated GPUs polled at 10 Hz, the host collector, the events receiver fed at
the nominal node rate (~50k events/s from 8 ranks and 64 loader workers through the real client), and
an nginx-format spoke log appended to and rotated every few minutes. Prometheus is played by a scrape
every second. A training node's cores are never idle (its loader workers keep them busy), so by default
one burner process per core spins for the whole run (`--burners 0` for an idle machine). Every
`--sample` seconds the agent's RSS and open file descriptors are recorded; the report gives first,
last and max, the growth from the first to the last quarter of the run, the share of events the
clients dropped, the share the correlator found late, how long after an event its window's results
were scrapeable (`benchmarks/result_delay.py`: p50 and p99), and the CPU the agent and its receive relay
used, each as a share of one core over the run.

    .venv/bin/python benchmarks/soak.py [--seconds 3600] [--rate 50000] [--sample 10] [--burners N]
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

from benchmarks.result_delay import ResultDelayProbe, summary
from stallwatch.eventbatch import SCHEMAS
from stallwatch.harness import scrape, start_agent, stop_agent, timed_scrape, total

ROTATE_SECONDS = 300
BURNER = "while True: pass"


def start_burners(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` processes that keep a core busy each, as a training node's loader workers do."""
    return [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(count)]


def nginx_line(now: float, n: int) -> str:
    cache = "HIT" if n % 4 else "MISS"
    upstream = "-" if cache == "HIT" else "0.012"
    return (f"msec:{now:.3f}\trequest_time:0.013\tstatus:200\tbytes:1048576\tcache:{cache}\t"
            f"upstream_time:{upstream}\tupstream_status:{'-' if cache == 'HIT' else '200'}\tslice:-\t"
            f"range:-\turi:/shards/{n % 5000:05d}.tar\n")


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def cpu_share(agent: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of the agent and of its receive relay (its child process)."""
    relays = [child for child in agent.children() if "receive_relay" in " ".join(child.cmdline())]
    return {"agent": cpu_seconds(agent), "relay": sum(cpu_seconds(relay) for relay in relays)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--rate", type=int, default=50_000, help="client events per second (default: nominal)")
    parser.add_argument("--sample", type=float, default=10.0, help="seconds between RSS/fd samples")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1,
                        help="busy-loop processes kept running alongside (default: one per core)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="sw-soak-"))
    socket_path, log = str(workdir / "events.sock"), workdir / "access.log"
    log.touch()
    agent = start_agent(["--gpu.fake-devices", "8", "--gpu.interval", "0.1", "--collector.spoke_nginx",
                         "--spoke_nginx.log", str(log), "--events.socket", socket_path], workdir / "agent.log")
    process = psutil.Process(agent.process.pid)
    burners = start_burners(args.burners)
    cpu_before, cpu_since = cpu_share(process), time.monotonic()
    probe = ResultDelayProbe(agent.url, socket_path)
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
        cpu_after, cpu_wall = cpu_share(process), time.monotonic() - cpu_since
        samples.append((time.monotonic() - start, process.memory_info().rss / 2**20, process.num_fds()))
    finally:
        client.wait(timeout=args.seconds + 120)
        probe.stop()
        for burner in burners:
            burner.kill()
            burner.wait()
        stop_agent(agent)
    quarter = max(1, len(samples) // 4)
    rss = [s[1] for s in samples]
    fds = [s[2] for s in samples]
    accepted = total(metrics, "stallwatch_receiver_events_total")
    client_dropped = total(metrics, "stallwatch_client_dropped_events_total")
    print(json.dumps({
        "seconds": round(samples[-1][0], 1), "samples": len(samples), "rate": args.rate, "burners": args.burners,
        "rss_mib": {"first": round(rss[0], 1), "last": round(rss[-1], 1), "max": round(max(rss), 1),
                    "first_quarter_mean": round(statistics.mean(rss[:quarter]), 1),
                    "last_quarter_mean": round(statistics.mean(rss[-quarter:]), 1)},
        "open_fds": {"first": fds[0], "last": fds[-1], "max": max(fds)},
        "cpu_percent_of_a_core": {name: round(100 * (cpu_after[name] - cpu_before[name]) / cpu_wall, 1)
                                  for name in cpu_after},
        "scrape_ms": {"median": round(statistics.median(scrapes) * 1e3, 2),
                      "max": round(max(scrapes) * 1e3, 2)},
        "events_accepted": accepted,
        "events_dropped_by_agent": total(metrics, "stallwatch_receiver_dropped_events_total"),
        "events_dropped_by_clients": client_dropped,
        "client_dropped_percent": round(100 * client_dropped / max(1.0, accepted + client_dropped), 3),
        "result_delay": summary(probe.delays_s()),
        "correlator_late_events": {kind: total(metrics, "stallwatch_correlator_late_events_total", kind=kind)
                                   for kind in SCHEMAS},
        "correlator_late_percent": round(
            100 * total(metrics, "stallwatch_correlator_late_events_total") / max(1.0, accepted), 3),
        "spoke_lines_written": lines,
        "spoke_requests_counted": total(metrics, "stallwatch_spoke_requests_total"),
        "spoke_errors": total(metrics, "stallwatch_spoke_collector_errors_total"),
    }, indent=2))


if __name__ == "__main__":
    main()
