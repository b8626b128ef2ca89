"""The warm-up's span: phases judged over the last few seconds of short windows."""

from __future__ import annotations

import itertools

import numpy as np

from stallwatch.correlator.warmup import JobWindow, WarmupSettings, WarmupTracker
from tests.scenarios.generator import JobSpec, Scenario
from tests.scenarios.run import correlate

SECOND = 10**9
MB = 1 << 20


def _window(hits: int, reads: int = 19, steps: int = 8, step_s: float = 0.12, direct_reads: int = 0) -> JobWindow:
    """One 1 s window of the demo's job: ~19 reads and 8 steps."""
    empty = np.zeros(0, dtype=np.int64)
    return JobWindow(steps=steps, ranks=1, step_seconds=np.full(steps, step_s), step_quarter=np.arange(steps) % 4,
                     reads=reads, hits=hits, hub_bytes=0, stall_idle_gpu_seconds=0.0, stall_start_ns=empty,
                     stall_end_ns=empty, direct_reads=direct_reads)


def _phases(tracker: WarmupTracker, windows: list[JobWindow]) -> list[str]:
    return [tracker.update(0, i * SECOND, (i + 1) * SECOND, w, 0, complete=True).phase for i, w in enumerate(windows)]


# A spoke at 85 % of the dataset: runs of windows at ~0.7 between runs that all hit, one second each.
WOBBLE = [_window(h) for h in itertools.islice(itertools.cycle([19, 19, 13, 14, 12, 19, 19, 19, 15, 19]), 40)]


def test_a_wobbling_partly_fitting_working_set_keeps_its_phase_with_one_second_windows() -> None:
    phases = _phases(WarmupTracker(), WOBBLE)
    assert set(phases) == {"steady"}
    # Judged one window at a time, the same windows flap: the span is what holds the phase.
    alone = _phases(WarmupTracker(WarmupSettings(span_s=1.0)), WOBBLE)
    assert sum(a != b for a, b in itertools.pairwise(alone)) >= 4


def test_an_eviction_leaves_steady_within_the_span_and_counts_once() -> None:
    tracker = WarmupTracker()
    evicted = [_window(1, step_s=0.4) for _ in range(6)]  # every read misses and steps wait for the hub
    phases = _phases(tracker, WOBBLE + evicted)
    left = next(i for i, phase in enumerate(phases) if phase != "steady")
    assert len(WOBBLE) <= left < len(WOBBLE) + 5  # within the 5 s span
    assert phases[-1] == "cold" and tracker.jobs[0].regressions == 1


def test_time_to_steady_is_within_one_short_window_of_the_last_miss() -> None:
    for seed in (1, 2, 3):
        outcome = correlate(Scenario([JobSpec(0, steps=1200, workers=3)], cache_bytes=800 * MB, seed=seed),
                            window_s=1.0)
        row = next(j for j in outcome.windows[-1].jobs if j.job == 0)
        assert row.time_to_steady_s is not None
        assert abs(row.time_to_steady_s - outcome.generated.truth.last_miss_s[0]) <= 1.0


def test_a_job_reading_through_no_spoke_is_judged_on_its_steps_and_a_spoke_read_brings_the_hit_ratio_back() -> None:
    """Nothing to warm: a job whose reads all crossed no spoke is steady once its pace is (not cold for ever for
    want of a hit ratio); once reads cross a spoke their misses count again."""
    tracker = WarmupTracker()
    phases = _phases(tracker, [_window(0, reads=0, direct_reads=19) for _ in range(8)])
    assert phases[-1] == "steady" and tracker.jobs[0].time_to_steady_s is not None, phases
    assert tracker.jobs[0].hit_ratio is None
    assert _phases(WarmupTracker(), [_window(0, reads=0) for _ in range(8)])[-1] == "cold"
    later = tracker.update(0, 8 * SECOND, 9 * SECOND, _window(0, reads=19), 0, complete=True)
    assert later.phase == "cold"
