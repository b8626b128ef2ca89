"""What the window hold adds to publication: a live correlator fed in real time by 8 ranks, seconds from each
window's end to its close and to its publication (`PYTHONPATH=. python benchmarks/hold_delay.py [SECONDS]`).

Each rank steps every 50 ms; a share of its steps (`--stalled RATIO`, default 0.1) is a stall taking most of
the step (a cold cache), and with `--outage` every rank waits 12 s once midway. Prints p50/p99/max of both
delays, per setting, as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import numpy as np

from stallwatch.correlator.hold import Publication
from stallwatch.correlator.live import LiveCorrelator
from stallwatch.correlator.results import WindowResult
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.eventbatch import EventBatch

RANKS = 8
STEP_S = 0.05


def _steps(rows: list[tuple[int, int, int, int, int]]) -> EventBatch:
    rank, batch, ws, we, ce = (np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))
    return EventBatch("step", {"job": np.zeros(rank.size, np.int32), "rank": rank.astype(np.int32),
                               "gpu": rank.astype(np.int16), "batch": batch, "wait_start_ns": ws,
                               "wait_end_ns": we, "compute_end_ns": ce, "ready_ns": np.full(rank.size, -1)})


def measure(settings: CorrelatorSettings, seconds: float, outage: bool, stalled: float) -> dict[str, object]:
    closed: dict[int, int] = {}  # window end -> monotonic ns it closed at
    delays: dict[str, list[float]] = {"close_s": [], "publish_s": []}

    def on_close(result: WindowResult) -> None:
        closed[result.end_ns] = time.monotonic_ns()
        delays["close_s"].append((closed[result.end_ns] - result.end_ns) / 1e9)

    def on_publish(publication: Publication) -> None:
        delays["publish_s"].append((time.monotonic_ns() - publication.result.end_ns) / 1e9)

    service = LiveCorrelator(settings)
    service.correlator.results.sink(on_close)
    service.hold._listeners.append(on_publish)
    rng = random.Random(1)
    stop = time.monotonic() + seconds
    outage_at = time.monotonic() + seconds / 2 if outage else None
    next_free = [time.monotonic_ns()] * RANKS
    batch = 0
    while time.monotonic() < stop:
        now = time.monotonic_ns()
        if outage_at is not None and time.monotonic() >= outage_at:
            time.sleep(12.0)
            outage_at = None
            continue
        rows = []
        for rank in range(RANKS):
            ws = next_free[rank]
            we = now - 1_000_000 if rng.random() < stalled else ws + 500_000
            rows.append((rank, batch, ws, max(we, ws), now))
            next_free[rank] = now
        service.submit(_steps(rows))
        batch += 1
        time.sleep(STEP_S)
    threading.Event().wait(settings.window_s + settings.lateness_s + 1)
    service.close()

    def stats(values: list[float]) -> dict[str, float]:
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        return {"p50": round(statistics.median(values), 3), "p99": round(cuts[98], 3), "max": round(max(values), 3)}

    return {name: stats(values) for name, values in delays.items() if len(values) >= 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", type=float, nargs="?", default=40.0)
    parser.add_argument("--outage", action="store_true")
    parser.add_argument("--stalled", type=float, default=0.1)
    options = parser.parse_args()
    for settings in (CorrelatorSettings(), CorrelatorSettings(window_s=5.0, lateness_s=5.0)):  # defaults, and 0.1's
        result = measure(settings, options.seconds, options.outage, options.stalled)
        print(json.dumps({"window_s": settings.window_s, "lateness_s": settings.lateness_s, "outage": options.outage,
                          "stalled": options.stalled, **result}))


if __name__ == "__main__":
    main()
