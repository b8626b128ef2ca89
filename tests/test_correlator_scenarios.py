"""Ground truth: generated scenarios with known causes, through the whole offline pipeline.

Tolerances (from the issue): attributed seconds per cause within 5 % of truth, GPU idle during stalls
within 5 % of truth (from driver-like samples: irregular periods, gaps), warm-up phases within one
window of truth, the cache what-if within 5 points of an exact LRU simulation.
Example counts stay small: each example simulates one to two minutes of a training node.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from stallwatch.catalogue import CAUSES
from stallwatch.correlator.attribution import DELIVERY, OTHER, PREPROCESS, REMOTE
from stallwatch.correlator.settings import CorrelatorSettings
from tests.scenarios.generator import BASE_NS, JobSpec, Scenario, exact_lru_hit_ratio
from tests.scenarios.run import Outcome, assert_attribution_close, correlate

MB = 1 << 20
WINDOW_S = CorrelatorSettings().window_s
# Phases are held to this of the truth: one window of the earlier 5 s default, now the warm-up's span.
WITHIN_S = 5.0
# No shrinking: one example simulates a minute of a node; a failure prints its seeds to rerun.
FEW = settings(max_examples=4, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
seeds = st.integers(0, 2**16)


def assert_every_rank_close(outcome: Outcome) -> None:
    attributed = outcome.stall_by_rank()
    for key, truth in outcome.generated.truth.stall_s.items():
        assert_attribution_close(attributed.get(key, np.zeros(len(CAUSES))), truth)


def assert_gpu_idle_close(outcome: Outcome) -> None:
    """A GPU is busy exactly while its rank computes, so it idles through every stall: per job, the
    GPU idle attributed to stalls is within 5 % of the stall seconds, in total and per cause."""
    truth = outcome.generated.truth
    for job in {job for job, _ in truth.stall_s}:
        idle = sum((np.array(g.idle_s) for w in outcome.parts() for g in w.gpus if g.job == job),
                   np.zeros(len(CAUSES)))
        want = truth.stall_by_job(job)
        assert idle.sum() == pytest.approx(want.sum(), rel=0.05)
        assert_attribution_close(idle, want)


def assert_whatif_close(outcome: Outcome, scenario: Scenario) -> None:
    estimate = outcome.windows[-1].whatif
    assert set(estimate) == {0.5, 1.0, 2.0, 4.0}
    for factor, ratio in estimate.items():
        exact = exact_lru_hit_ratio(outcome.generated.truth.reads, factor * scenario.cache_bytes)
        assert abs(ratio - exact) <= 0.05, f"{factor}x: estimated {ratio:.3f}, exact LRU {exact:.3f}"


def job_state(outcome: Outcome, job: int) -> tuple[float | None, int, float, int]:
    row = next(j for j in outcome.windows[-1].jobs if j.job == job)
    return row.time_to_steady_s, row.regressions, row.warmup_idle_gpu_s, row.warmup_hub_bytes


@FEW
@given(seed=seeds, compute=st.floats(0.02, 0.1), preprocess=st.floats(0.0, 0.05), workers=st.integers(2, 6))
def test_cold_start_then_warm_steady(seed: int, compute: float, preprocess: float, workers: int) -> None:
    spec = JobSpec(0, steps=1200, workers=workers, compute_s=compute, preprocess_s=preprocess)
    scenario = Scenario([spec], cache_bytes=800 * MB, seed=seed)
    outcome = correlate(scenario)
    assert_every_rank_close(outcome)
    truth = outcome.generated.truth
    phases = outcome.phases(0)
    assert phases[0][1] == "cold"
    time_to_steady, regressions, _, hub_bytes = job_state(outcome, 0)
    assert time_to_steady is not None
    assert abs(time_to_steady - truth.last_miss_s[0]) <= WITHIN_S
    assert all(phase == "steady" for start, phase in phases if start >= truth.last_miss_s[0] + WITHIN_S)
    assert regressions == 0
    assert hub_bytes == spec.dataset_items * spec.item_bytes  # the whole dataset crossed once, while warming
    assert_gpu_idle_close(outcome)
    assert_whatif_close(outcome, scenario)


@FEW
@given(seed=seeds, oversubscription=st.floats(2.0, 4.0))
def test_working_set_larger_than_cache_thrashes(seed: int, oversubscription: float) -> None:
    spec = JobSpec(0, steps=1200, dataset_items=400)
    scenario = Scenario([spec], cache_bytes=int(400 * MB / oversubscription), seed=seed)
    outcome = correlate(scenario)
    assert_every_rank_close(outcome)
    assert {phase for _, phase in outcome.phases(0)} == {"cold"}
    assert job_state(outcome, 0)[0] is None
    stall = outcome.stall_by_rank()[(0, 0)]
    assert stall.argmax() == REMOTE
    assert_gpu_idle_close(outcome)
    assert_whatif_close(outcome, scenario)


@FEW
@given(seed=seeds, preprocess=st.floats(0.15, 0.4), workers=st.integers(1, 4))
# The job's last two steps, on prefetched batches, were fast in the flushed last window's last quarter:
# step-time dispersion with every read a hit, once counted as a regression.
@example(seed=4828, preprocess=0.3372257468274155, workers=4)
def test_cpu_bound_preprocessing_with_warm_cache(seed: int, preprocess: float, workers: int) -> None:
    spec = JobSpec(0, steps=500, workers=workers, preprocess_s=preprocess, compute_s=0.04)
    scenario = Scenario([spec], cache_bytes=800 * MB, prewarm=True, seed=seed)
    outcome = correlate(scenario)
    assert_every_rank_close(outcome)
    stall = outcome.stall_by_rank()[(0, 0)]
    assert stall[PREPROCESS] > 0.9 * stall.sum()
    time_to_steady, regressions, _, hub_bytes = job_state(outcome, 0)
    assert time_to_steady is not None and time_to_steady <= WITHIN_S
    assert (regressions, hub_bytes) == (0, 0)
    assert_gpu_idle_close(outcome)


@FEW
@given(seed=seeds, outage_start=st.floats(35.0, 50.0))
# A batch's first reads were in long before its last, hung in the outage, ended: booking the wait early on
# them once called 24 s of the outage preprocessing.
@example(seed=4055, outage_start=39.85442875597991)
def test_hub_outage_mid_run(seed: int, outage_start: float) -> None:
    outage = (outage_start, outage_start + 30.0)
    spec = JobSpec(0, steps=2000, new_item_fraction=0.05)
    scenario = Scenario([spec], cache_bytes=800 * MB, prewarm=True, outages=[outage], seed=seed)
    outcome = correlate(scenario)
    assert_every_rank_close(outcome)
    phases = outcome.phases(0)
    left = next(start for start, phase in phases if start > 0 and phase != "steady")
    assert abs(left - outage[0]) <= WITHIN_S
    back = next(start for start, phase in phases if start > left and phase == "steady")
    assert abs(back - outage[1]) <= 2 * WITHIN_S
    assert job_state(outcome, 0)[1] == 1
    stall = outcome.stall_by_rank()[(0, 0)]
    assert stall[REMOTE] > 0.9 * stall.sum()
    assert_gpu_idle_close(outcome)


@FEW
@given(seed=seeds)
def test_mixed_jobs_on_one_node(seed: int) -> None:
    cpu_bound = JobSpec(0, steps=700, preprocess_s=0.2, first_gpu=0)
    io_bound = JobSpec(1, steps=700, ranks=2, dataset_items=300, first_gpu=1, verdicts="spoke")
    scenario = Scenario([cpu_bound, io_bound], cache_bytes=2000 * MB, seed=seed)
    outcome = correlate(scenario)
    assert_every_rank_close(outcome)
    assert {key[0] for key in outcome.stall_by_rank()} == {0, 1}
    assert_gpu_idle_close(outcome)
    for job in (0, 1):
        assert job_state(outcome, job)[1] == 0  # one job ending first is no regression
    gpus = {(g.job, g.gpu) for w in outcome.windows for g in w.gpus}
    assert gpus <= {(0, 0), (1, 1), (1, 2)}
    assert_whatif_close(outcome, scenario)


@FEW
@given(seed=seeds, skew=st.floats(0.0, 0.0005))
def test_skewed_reader_clocks_within_bounds(seed: int, skew: float) -> None:
    """Worker clocks off by up to 0.5 ms against reads and preprocessing of tens of ms."""
    spec = JobSpec(0, steps=1200, clock_skew_s=skew, workers=4, preprocess_s=0.05)
    assert_every_rank_close(correlate(Scenario([spec], cache_bytes=800 * MB, seed=seed)))


@FEW
@given(seed=seeds, skew=st.floats(0.0, 0.005))
def test_skew_moves_each_stall_by_at_most_twice_the_skew(seed: int, skew: float) -> None:
    """The general bound: a clock off by s shifts a stall's cause boundaries by s, each cause by <= 2s."""
    spec = JobSpec(0, steps=800, clock_skew_s=skew, workers=3)
    outcome = correlate(Scenario([spec], cache_bytes=800 * MB, seed=seed))
    truth, stalls = outcome.generated.truth.stall_s[(0, 0)], outcome.generated.truth.stalls[(0, 0)]
    error = np.abs(outcome.stall_by_rank()[(0, 0)] - truth)
    assert np.all(error <= 2 * skew * stalls + 1e-6), (error, skew, stalls)


