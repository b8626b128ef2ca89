"""The warm-up forecast against the job's actual time to steady, as a Markdown table (docs/attribution.md quotes it).

`PYTHONPATH=. .venv/bin/python -m tests.scenarios.forecast` runs each case over eight seeds and prints, per case,
the actual time to steady and the forecast's relative error once a third of it has passed: at that window
(median and largest over the seeds) and the largest over every window from then until the job was steady; then
the range over the seeds of the error a third in of what is still to come, idle GPU-seconds and hub bytes, as a
share of the warm-up's whole.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from tests.scenarios.generator import BASE_NS, JobSpec, Scenario
from tests.scenarios.run import correlate

MB = 1 << 20


@dataclass(frozen=True)
class Case:
    spec: JobSpec
    dataset_known: bool  # the agent is given the dataset's size; else the epoch's progress or the reuse it sees


CASES = {
    "one rank, one pass (400 MB), size set": Case(JobSpec(0, steps=1200), True),
    "one rank, 3 workers, 20 ms compute, size set": Case(JobSpec(0, steps=1200, workers=3, compute_s=0.02), True),
    "two ranks shuffling on their own (1.6 GB), size set": Case(JobSpec(0, steps=2400, ranks=2, dataset_items=1600),
                                                               True),
    "two ranks shuffling on their own (1.6 GB), fitted": Case(JobSpec(0, steps=2400, ranks=2, dataset_items=1600),
                                                             False),
    "four ranks shuffling on their own (3.2 GB), fitted": Case(JobSpec(0, steps=3000, ranks=4, dataset_items=3200),
                                                              False),
    "one rank, one pass (400 MB), epoch progress": Case(JobSpec(0, steps=1200, epoch_known=True), False),
    "one rank, 3 workers, 20 ms compute, epoch progress": Case(
        JobSpec(0, steps=1200, workers=3, compute_s=0.02, epoch_known=True), False),
    "two ranks shuffling on their own (1.6 GB), epoch progress": Case(
        JobSpec(0, steps=2400, ranks=2, dataset_items=1600, epoch_known=True), False),
    "four ranks shuffling on their own (3.2 GB), epoch progress": Case(
        JobSpec(0, steps=3000, ranks=4, dataset_items=3200, epoch_known=True), False),
}
SEEDS = tuple(range(1, 9))


@dataclass(frozen=True)
class Errors:
    actual_s: float
    at_third: float  # (forecast - actual) / actual at the first window ending a third into the warm-up
    worst_after: float  # the largest |error| of the windows from then until steady
    idle_at_third: float  # the idle GPU-seconds still to come: forecast - actual, over the warm-up's whole idle
    hub_bytes_at_third: float  # the same for the hub bytes


def forecast_errors(case: Case, seed: int) -> Errors:
    working_set = case.spec.dataset_items * case.spec.item_bytes
    outcome = correlate(Scenario([case.spec], cache_bytes=2 * working_set, seed=seed),
                        dataset_bytes=working_set if case.dataset_known else None)
    first = outcome.generated.truth.first_event_s[case.spec.job]
    rows = [((w.end_ns - BASE_NS) / 1e9 - first, j) for w in outcome.windows for j in w.jobs if j.job == case.spec.job]
    actual = rows[-1][1].time_to_steady_s
    assert actual is not None, "the job never got steady"

    def error(forecast_s: float | None) -> float:
        return math.nan if forecast_s is None else (forecast_s - actual) / actual

    after = [error(j.forecast.time_to_steady_s if j.forecast else None) for t, j in rows if actual / 3 <= t <= actual]
    final = rows[-1][1]
    third = next(j for t, j in rows if t >= actual / 3)
    assert third.forecast is not None
    idle_left = final.warmup_idle_gpu_s - third.warmup_idle_gpu_s
    idle = (third.forecast.idle_gpu_seconds - idle_left) / final.warmup_idle_gpu_s
    hub = (third.forecast.hub_bytes - (final.warmup_hub_bytes - third.warmup_hub_bytes)) / final.warmup_hub_bytes
    return Errors(actual, after[0], max(abs(e) if not math.isnan(e) else math.inf for e in after), idle, hub)


def main() -> None:
    print("| case | actual time to steady | error a third in: median | largest | largest from then on "
          "| idle still to come, a third in | hub bytes still to come, a third in |")
    print("|---|---|---|---|---|---|---|")
    for name, case in CASES.items():
        runs = [forecast_errors(case, seed) for seed in SEEDS]
        print(f"| {name} | {statistics.median(r.actual_s for r in runs):.1f} s "
              f"| {statistics.median(abs(r.at_third) for r in runs):.1%} | {max(abs(r.at_third) for r in runs):.1%} "
              f"| {max(r.worst_after for r in runs):.1%} | {_spread(r.idle_at_third for r in runs)} "
              f"| {_spread(r.hub_bytes_at_third for r in runs)} |")


def _spread(errors: Iterable[float]) -> str:
    ordered = sorted(errors)
    return f"{ordered[0]:+.0%} .. {ordered[-1]:+.0%}"


if __name__ == "__main__":
    main()
