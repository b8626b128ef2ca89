"""Correlator throughput: events per second on one core, vectorised pipeline vs per-event streamz.

Both run in this process, pinned to one core, over the same synthetic node: ranks whose steps wait
on batches of tagged reads (hits and misses), plus GPU samples. The vectorised pipeline does all of
its work (windows, verdicts, attribution, GPU idle, warm-up, what-if) with the default settings; the
per-event pipeline only the attribution. Both attributions are compared before any figure is printed.
Each run measures both pipelines one after the other; the median of the runs' ratios is the figure. Each
run also measures the vectorised pipeline on the NumPy versions of the correlator's C kernels (what the
`py3-none-any` wheel runs), beside.

Two densities, side by side: the synthetic node (64 reads a batch, 5,280 events/s: a window holds few
events, so each window's fixed costs weigh most) and the agent's nominal load (`--rate`, 50,000 events/s
per node by default: DESIGN's target), the same node with more reads a batch.

    python benchmarks/correlator_throughput.py [--events 3000000] [--naive-events 200000] [--runs 3] [--rate 50000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

try:
    from naive_attribution import NaiveAttributor  # run as a script: a sibling
except ImportError:  # imported as benchmarks.correlator_throughput (tests/test_correlator_speed.py)
    from benchmarks.naive_attribution import NaiveAttributor

from stallwatch.catalogue import CAUSES
from stallwatch.correlator import native
from stallwatch.correlator.pipeline import CorrelatorPipeline
from stallwatch.correlator.results import WindowResult
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.eventbatch import SCHEMAS, EventBatch, Verdict

READS_PER_BATCH = 64  # e.g. images of 1 MiB: 8 ranks x 10 steps/s x 64 = 5,120 reads/s per node
STEP_NS = 100_000_000
NOMINAL_RATE = 50_000  # events/s per node the agent is built for (DESIGN.md)
SLICE_NS = 500_000_000  # batches as the agent receives them: each kind, half a second at a time


def synthesise(n_events: int, ranks: int, seed: int, reads_per_batch: int = READS_PER_BATCH) -> list[EventBatch]:
    """Steps every 100 ms per rank, each waiting 0-60 ms on a batch of `reads_per_batch` reads, and 10 Hz GPU
    samples."""
    rng = np.random.default_rng(seed)
    steps_per_rank = n_events // (ranks * (reads_per_batch + 1))
    k = np.tile(np.arange(steps_per_rank), ranks)
    rank = np.repeat(np.arange(ranks), steps_per_rank)
    ws = 10**12 + k * STEP_NS + rank * 1_000_000
    we = ws + rng.integers(0, 60_000_000, k.size)
    n_reads = k.size * reads_per_batch
    owner = np.repeat(np.arange(k.size), reads_per_batch)
    miss = rng.random(n_reads) < 0.05
    start = we[owner] - rng.integers(1_000_000, 150_000_000, n_reads)
    duration = np.where(miss, rng.integers(10_000_000, 40_000_000, n_reads), rng.integers(200_000, 3_000_000, n_reads))
    end = np.minimum(start + duration, we[owner])
    keys = (rng.integers(0, 200_000, n_reads).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    step_columns: dict[str, np.ndarray] = {
        "job": np.zeros(k.size, np.int32), "rank": rank.astype(np.int32), "gpu": rank.astype(np.int16),
        "batch": k.astype(np.int64), "wait_start_ns": ws, "wait_end_ns": we, "compute_end_ns": ws + STEP_NS - 1,
        "ready_ns": np.full(k.size, -1, np.int64)}
    read_columns = {"job": np.zeros(n_reads, np.int32), "rank": rank[owner].astype(np.int32),
                    "worker": (k[owner] % 4).astype(np.int16), "batch": k[owner].astype(np.int64), "key": keys,
                    "bytes": np.full(n_reads, 1 << 20, np.int64), "start_ns": start, "end_ns": end,
                    "verdict": np.where(miss, Verdict.MISS, Verdict.HIT).astype(np.int8)}
    ticks = np.arange(ws.min() + STEP_NS, ws.max() + STEP_NS, STEP_NS)
    gpu_columns = {"ts_ns": np.repeat(ticks, ranks), "period_ns": np.full(ticks.size * ranks, STEP_NS, np.int64),
                   "gpu": np.tile(np.arange(ranks), ticks.size).astype(np.int16),
                   "util": rng.random(ticks.size * ranks).astype(np.float32)}
    return _interleave({"step": step_columns, "read": read_columns, "gpu_util": gpu_columns})


def reads_per_batch(rate: float, ranks: int) -> int:
    """The reads a batch that make `rate` events/s per node: each step brings a step, its reads and a GPU sample."""
    return max(round(rate * STEP_NS / 1e9 / ranks) - 2, 1)


def _interleave(kinds: dict[str, dict[str, np.ndarray]]) -> list[EventBatch]:
    """Cut each kind into half-second batches by event time and merge them in time order."""
    pieces = []
    for kind, columns in kinds.items():
        times = columns[SCHEMAS[kind].event_time]
        order = np.argsort(times, kind="stable")
        slices = times[order] // SLICE_NS
        cuts = np.flatnonzero(np.diff(slices)) + 1
        for rows, slice_index in zip(np.split(order, cuts), slices[np.r_[0, cuts]], strict=True):
            batch = EventBatch.of(kind, {name: column[rows] for name, column in columns.items()})
            pieces.append((int(slice_index), kind, batch))
    pieces.sort(key=lambda piece: (piece[0], piece[1]))
    return [batch for _, _, batch in pieces]


def vectorised(batches: list[EventBatch]) -> tuple[float, np.ndarray]:
    totals = np.zeros(len(CAUSES))

    def add(result: WindowResult) -> None:
        nonlocal totals
        for row in result.ranks:
            totals = totals + np.array(row.stall_s)

    correlator = CorrelatorPipeline(CorrelatorSettings(cache_capacity_bytes=64 << 30), listeners=[add])
    started = time.process_time()
    correlator.run(batches)
    return time.process_time() - started, totals


def naive(batches: list[EventBatch]) -> tuple[float, np.ndarray]:
    attributor = NaiveAttributor(threshold_ns=1_000_000, lookback_ns=5_000_000_000)
    started = time.process_time()
    for batch in batches:
        attributor.source.emit(batch)
    seconds = time.process_time() - started
    return seconds, np.array(np.sum(list(attributor.stall_ns.values()), axis=0), dtype=np.float64) / 1e9


def rates(big: list[EventBatch], small: list[EventBatch]) -> tuple[float, float]:
    """Events per CPU second of the vectorised pipeline over `big` and of the per-event one over `small`,
    measured one after the other."""
    vector_seconds, _ = vectorised(big)
    naive_seconds, _ = naive(small)
    return sum(map(len, big)) / vector_seconds, sum(map(len, small)) / naive_seconds


def numpy_rate(big: list[EventBatch]) -> float | None:
    """Events per CPU second of the vectorised pipeline over `big` on the NumPy versions of its C kernels (what
    the `py3-none-any` wheel runs); None where the kernels are not built, and it runs those anyway."""
    if native.kernels is None:
        return None
    with native.numpy_versions():
        seconds, _ = vectorised(big)
    return sum(map(len, big)) / seconds


def measure(options: argparse.Namespace, reads: int) -> str:
    """Check that both pipelines attribute alike at `reads` a batch, print each run's rates; the summary line."""
    big = synthesise(options.events, options.ranks, seed=1, reads_per_batch=reads)
    small = synthesise(options.naive_events, options.ranks, seed=2, reads_per_batch=reads)
    n_big, n_small = sum(map(len, big)), sum(map(len, small))
    rate = options.ranks * 1e9 / STEP_NS * (reads + 2)
    print(f"{rate:,.0f} events/s per node ({reads} reads a batch)")
    _, check_vectorised = vectorised(small)
    _, check_naive = naive(small)
    if not np.allclose(check_vectorised, check_naive, rtol=1e-9, atol=1e-6):
        raise SystemExit(f"attributions differ: vectorised {check_vectorised} vs per-event {check_naive}")
    print(f"  attribution agrees on {n_small:,} events: " + ", ".join(
        f"{cause} {seconds:.1f} s" for cause, seconds in zip(CAUSES, check_naive, strict=True)))
    print(f"  vectorised over {n_big:,} events, per-event streamz over {n_small:,}; CPU time, one core")
    if native.kernels is None:
        print("  the correlator's C kernels are not built (setup.py): the vectorised figures are its NumPy versions'")
    ratios, vector_rates, numpy_ratios = [], [], []
    for run in range(1, options.runs + 1):
        vector_rate, naive_rate = rates(big, small)
        without = numpy_rate(big)
        ratios.append(vector_rate / naive_rate)
        vector_rates.append(vector_rate)
        print(f"  run {run}: vectorised {vector_rate / 1e6:.2f} M events/s, per-event {naive_rate / 1e6:.3f} M "
              f"events/s, ratio {ratios[-1]:.1f}x" + ("" if without is None else
              f"; NumPy kernels {without / 1e6:.2f} M events/s ({without / naive_rate:.1f}x)"))
        if without is not None:
            numpy_ratios.append(without / naive_rate)
    on_numpy = f" ({statistics.median(numpy_ratios):.1f}x on NumPy kernels)" if numpy_ratios else ""
    return (f"{rate:>9,.0f} events/s per node: vectorised {statistics.median(vector_rates) / 1e6:.2f} M events/s, "
            f"ratio {statistics.median(ratios):.1f}x{on_numpy} (medians of {options.runs} runs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=3_000_000)
    parser.add_argument("--naive-events", type=int, default=200_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", type=float, default=NOMINAL_RATE,
                        help="the second density, in events/s per node (default: the agent's nominal load)")
    options = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    summaries = [measure(options, reads) for reads in (READS_PER_BATCH, reads_per_batch(options.rate, options.ranks))]
    print("\n".join(summaries))


if __name__ == "__main__":
    main()