@FEW
@given(seed=seeds, source=st.sampled_from(["spoke", "latency"]))
def test_verdicts_from_the_spoke_log_or_learnt_latency(seed: int, source: str) -> None:
    scenario = Scenario([JobSpec(0, steps=1200, verdicts=source)], cache_bytes=800 * MB, seed=seed)
    outcome = correlate(scenario)
    assert_every_rank_close(outcome)
    assert job_state(outcome, 0)[0] is not None


@FEW
@given(seed=seeds)
def test_untagged_reads_fall_back_to_overlap(seed: int) -> None:
    """One worker, no batch tags: the reads overlapping a wait are the awaited batch's reads."""
    spec = JobSpec(0, steps=1000, tagged=False, workers=1, preprocess_s=0.0)
    outcome = correlate(Scenario([spec], cache_bytes=800 * MB, seed=seed))
    assert_every_rank_close(outcome)


def test_untagged_preprocessing_is_other() -> None:
    """Without tags a busy worker cannot be told from an idle one: documented as a failure mode."""
    spec = JobSpec(0, steps=300, tagged=False, workers=1, preprocess_s=0.2)
    outcome = correlate(Scenario([spec], cache_bytes=800 * MB, prewarm=True, seed=1))
    truth = outcome.generated.truth.stall_s[(0, 0)]
    got = outcome.stall_by_rank()[(0, 0)]
    assert got[PREPROCESS] == 0
    assert got[OTHER] >= 0.95 * truth[PREPROCESS]
    assert got.sum() == pytest.approx(truth.sum())


