"""The agent's job stall counter: the time in which any of a job's ranks on the node stalled (the union in
time), which in a synchronous job is the sum over steps of the longest local wait."""

from __future__ import annotations

import numpy as np

from stallwatch.correlator.pipeline import CorrelatorPipeline
from stallwatch.correlator.results import WindowResult
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.eventbatch import EventBatch
from tests.scenarios.generator import BASE_NS


def steps(rank: int, waits: list[tuple[float, float]], compute_end_s: list[float]) -> EventBatch:
    start = (np.array([w[0] for w in waits]) * 1e9).astype(np.int64) + BASE_NS
    end = (np.array([w[1] for w in waits]) * 1e9).astype(np.int64) + BASE_NS
    n = start.size
    return EventBatch("step", {"job": np.zeros(n, np.int32), "rank": np.full(n, rank, np.int32),
                               "gpu": np.full(n, rank, np.int16), "batch": np.arange(n, dtype=np.int64),
                               "wait_start_ns": start, "wait_end_ns": end,
                               "compute_end_ns": (np.array(compute_end_s) * 1e9).astype(np.int64) + BASE_NS,
                               "ready_ns": np.full(n, -1, np.int64)})


def test_the_job_stall_is_the_union_of_its_ranks_stalls_not_their_sum_or_largest_sum() -> None:
    windows: list[WindowResult] = []
    correlator = CorrelatorPipeline(CorrelatorSettings(window_s=1.0, lateness_s=0.5), listeners=[windows.append])
    # Two steps; both ranks leave the previous all-reduce together, so their waits of a step start together.
    # Step 1: rank 0 waits 0.2 s, rank 1 0.3 s; step 2: rank 0 waits 0.4 s, rank 1 0.05 s.
    correlator.emit(steps(0, [(0.0, 0.2), (0.5, 0.9)], [0.45, 0.99]))
    correlator.emit(steps(1, [(0.0, 0.3), (0.5, 0.55)], [0.45, 0.99]))
    correlator.run([])
    stalled = sum(j.stalled_s for w in windows for j in w.jobs)
    per_rank = [sum(sum(r.stall_s) for w in windows for r in w.ranks if r.rank == rank) for rank in (0, 1)]
    assert abs(stalled - 0.7) < 1e-6  # per step the longest wait: 0.3 + 0.4
    assert max(per_rank) < stalled < sum(per_rank)  # the ranks' largest sum falls short, their sum overshoots
