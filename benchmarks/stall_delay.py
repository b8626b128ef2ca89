"""How soon an instant of a stall is scrapeable: a real agent, a real client, stalls of 0.1 s, 5 s and 60 s.

A training loop (`monitor()` through the real client, in this process) steps every 50 ms and now and
then waits for its next batch for a set time: the stall. A scraper reads the agent's /metrics every
`SCRAPE_EVERY_S` for the loop's `stallwatch_stall_seconds_total`. Every `INSTANT_S` of every stall is one
instant; its delay is the first scrape whose counter holds the stall seconds up to that instant, minus
the instant (one monotonic clock for both). So the figure includes the window the instant falls in, the
lateness, the wait for the GPU's next sample, the client's 0.2 s flush and the scrape period. A training
node's cores are busy (its loader workers), so by default one burner process per core spins throughout.

    PYTHONPATH=. .venv/bin/python benchmarks/stall_delay.py [--stalls 0.1x20,5x3,60x1] [--burners N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks.soak import start_burners
from stallwatch.catalogue import JOB_LABEL, STALL_SECONDS
from stallwatch.harness import start_agent, stop_agent

JOB = "stall-delay"
STEP_S = 0.05
SCRAPE_EVERY_S = 0.2
INSTANT_S = 0.05
THRESHOLD_S = 0.001  # the correlator's default: shorter waits are no stall
SETTLE_S = 4.0  # steady steps between stalls, and after the last, so every stall is published


class Scraper:
    """Reads the loop's stall seconds (all causes, all ranks) every SCRAPE_EVERY_S: (monotonic s, seconds)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_EVERY_S):
            try:
                with urllib.request.urlopen(self.url, timeout=10) as reply:
                    text = reply.read().decode()
            except OSError:
                continue
            self.seen.append((time.monotonic(), stall_seconds(text)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def stall_seconds(exposition: str) -> float:
    """The loop's stall seconds, all causes: each series' newest sample (a scrape carries every window published
    since the one before, each with its timestamp, in time order)."""
    wanted = f'{JOB_LABEL}="{JOB}"'
    newest = {line.split()[0]: float(line.split()[1]) for line in exposition.splitlines()
              if line.startswith(STALL_SECONDS.name + "{") and wanted in line}
    return sum(newest.values())


def batches(plan: list[float], stalls: list[tuple[float, float]]) -> Iterator[int]:
    """Steady batches, and before each planned stall's batch a wait that long; notes each stall's span."""
    batch = 0
    for length in plan:
        for _ in range(int(SETTLE_S / STEP_S)):
            yield batch
            batch += 1
        began = time.monotonic()
        time.sleep(length)
        stalls.append((began, time.monotonic()))
        yield batch
        batch += 1
    for _ in range(int(2 * SETTLE_S / STEP_S)):
        yield batch
        batch += 1


def delays(stalls: list[tuple[float, float]], seen: list[tuple[float, float]]) -> dict[float, list[float]]:
    """Per planned length (rounded), the delay of each instant of its stalls. The stalls before one are all
    booked by the time it begins (SETTLE_S apart), so it counts from the last scrape before it."""
    out: dict[float, list[float]] = {}
    for began, ended in stalls:
        before = max((value for t, value in seen if t < began), default=0.0)
        instant = began + INSTANT_S
        while instant <= ended:
            needed = before + (instant - began) - 0.001
            at = next((t for t, value in seen if value >= needed), None)
            if at is not None:
                out.setdefault(round(ended - began, 1), []).append(max(0.0, at - instant))
            instant += INSTANT_S
    return out


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def parse_plan(text: str) -> list[float]:
    """`0.1x20,5x3` -> twenty stalls of 0.1 s, then three of 5 s."""
    plan: list[float] = []
    for part in text.split(","):
        length, _, count = part.partition("x")
        plan += [float(length)] * int(count or 1)
    return plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stalls", default="0.1x20,5x3,60x1", help="lengths and counts (default: %(default)s)")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1,
                        help="busy-loop processes kept running alongside (default: one per core)")
    args = parser.parse_args()
    plan = parse_plan(args.stalls)

    from stallwatch.client import monitor, transport

    workdir = Path(tempfile.mkdtemp(prefix="sw-stall-delay-"))
    socket_path = str(workdir / "events.sock")
    agent = start_agent(["--events.socket", socket_path], workdir / "agent.log")
    burners = start_burners(args.burners)
    scraper = Scraper(agent.url)
    stalls: list[tuple[float, float]] = []
    try:
        transport.configure(socket_path)
        for _ in monitor(batches(plan, stalls), job=JOB, rank=0):
            time.sleep(STEP_S)
        time.sleep(SETTLE_S)
    finally:
        scraper.stop()
        for burner in burners:
            burner.kill()
            burner.wait()
        stop_agent(agent)
    found = delays(stalls, scraper.seen)

    booked = scraper.seen[-1][1] if scraper.seen else 0.0
    print(json.dumps({
        "burners": args.burners,
        "stall_seconds": {"waited": round(sum(e - b for b, e in stalls), 3), "booked": round(booked, 3)},
        "delay_s": {str(length): {"instants": len(values), "p50": round(statistics.median(values), 2),
                                  "p99": round(percentile(values, 0.99), 2)}
                    for length, values in sorted(found.items())},
    }, indent=2))


if __name__ == "__main__":
    main()