def test_windows_are_event_time_and_cover_the_run() -> None:
    outcome = correlate(Scenario([JobSpec(0, steps=600)], cache_bytes=800 * MB, seed=3))
    before = [w for w in outcome.windows if w.start_ns < BASE_NS]
    assert before and not any(w.ranks for w in before)  # GPU samples from before the job began: windows of their own
    starts = [(w.start_ns - BASE_NS) / 1e9 for w in outcome.windows[len(before):]]
    assert starts == [WINDOW_S * i for i in range(len(starts))]
    last_step = max((w.start_ns - BASE_NS) / 1e9 for w in outcome.windows if w.ranks)
    assert last_step <= outcome.generated.truth.end_s < last_step + WINDOW_S  # later windows: trailing GPU samples
    assert outcome.correlator is not None and not outcome.correlator.windows.late


def phase_changes(phases: list[tuple[float, str]]) -> int:
    return sum(a != b for (_, a), (_, b) in itertools.pairwise(phases))


@FEW
@given(seed=seeds)
def test_a_steady_job_with_a_partial_hit_ratio_keeps_its_phase(seed: int) -> None:
    """11 % of reads are of never-seen items: the hit ratio over each span the warm-up detector judges
    (5 s) wobbles around 0.89, across the steady threshold (0.9); the phase may settle once but never
    flaps, and nothing is a regression."""
    spec = JobSpec(0, steps=1500, new_item_fraction=0.11)
    outcome = correlate(Scenario([spec], cache_bytes=800 * MB, prewarm=True, seed=seed))
    span = CorrelatorSettings().warmup.span_s
    hits: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for w in outcome.windows:
        for j in w.jobs:
            if j.hit_ratio is not None:
                tally = hits[int((w.start_ns - BASE_NS) / 1e9 // span)]
                tally[0] += j.hit_ratio * j.reads
                tally[1] += j.reads
    ratios = [hit / reads for hit, reads in hits.values() if reads]
    assert min(ratios) > 0.8 and max(ratios) < 0.95
    assert phase_changes(outcome.phases(0)) <= 1
    assert job_state(outcome, 0)[1] == 0


@FEW
@given(seed=seeds, at=st.floats(30.0, 45.0), regression=st.sampled_from(["eviction", "outage"]))
def test_a_regression_of_a_partly_missing_steady_job_is_caught_within_a_window(
        seed: int, at: float, regression: str) -> None:
    spec = JobSpec(0, steps=2000, new_item_fraction=0.06)
    scenario = Scenario([spec], cache_bytes=800 * MB, prewarm=True, seed=seed,
                        evictions=[at] if regression == "eviction" else [],
                        outages=[(at, at + 20.0)] if regression == "outage" else [])
    outcome = correlate(scenario)
    phases = outcome.phases(0)
    before = [(start, phase) for start, phase in phases if start + WINDOW_S <= at]
    assert {phase for _, phase in before} == {"steady"}
    left = next(start for start, phase in phases if start + WINDOW_S > at and phase != "steady")
    assert left - at <= WITHIN_S
    assert job_state(outcome, 0)[1] >= 1


@FEW
@given(seed=seeds, delivery=st.floats(0.01, 0.08), prewarm=st.booleans())
def test_delivery_after_the_worker_handed_the_batch_over_is_its_own_cause(
        seed: int, delivery: float, prewarm: bool) -> None:
    """Large batches: each takes tens of ms from its worker to the trainer. The handover stamp splits
    it off, so preprocessing keeps only the worker's own time."""
    spec = JobSpec(0, steps=800, workers=3, preprocess_s=0.03, delivery_s=delivery)
    outcome = correlate(Scenario([spec], cache_bytes=800 * MB, prewarm=prewarm, seed=seed))
    assert_every_rank_close(outcome)
    assert_gpu_idle_close(outcome)
    # Delivery is booked as such (a cold spoke's fetches can make it a small share of the stall: seed 14169).
    truth = outcome.generated.truth.stall_s[(0, 0)]
    assert outcome.stall_by_rank()[(0, 0)][DELIVERY] > 0.9 * truth[DELIVERY] > 0


@pytest.mark.parametrize("spec, scenario", [
    (JobSpec(0, steps=2000, new_item_fraction=0.05), {"cache_bytes": 800 * MB, "prewarm": True,
                                                      "outages": [(40.0, 70.0)]}),
    (JobSpec(0, steps=300, workers=1, prefetch=1, reads_per_batch=40), {"cache_bytes": 800 * MB,
                                                                        "miss_s": (0.2, 0.4)}),
    (JobSpec(0, steps=120, preprocess_s=2.5, workers=1, prefetch=1), {"cache_bytes": 800 * MB, "prewarm": True}),
    (JobSpec(0, steps=100, delivery_s=2.0, workers=1, prefetch=1), {"cache_bytes": 800 * MB}),
], ids=["outage", "slow-hub", "preprocessing", "delivery"])
def test_booking_stalls_while_open_keeps_the_after_the_fact_totals(spec: JobSpec, scenario: dict[str, Any]) -> None:
    """Live booking splits a stall's seconds between the windows it spans as they close, from what is in flight;
    per cause, the run's totals stay within 1 % of the stall of booking each stall once its step arrived."""
    live, after = (correlate(Scenario([spec], seed=7, in_flight=in_flight, **scenario)) for in_flight in (True, False))
    booked_open = [row for window in live.windows for row in window.ranks if row.steps == 0 and any(row.stall_s)]
    assert len(booked_open) > 50  # windows whose stall seconds were booked while the stall was under way
    got, want = live.stall_by_rank()[(0, 0)], after.stall_by_rank()[(0, 0)]
    assert abs(got.sum() - want.sum()) <= 1e-6 * want.sum()
    assert np.abs(got - want).max() <= 0.01 * want.sum(), f"{got} against {want}"
    gpu_idle = [sum(sum(row.idle_s) for part in outcome.parts() for row in part.gpus) for outcome in (live, after)]
    assert abs(gpu_idle[0] - gpu_idle[1]) <= 0.01 * gpu_idle[1]
