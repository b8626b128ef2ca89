"""The vectorised correlator against the per-event streamz pipeline, side by side in one process.

A ratio of events per CPU second, never an absolute time: a busy machine slows both alike. The
workload is the throughput benchmark's synthetic node at the agent's nominal load, 50,000 events/s
(benchmarks/correlator_throughput.py, which also checks that both attribute alike), smaller, with the
default settings. At the benchmark's sparser default node (5,280 events/s) a window's fixed costs weigh
most and the ratio is lower (about 6x): docs/benchmarks.md has both figures.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.correlator_throughput import NOMINAL_RATE, rates, reads_per_batch, synthesise
from stallwatch.correlator.reuse import earlier_and_larger
from tests.kernels import IMPLEMENTATIONS, using

LEAST_RATIO = 10.0
ROUNDS = 3  # each pipeline's best round counts: a round slowed by another tenant does not


def test_the_vectorised_correlator_keeps_ten_times_the_per_event_pipelines_rate_at_the_nominal_load() -> None:
    reads = reads_per_batch(NOMINAL_RATE, 8)
    # 20 s of events, 40 windows: the vectorised side's per-window costs weigh as in a long run.
    big = synthesise(1_000_000, 8, seed=1, reads_per_batch=reads)
    small = synthesise(60_000, 8, seed=2, reads_per_batch=reads)
    measured = [rates(big, small) for _ in range(ROUNDS)]
    vector_rate = max(vector for vector, _ in measured)
    naive_rate = max(naive for _, naive in measured)
    assert vector_rate / naive_rate >= LEAST_RATIO, (
        f"vectorised {vector_rate / 1e6:.2f} M events/s is {vector_rate / naive_rate:.1f}x the per-event "
        f"{naive_rate / 1e6:.3f} M events/s, under {LEAST_RATIO:.0f}x")


@IMPLEMENTATIONS
@pytest.mark.parametrize("spread", [1, 10**9])
@pytest.mark.parametrize("m", [3, 64, 65, 200, 1280, 1281, 2000])
def test_the_dominance_sum_in_blocks_for_few_points_and_merges_for_many_alike(implementation: str, m: int,
                                                                               spread: int) -> None:
    """The what-if's `earlier_and_larger` works, in NumPy, in blocks of 64 points up to 1,280 points (one block:
    a pairwise comparison), by merge passes past them; in C by a Fenwick tree, over the values' ranks where they
    lie far apart (`spread`). All give the brute-force sum."""
    rng = np.random.default_rng(m)
    values = rng.permutation(4 * m)[:m].astype(np.int64) * spread
    weights = rng.integers(1, 1 << 30, m).astype(np.float64)
    expected = [weights[:q][values[:q] > values[q]].sum() for q in range(m)]
    with using(implementation):
        assert earlier_and_larger(values, weights).tolist() == expected
