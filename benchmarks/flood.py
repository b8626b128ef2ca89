"""Event flood into a real agent: bounded memory, /metrics answering, every event accounted for.

A client process records events through the real client transport (`stallwatch.client.transport`)
for 64 loader workers (reads) and 8 ranks (steps) at a given rate, 10x the nominal ~50k events/s of
a node by default, paced every 10 ms. Meanwhile this process scrapes the agent without pause and
samples its RSS. After the flood, one more batch per source carries the clients' last drop counts,
and the accounting is checked from both sides:

    sent = accepted by the agent (receiver_events_total) + dropped by the agent
           (receiver_dropped_events_total) + dropped by the clients (their own counters)

and the agent's `client_dropped_events_total` equals the clients' own count. The correlator (on, as by
default) sheds what passes its caps and counts it in `correlator_dropped_events_total`, reported by
kind and reason. `run()` is what
tests/test_flood.py calls for a few seconds; this script runs it longer:

    .venv/bin/python benchmarks/flood.py [--seconds 30] [--rate 500000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from stallwatch.harness import Samples, scrape, start_agent, stop_agent, timed_scrape, total

NOMINAL_RATE = 50_000
RANKS, WORKERS = 8, 64
TICK_NS = 10_000_000


@dataclass
class ClientCounts:
    sent: int
    dropped: int
    unreported: int


def client_flood(socket_path: str, rate: int, seconds: float) -> ClientCounts:
    """Record `rate` events/s for `seconds` through the real client; returns its own counters."""
    from stallwatch.client import transport, wire

    sender = transport.configure(socket_path)
    ranks = [sender.channel(wire.Source("flood", r, r, -1)) for r in range(RANKS)]
    workers = [sender.channel(wire.Source("flood", w % RANKS, w % RANKS, w // RANKS)) for w in range(WORKERS)]
    per_tick = max(1, rate * TICK_NS // 10**9)
    steps_per_tick = per_tick * RANKS // (RANKS + WORKERS)
    start = time.monotonic_ns()
    end, tick, sent, batch = start + int(seconds * 1e9), start, 0, 0
    while tick < end:
        now = time.monotonic_ns()
        for i in range(steps_per_tick):
            ranks[i % RANKS].step((batch, now - 3000, now - 2000, now - 1000))
            batch += 1
        for i in range(per_tick - steps_per_tick):
            workers[i % WORKERS].read((batch, i, 4096, now - 2000, now - 1000, wire.VERDICT_HIT))
        sent += per_tick
        tick += TICK_NS
        pause = (tick - time.monotonic_ns()) / 1e9
        if pause > 0:
            time.sleep(pause)
    sender.flush_all()
    time.sleep(0.3)  # let the agent drain its queue, then carry the last drop counts in one event each
    channels = ranks + workers
    for _ in range(100):  # one event per source still owing a count; paced: the kernel queues few datagrams
        pending = [c for c in channels if c.dropped_unreported]
        if not pending:
            break
        for channel in pending:
            now = time.monotonic_ns()
            channel.step((-1, now - 3000, now - 2000, now - 1000))
            sent += 1
            channel.flush()
            time.sleep(0.002)
    return ClientCounts(sent, sum(c.dropped_total for c in channels), sum(c.dropped_unreported for c in channels))


@dataclass
class FloodReport:
    rate: int
    seconds: float
    client: ClientCounts
    accepted: float
    agent_dropped: dict[str, float]
    reported_client_dropped: float
    rss_idle_mib: float
    rss_max_mib: float
    rss_after_mib: float
    scrape_idle_ms: float
    scrape_flood_ms: float
    scrapes_during_flood: int
    scrape_failures: int
    series: int = 0
    correlator_dropped: dict[str, float] = field(default_factory=dict)  # "kind/reason": events

    @property
    def unaccounted(self) -> float:
        return self.client.sent - self.accepted - sum(self.agent_dropped.values()) - self.client.dropped

    @property
    def scrape_ratio(self) -> float:
        return self.scrape_flood_ms / self.scrape_idle_ms


def run(url: str, pid: int, socket_path: str, rate: int = 10 * NOMINAL_RATE, seconds: float = 3.0) -> FloodReport:
    agent = psutil.Process(pid)
    idle = [timed_scrape(url)[0] for _ in range(10)]
    rss_idle = agent.memory_info().rss
    client = subprocess.Popen(
        [sys.executable, __file__, "client", socket_path, str(rate), str(seconds)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
    )
    during: list[float] = []
    failures, rss_max = 0, rss_idle
    while client.poll() is None:
        try:
            during.append(timed_scrape(url)[0])
        except OSError:
            failures += 1
        rss_max = max(rss_max, agent.memory_info().rss)
        time.sleep(0.05)
    out, _ = client.communicate(timeout=60)
    counts = ClientCounts(**json.loads(out))

    def settled() -> Samples:
        metrics = scrape(url, timeout=30)
        for _ in range(200):  # the agent's queue drains within a few scrapes; bounded anyway
            accounted = (total(metrics, "stallwatch_receiver_events_total")
                         + total(metrics, "stallwatch_receiver_dropped_events_total") + counts.dropped)
            if accounted >= counts.sent:
                break
            time.sleep(0.05)
            metrics = scrape(url, timeout=30)
        return metrics

    metrics = settled()
    dropped = {labels[0][1]: value for (name, labels), value in metrics.items()
               if name == "stallwatch_receiver_dropped_events_total"}
    return FloodReport(
        rate=rate, seconds=seconds, client=counts,
        accepted=total(metrics, "stallwatch_receiver_events_total"),
        agent_dropped=dropped,
        reported_client_dropped=total(metrics, "stallwatch_client_dropped_events_total"),
        rss_idle_mib=rss_idle / 2**20, rss_max_mib=rss_max / 2**20, rss_after_mib=agent.memory_info().rss / 2**20,
        scrape_idle_ms=statistics.median(idle) * 1e3,
        scrape_flood_ms=statistics.median(during) * 1e3 if during else float("nan"),
        scrapes_during_flood=len(during), scrape_failures=failures, series=len(metrics),
        correlator_dropped={f"{dict(labels)['kind']}/{dict(labels)['reason']}": value
                            for (name, labels), value in metrics.items()
                            if name == "stallwatch_correlator_dropped_events_total"},
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        counts = client_flood(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        print(json.dumps(asdict(counts)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=int, default=10 * NOMINAL_RATE)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="sw-flood-"))
    socket_path = str(workdir / "events.sock")
    agent = start_agent(["--no-collector.gpu", "--events.socket", socket_path], workdir / "agent.log")
    try:
        report = run(agent.url, agent.process.pid, socket_path, args.rate, args.seconds)
    finally:
        stop_agent(agent)
    print(json.dumps({**asdict(report), "unaccounted": report.unaccounted, "scrape_ratio": report.scrape_ratio},
                     indent=2))


if __name__ == "__main__":
    main()
