"""The correlator's parts against brute force, and its edges: lateness, bad input, files, threads."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from stallwatch import catalogue
from stallwatch.client import wire
from stallwatch.correlator.attribution import Reads, Steps, attribute, gpu_idle_in_stalls, with_retry_backoff
from stallwatch.correlator.eventfile import EventFileError, EventFileWriter, read_events, recorded_wall_offset
from stallwatch.correlator.intervals import (
    composite_key,
    covered_and_subsets,
    distinct_ids,
    equal_join_columns,
    overlap_join,
    union_length,
)
from stallwatch.correlator.live import LiveCorrelator
from stallwatch.correlator.metrics import whatif_spoke_label
from stallwatch.correlator.pipeline import CorrelatorPipeline
from stallwatch.correlator.results import WindowResult
from stallwatch.correlator.reuse import reuse_distances
from stallwatch.correlator.settings import CorrelatorSettings, seconds_to_ns
from stallwatch.correlator.verdicts import LatencySplit
from stallwatch.correlator.wallclock import wall_offset_ns
from stallwatch.correlator.warmup import JobWindow, WarmupTracker
from stallwatch.correlator.whatif import FEED_SLICE, MissRatioCurve
from stallwatch.correlator.windows import MERGE_EVENTS, EventTimeWindows, _Chunk, _merge
from stallwatch.eventbatch import SCHEMAS, EventBatch, Interner, MalformedEventBatchError, Verdict
from tests.kernels import BUILT, IMPLEMENTATIONS, using
from tests.scenarios.generator import BASE_NS, JobSpec, LruCache, Scenario, exact_lru_hit_ratio, generate
from tests.scenarios.run import correlate

ROOT = Path(__file__).resolve().parent.parent
intervals = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1000), st.integers(0, 300)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(rows=intervals)
def test_union_length_matches_brute_force(rows: list[tuple[int, int, int]]) -> None:
    group = np.array([g for g, _, _ in rows], dtype=np.int64)
    start = np.array([s for _, s, _ in rows], dtype=np.int64)
    end = start + np.array([d for _, _, d in rows], dtype=np.int64)
    expected = [len({t for g, s, d in rows if g == k for t in range(s, s + d)}) for k in range(4)]
    assert union_length(group, start, end, 4).tolist() == expected


@IMPLEMENTATIONS
@settings(max_examples=120, deadline=None)
@given(rows=intervals, flags=st.lists(st.booleans(), min_size=40, max_size=40),
       order=st.sampled_from(["given", "end", "start"]))
def test_covered_and_subsets_match_brute_force_in_any_row_order(
        implementation: str, rows: list[tuple[int, int, int]], flags: list[bool], order: str) -> None:
    """A worker's reads come in end order, others in start order or neither: each takes its own path."""
    if order != "given":
        rows = sorted(rows, key=lambda r: r[1] + r[2] if order == "end" else r[1])
    group = np.array([g for g, _, _ in rows], dtype=np.int64)
    start = np.array([s for _, s, _ in rows], dtype=np.int64)
    end = start + np.array([d for _, _, d in rows], dtype=np.int64)
    chosen = np.array(flags[:len(rows)], dtype=bool)
    with using(implementation):
        cover, (chosen_cover,), first = covered_and_subsets(group, start, end, (chosen,), 4)

    def covered(k: int, only_chosen: bool) -> int:
        return len({t for i, (g, s, d) in enumerate(rows) if g == k and (chosen[i] or not only_chosen)
                    for t in range(s, s + d)})

    assert cover.tolist() == [covered(k, False) for k in range(4)]
    assert chosen_cover.tolist() == [covered(k, True) for k in range(4)]
    assert first.tolist() == [min((s for g, s, _ in rows if g == k), default=np.iinfo(np.int64).max)
                              for k in range(4)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-3, 3) | st.integers(-2**31, 2**31 - 1), max_size=30),
       st.sampled_from([np.int16, np.int32, np.int64]))
def test_distinct_ids_are_the_distinct_values_in_order(values: list[int], dtype: type) -> None:
    column: np.ndarray = np.array(values, dtype=np.int64).astype(dtype)  # wrapped into narrower types
    assert distinct_ids(column) == sorted(set(column.tolist()))
    wide = np.arange(-20_000, 20_000, dtype=np.int16)  # a range dense enough for the table, past int16 from its low
    assert distinct_ids(wide) == wide.tolist()


@IMPLEMENTATIONS
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(*[st.integers(-2, 6)] * 3), max_size=12, unique=True),
       st.lists(st.tuples(*[st.integers(-3, 8) | st.integers(-2**31, 2**31 - 1)] * 3), max_size=40),
       st.integers(0, 2**62))
def test_equal_join_columns_matches_brute_force(implementation: str, left: list[tuple[int, int, int]],
                                               right: list[tuple[int, int, int]], far: int) -> None:
    """A window's stalls (distinct (batch, job, rank)) joined to its reads: the table path (keys in a small
    range) and the packed path (a batch `far` away makes the table too sparse) find the same pairs."""
    expected = {(a, b) for a, row in enumerate(left) for b, other in enumerate(right) if row == other}
    for shift in (0, far):
        def columns(rows: list[tuple[int, int, int]], dtype: type, shift: int = shift) -> list[np.ndarray]:
            batches = [r[0] + (shift if r[0] > 4 else 0) for r in rows]
            return [np.array(batches, dtype=np.int64)] + [np.array([r[k] for r in rows], dtype=dtype)
                                                          for k in (1, 2)]
        with using(implementation):
            i, j = equal_join_columns(columns(left, np.int64), columns(right, np.int32))
        assert sorted(zip(i.tolist(), j.tolist(), strict=True)) == sorted(expected)


@settings(max_examples=60, deadline=None)
@given(left=intervals, right=intervals)
def test_overlap_join_matches_brute_force(left: list[tuple[int, int, int]], right: list[tuple[int, int, int]]) -> None:
    def columns(rows: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        g = np.array([r[0] for r in rows], dtype=np.int64)
        s = np.array([r[1] for r in rows], dtype=np.int64)
        return g, s, s + np.array([r[2] for r in rows], dtype=np.int64)

    i, j = overlap_join(*columns(left), *columns(right))
    expected = {(a, b) for a, (g, s, d) in enumerate(left) for b, (h, t, e) in enumerate(right)
                if g == h and s < t + e and s + d > t}
    assert set(zip(i.tolist(), j.tolist(), strict=True)) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(*[st.integers(-2**63, 2**63 - 1) | st.integers(-3, 3)] * 3), min_size=1, max_size=30))
def test_composite_keys_keep_the_order_and_the_distinctness_of_rows_however_far_apart(
        rows: list[tuple[int, int, int]]) -> None:
    """A forged batch number of 2^62 (or ranks at both ends of int64) must not wrap the packed key: rows
    that differ get different keys, in the rows' lexicographic order."""
    columns = [np.array(column, dtype=np.int64) for column in zip(*rows, strict=True)]
    key = composite_key(*columns).tolist()
    for (a, key_a), (b, key_b) in itertools.product(zip(rows, key, strict=True), repeat=2):
        assert (a < b) == (key_a < key_b) and (a == b) == (key_a == key_b), (a, b, key_a, key_b)


def test_a_forged_batch_number_attributes_like_any_other() -> None:
    """Two ranks on batches 0 and 2^62: each stall joins its own batch's read, as with batches 0 and 1."""
    ms = 1_000_000

    def a(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    def split(batches: np.ndarray) -> list[list[float]]:
        steps = Steps(job=a(0, 0), rank=a(0, 1), gpu=a(0, 1), batch=batches, wait_start=a(0, 0),
                      wait_end=a(100 * ms, 100 * ms), compute_end=a(150 * ms, 150 * ms), ready=a(-1, -1))
        reads = Reads(job=a(0, 0), rank=a(0, 1), batch=batches, start=a(10 * ms, 10 * ms), end=a(40 * ms, 90 * ms),
                      verdict=np.array([Verdict.MISS, Verdict.HIT], np.int8))
        return (attribute(steps, reads, threshold_ns=ms).cause_ns / ms).tolist()

    assert split(a(0, 2**62)) == split(a(0, 1)) == [[30, 0, 0, 60, 0, 10], [0, 80, 0, 10, 0, 10]]


@pytest.mark.skipif(BUILT is None, reason="the C kernels are not built (setup.py)")
def test_the_c_kernels_refuse_arrays_they_cannot_read_with_an_error_not_a_crash() -> None:
    assert BUILT is not None
    ints, floats = np.arange(4, dtype=np.int64), np.zeros(4)
    cover, first = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64)
    masks, no_subsets = np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.int64)
    with pytest.raises(TypeError, match="group: expected a one-dimensional array of int64"):
        BUILT.covered_and_subsets(floats, ints, ints, masks, 0, cover, no_subsets, first)
    with pytest.raises(ValueError, match="end: 3 items, expected 4"):
        BUILT.covered_and_subsets(ints, ints, ints[:3], masks, 0, cover, no_subsets, first)
    with pytest.raises(IndexError, match="group 4 of row 3 is outside"):
        BUILT.covered_and_subsets(ints + 1, ints, ints, masks, 0, cover, no_subsets, first)
    with pytest.raises(TypeError, match="expected a one-dimensional"):
        BUILT.covered_and_subsets(np.zeros((2, 2), dtype=np.int64), ints, ints, masks, 0, cover, no_subsets, first)
    with pytest.raises(ValueError, match="C-contiguous"):  # NumPy will not lend a strided view as contiguous
        BUILT.earlier_and_larger(np.arange(8, dtype=np.int64)[::2], floats, floats.copy())
    with pytest.raises(ValueError, match="values: -1 is negative"):
        BUILT.earlier_and_larger(np.array([0, -1]), np.ones(2), np.zeros(2))
    with pytest.raises(ValueError, match="read-only"):  # results into an array that may not be written
        BUILT.earlier_and_larger(np.arange(2), np.ones(2), np.frombuffer(bytes(16)))
    with pytest.raises(ValueError, match="spans"):  # a table smaller than its keys' range: no read past it
        BUILT.equal_join_table(np.full(3, -1), np.zeros(1, dtype=np.int64), np.array([4]), (ints,), ints.copy(),
                               ints.copy())
    extreme = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max], dtype=np.int64)  # forged times
    BUILT.covered_and_subsets(np.zeros(2, dtype=np.int64), extreme, extreme[::-1].copy(), masks, 0, cover[:1],
                              no_subsets, first[:1])
    assert first[0] == np.iinfo(np.int64).min


def test_the_correlator_books_the_same_with_its_c_kernels_as_with_numpy() -> None:
    """Whole windows, every row and the what-if, on a node with an outage (long stalls booked as they go),
    two jobs, misses and hits: the C kernels change how fast, never what."""
    jobs = [JobSpec(0, steps=500, new_item_fraction=0.05), JobSpec(1, steps=300, ranks=2, first_gpu=1)]
    scenario = Scenario(jobs, cache_bytes=200 << 20, outages=[(8.0, 14.0)], seed=3)
    outcomes = {}
    for implementation in ("c", "numpy") if BUILT is not None else ("numpy",):
        with using(implementation):
            outcomes[implementation] = [dataclasses.asdict(window) for window in correlate(scenario).windows]
    assert len(outcomes["numpy"]) > 20
    assert sum(row["stall_s"][0] for window in outcomes["numpy"] for row in window["ranks"]) > 5  # the outage
    if BUILT is not None:
        np.testing.assert_equal(outcomes["c"], outcomes["numpy"])


def test_worked_example_of_the_docs() -> None:
    """docs/attribution.md: a 100 ms wait on batch 5; a miss 10-40 ms, a hit 30-60 ms, handed over at 90."""
    ms = 1_000_000

    def a(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    steps = Steps(job=a(0), rank=a(0), gpu=a(0), batch=a(5), wait_start=a(0), wait_end=a(100 * ms),
                  compute_end=a(150 * ms), ready=a(90 * ms))
    miss_hit = np.array([Verdict.MISS, Verdict.HIT], np.int8)
    tagged = Reads(job=a(0, 0), rank=a(0, 0), batch=a(5, 5), start=a(10 * ms, 30 * ms), end=a(40 * ms, 60 * ms),
                   verdict=miss_hit)
    split = attribute(steps, tagged, threshold_ns=ms)
    assert (split.cause_ns[0] / ms).tolist() == [30, 20, 0, 30, 10, 10]
    untagged = Reads(tagged.job, tagged.rank, a(-1, -1), tagged.start, tagged.end, tagged.verdict)
    assert (attribute(steps, untagged, threshold_ns=ms).cause_ns[0] / ms).tolist() == [30, 20, 0, 0, 10, 40]
    unknown_handover = Steps(**{**vars(steps), "ready": a(-1)})
    assert (attribute(unknown_handover, tagged, threshold_ns=ms).cause_ns[0] / ms).tolist() == [30, 20, 0, 40, 0, 10]
    idle = gpu_idle_in_stalls(steps, split, sample_ts=a(50 * ms, 100 * ms), sample_period=a(50 * ms, 50 * ms),
                              sample_gpu=a(0, 0), sample_util=np.zeros(2, np.float32))
    assert (idle[0] / ms).tolist() == [30, 20, 0, 30, 10, 10]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(-1, 2), st.integers(0, 2), st.integers(0, 60),
                          st.integers(0, 9), st.booleans()), min_size=1, max_size=24))
def test_a_failed_fetch_lasts_until_its_batch_tries_the_same_key_again(
        rows: list[tuple[int, int, int, int, int, bool]]) -> None:
    """Against the rule read one fetch at a time: a failed fetch of a batch (rank, batch, key, start, length) is a
    miss; it ends where the batch's next read (the first to start once it ended) begins when that read has its
    key, stays as it was when that read has another, and lasts until now when there is none."""
    rank, batch, key, start, length, failed = (np.array(column, dtype=np.int64) for column in zip(*rows, strict=True))
    reads = Reads(job=np.zeros(rank.size, np.int32), rank=rank.astype(np.int32), batch=batch, start=start,
                  end=start + length, verdict=np.full(rank.size, Verdict.HIT, np.int8))
    now = 100
    extended = with_retry_backoff(reads, key.astype(np.uint64), np.flatnonzero(failed), now)
    for i in range(rank.size):
        expected = start[i] + length[i]
        if failed[i] and batch[i] >= 0:
            later = [j for j in range(rank.size) if j != i and (rank[j], batch[j]) == (rank[i], batch[i])
                     and start[j] >= start[i] + length[i]]
            following = min(later, key=lambda j: (start[j], later.index(j))) if later else None
            if following is None:
                expected = max(expected, now)
            elif key[following] == key[i]:
                expected = start[following]
        assert extended.end[i] == expected, (i, rows)
        assert extended.verdict[i] == (Verdict.MISS if failed[i] else Verdict.HIT)


def test_reads_that_cross_no_spoke_are_direct_reads_after_misses_and_before_hits() -> None:
    """The worked example's hit 30-60 ms crossed no spoke: 40-60 ms is `direct_read`. Where reads overlap, a
    miss wins over a direct read and a direct read over a hit."""
    ms = 1_000_000

    def a(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    steps = Steps(job=a(0), rank=a(0), gpu=a(0), batch=a(5), wait_start=a(0), wait_end=a(100 * ms),
                  compute_end=a(150 * ms), ready=a(90 * ms))

    def split(*verdicts: Verdict) -> list[float]:
        reads = Reads(job=a(0, 0), rank=a(0, 0), batch=a(5, 5), start=a(10 * ms, 30 * ms), end=a(40 * ms, 60 * ms),
                      verdict=np.array(verdicts, np.int8))
        return (attribute(steps, reads, threshold_ns=ms).cause_ns[0] / ms).tolist()

    assert split(Verdict.MISS, Verdict.DIRECT) == [30, 0, 20, 30, 10, 10]
    assert split(Verdict.DIRECT, Verdict.HIT) == [0, 20, 30, 30, 10, 10]
    assert split(Verdict.DIRECT, Verdict.DIRECT) == [0, 0, 50, 30, 10, 10]


def test_gpu_samples_cover_their_real_period_and_never_give_more_idle_than_they_saw() -> None:
    """Two stalls of two ranks on GPU 0. The driver skipped samples before the one at 900 ms: the agent
    bounded its period to 400 ms, but it covers 100-900 ms, the stretch since the sample before it."""
    ms = 1_000_000

    def a(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    steps = Steps(job=a(0, 0), rank=a(0, 1), gpu=a(0, 0), batch=a(1, 1), wait_start=a(200 * ms, 300 * ms),
                  wait_end=a(400 * ms, 500 * ms), compute_end=a(950 * ms, 950 * ms), ready=a(-1, -1))
    split = attribute(steps, Reads(a(), a(), a(), a(), a(), np.zeros(0, np.int8)), threshold_ns=ms)
    idle = gpu_idle_in_stalls(steps, split, sample_ts=a(100 * ms, 900 * ms), sample_period=a(100 * ms, 400 * ms),
                              sample_gpu=a(0, 0), sample_util=np.array([1.0, 0.5], np.float32))
    # 400 ms idle in 100-900 ms; the stalls overlap it for 200 ms each: each gets all of its overlap.
    assert (idle.sum(axis=1) / ms).tolist() == pytest.approx([200, 200])
    busier = gpu_idle_in_stalls(steps, split, sample_ts=a(100 * ms, 900 * ms), sample_period=a(100 * ms, 400 * ms),
                                sample_gpu=a(0, 0), sample_util=np.array([1.0, 0.75], np.float32))
    # 200 ms idle, claimed for 400 ms: shared by overlap, never more than the sample saw.
    assert (busier.sum(axis=1) / ms).tolist() == pytest.approx([100, 100])


def test_whatif_sampled_and_bounded_stays_within_five_points_of_exact_lru() -> None:
    """Three jobs' shuffled epochs over datasets of 2,000, 6,000 and 12,000 items of mixed sizes,
    interleaved at random: sampled at 5 % and capped at 512 keys."""
    rng = np.random.default_rng(7)
    streams = []
    for offset, items, epochs in ((0, 2_000, 12), (10_000, 6_000, 4), (20_000, 12_000, 2)):
        streams.append(np.concatenate([offset + rng.permutation(items) for _ in range(epochs)]))
    owner = rng.permutation(np.repeat(np.arange(3), [s.size for s in streams]))
    keys = np.empty(owner.size, dtype=np.int64)
    for job, stream in enumerate(streams):
        keys[owner == job] = stream
    sizes = rng.choice(np.array([64, 256, 1024]) << 10, size=32_000)
    reads = [(int(k) * 0x9E3779B97F4A7C15 % 2**64, int(sizes[k])) for k in keys]
    curve = MissRatioCurve(sample_rate=0.05, max_keys=512)
    key_column = np.array([k for k, _ in reads], dtype=np.uint64)
    size_column = np.array([s for _, s in reads], dtype=np.int64)
    for chunk in range(0, len(reads), 10_000):
        curve.feed(key_column[chunk:chunk + 10_000], size_column[chunk:chunk + 10_000])
    assert curve.sample_rate < 0.05  # the cap lowered the rate
    capacity = 2 << 30
    for factor in (0.5, 1.0, 2.0, 4.0):
        estimate = curve.hit_ratio(factor * capacity)
        assert estimate is not None
        assert abs(estimate - exact_lru_hit_ratio(reads, factor * capacity)) <= 0.05


def test_whatif_folds_a_window_a_slice_at_a_time_with_the_same_distances() -> None:
    """A flood's window of 100k references in one feed (folded in slices of `FEED_SLICE`) gives exactly the
    histogram of the same references fed one slice of 1,000 at a time: the tracked keys carry recency."""
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 6_000, 100_000).astype(np.uint64)
    sizes = rng.choice(np.array([4096, 65536]), size=keys.size).astype(np.int64)
    whole, small = MissRatioCurve(), MissRatioCurve()
    whole.feed(keys, sizes)
    for first in range(0, keys.size, 1_000):
        small.feed(keys[first:first + 1_000], sizes[first:first + 1_000])
    assert keys.size > 3 * FEED_SLICE
    assert whole.references == small.references == keys.size
    for capacity in (2**20, 2**26, 2**28, 2**30):
        assert whole.hit_ratio(capacity) == pytest.approx(small.hit_ratio(capacity), abs=1e-12)


@pytest.mark.parametrize(("distinct", "references"), [(500, 80_000), (60_000, 80_000), (60_000, FEED_SLICE)])
def test_whatif_fed_references_out_of_order_with_their_times_is_the_whatif_of_them_in_order(
        distinct: int, references: int) -> None:
    """A window's reads come in no time order: fed with their times, they are sampled and folded exactly as the
    same references fed in time order, failed fetches counted alike, in one slice or several, every key sampled
    or the rate lowered."""
    rng = np.random.default_rng(5)
    keys = rng.integers(0, distinct, references).astype(np.uint64)
    sizes = np.where(rng.random(keys.size) < 0.03, 0, rng.integers(1, 1 << 20, keys.size)).astype(np.int64)
    times = np.cumsum(rng.integers(1, 1_000, keys.size))
    shuffled = rng.permutation(keys.size)
    in_order, out_of_order = MissRatioCurve(max_keys=4_096), MissRatioCurve(max_keys=4_096)
    in_order.feed(keys, sizes)
    out_of_order.feed(keys[shuffled], sizes[shuffled], times[shuffled])
    assert (distinct < 4_096) == (in_order.sample_rate == 1.0)
    assert (out_of_order.references, out_of_order.failed, out_of_order.sample_rate) == (
        in_order.references, in_order.failed, in_order.sample_rate)
    for capacity in (2**20, 2**26, 2**30, 2**34):
        assert out_of_order.hit_ratio(capacity) == in_order.hit_ratio(capacity)


@IMPLEMENTATIONS
@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.integers(0, 12), max_size=80), seed=st.integers(0, 3))
def test_reuse_distances_are_an_exact_lru_at_every_capacity(implementation: str, keys: list[int], seed: int) -> None:
    sizes = [(key * 7 + seed) % 5 + 1 for key in keys]  # a key's size is its own
    with using(implementation):
        distance = reuse_distances(np.array(keys, dtype=np.uint64), np.array(sizes, dtype=np.int64))
    for capacity in range(1, 40, 3):
        cache = LruCache(capacity)
        hits = [cache.access(key, size) for key, size in zip(keys, sizes, strict=True)]
        assert hits == (distance <= capacity).tolist()


@pytest.mark.parametrize("working_set", [100, 1_000, 10_000, 100_000, 1_000_000])
def test_whatif_stays_within_five_points_of_exact_lru_whatever_the_working_set(working_set: int) -> None:
    """Shuffled epochs over `working_set` keys of 64 KiB to 1 MiB (30 epochs of 100 keys, 1.3 of a
    million); 3 % of fetches fail (0 bytes) and are retried at once. A failed fetch is no reference:
    the exact LRU replays the fetches that succeeded. Capacity: 85 % of the working set's bytes."""
    rng = np.random.default_rng(working_set)
    epochs = max(1.3, 3_000 / working_set)
    items = np.concatenate([rng.permutation(working_set) for _ in range(int(np.ceil(epochs)))])
    items = items[: int(epochs * working_set)]
    keys = (items.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    sizes = (np.int64(64) << 10) << (items % 5 * 2 // 3).astype(np.int64)  # 64 KiB, 256 KiB or 1 MiB
    failed = rng.random(keys.size) < 0.03
    stream_keys = np.insert(keys, np.flatnonzero(failed), keys[failed])  # the failure, then its retry
    stream_sizes = np.insert(sizes, np.flatnonzero(failed), 0)
    curve = MissRatioCurve()
    for chunk in range(0, stream_keys.size, 50_000):
        curve.feed(stream_keys[chunk:chunk + 50_000], stream_sizes[chunk:chunk + 50_000])
    assert curve.failed == failed.sum()
    assert (curve.sample_rate == 1.0) == (working_set <= 8192)
    assert curve.keys / curve.sample_rate == pytest.approx(working_set, rel=0.05)
    capacity = 0.85 * float(sizes[:working_set].sum())
    if working_set <= 10_000:  # an independent replay where it is fast enough
        reads = list(zip(keys.tolist(), sizes.tolist(), strict=True))
        exact = {f: exact_lru_hit_ratio(reads, f * capacity) for f in (0.5, 1.0, 2.0, 4.0)}
    else:  # the vectorised reuse distances, exact against a replay in the test above
        distance = reuse_distances(keys, sizes)
        exact = {f: float((distance <= f * capacity).mean()) for f in (0.5, 1.0, 2.0, 4.0)}
    for factor, want in exact.items():
        got = curve.hit_ratio(factor * capacity)
        assert got is not None and abs(got - want) <= 0.05, f"{factor}x: {got:.3f} against exact LRU {want:.3f}"


def _window(hits: int, reads: int = 95, steps: int = 40) -> JobWindow:
    empty = np.zeros(0, dtype=np.int64)
    return JobWindow(steps=steps, ranks=1, step_seconds=np.full(steps, 0.12), step_quarter=np.arange(steps) % 4,
                     reads=reads, hits=hits, hub_bytes=0, stall_idle_gpu_seconds=0.0, stall_start_ns=empty,
                     stall_end_ns=empty)


def test_a_hit_ratio_alternating_by_window_keeps_steady_and_an_eviction_leaves_it_at_once() -> None:
    """The demo's job with a spoke at 85 % of its dataset: windows alternate 0.73 and 1.0 of ~95 reads."""
    tracker = WarmupTracker()
    window_ns = 5 * 10**9
    phases = []
    for i, hits in enumerate([90, 88, 69, 95, 69, 95, 66, 93, 69, 95, 5]):
        state = tracker.update(0, i * window_ns, (i + 1) * window_ns, _window(hits), 0, complete=True)
        phases.append(state.phase)
    assert phases[:-1] == ["steady"] * 10 and state.regressions == 1
    assert phases[-1] == "cold"  # 5 hits of 95: evicted, caught in its own window


def test_latency_split_finds_two_clusters_and_refuses_one() -> None:
    rng = np.random.default_rng(3)
    split = LatencySplit()
    split.learn(rng.uniform(1e6, 3e6, 5000).astype(np.int64))  # all hits, 1-3 ms: one cluster
    assert split.threshold_ns == split.fallback_threshold_ns
    split.learn(rng.uniform(60e6, 90e6, 3000).astype(np.int64))  # misses, 60-90 ms
    assert 3e6 < split.threshold_ns < 60e6


def _steps(job: int, wait_start_s: list[float], wait_s: float, compute_s: float) -> EventBatch:
    ws = (np.array(wait_start_s) * 1e9).astype(np.int64) + BASE_NS
    n = ws.size
    return EventBatch("step", {"job": np.full(n, job, np.int32), "rank": np.zeros(n, np.int32),
                               "gpu": np.zeros(n, np.int16),
                               "batch": np.arange(n, dtype=np.int64), "wait_start_ns": ws,
                               "wait_end_ns": ws + int(wait_s * 1e9),
                               "compute_end_ns": ws + int((wait_s + compute_s) * 1e9),
                               "ready_ns": np.full(n, -1, np.int64)})


def test_late_events_beyond_the_lateness_are_counted_not_attributed() -> None:
    windows: list[WindowResult] = []
    correlator = CorrelatorPipeline(CorrelatorSettings(window_s=1.0, lateness_s=0.5), listeners=[windows.append])
    correlator.emit(_steps(0, [0.1, 0.3], 0.05, 0.05))
    correlator.emit(_steps(0, [3.0], 0.05, 0.05))  # the watermark passes 2.5 s: windows [0,1) and [1,2) close
    correlator.emit(_steps(0, [0.5, 2.1], 0.05, 0.05))  # 0.5 s is late; 2.1 s is within the lateness
    correlator.emit(EventBatch("gpu_util", {"ts_ns": np.array([BASE_NS], np.int64),
                                            "period_ns": np.array([1], np.int64),
                                            "gpu": np.zeros(1, np.int16), "util": np.zeros(1, np.float32)}))
    correlator.run([])
    assert correlator.windows.late == {"step": 1, "gpu_util": 1}
    steps = {(w.start_ns - BASE_NS) // 10**9: sum(r.steps for r in w.ranks) for w in windows}
    assert steps == {0: 2, 2: 1, 3: 1}  # [1, 2) held no event at all: skipped, not published


def _reads(end_s: list[float]) -> EventBatch:
    end = (np.array(end_s) * 1e9).astype(np.int64) + BASE_NS
    n = end.size
    return EventBatch("read", {"job": np.zeros(n, np.int32), "rank": np.zeros(n, np.int32),
                               "worker": np.zeros(n, np.int16),
                               "batch": np.arange(n, dtype=np.int64), "key": np.arange(n, dtype=np.uint64),
                               "bytes": np.full(n, 4096, np.int64), "start_ns": end - 1_000_000, "end_ns": end,
                               "verdict": np.zeros(n, np.int8)})


def test_past_its_cap_the_window_store_sheds_whole_batches_and_counts_every_event() -> None:
    windows: list[WindowResult] = []
    correlator = CorrelatorPipeline(CorrelatorSettings(window_s=1.0, lateness_s=5.0, max_buffered_events=10),
                                    listeners=[windows.append])
    sent = [_steps(0, [0.1 * i for i in range(6)], 0.01, 0.01), _steps(0, [0.7] * 6, 0.01, 0.01),
            _steps(0, [0.8] * 4, 0.01, 0.01), _steps(0, [0.9], 0.01, 0.01)]
    for batch in sent:
        correlator.emit(batch)
        assert correlator.windows.buffered("step") <= 10
    assert correlator.windows.shed == {"step": 7}  # the batch of 6 that did not fit, then the one of 1
    correlator.run([])
    assert sum(r.steps for w in windows for r in w.ranks) == 10  # 17 sent = 10 correlated + 7 shed


def test_at_its_cap_the_store_lets_go_of_used_context_before_shedding_open_windows() -> None:
    correlator = CorrelatorPipeline(CorrelatorSettings(window_s=1.0, lateness_s=0.5, max_buffered_events=10))
    correlator.emit(_reads([0.1 + 0.01 * i for i in range(8)]))
    correlator.emit(_steps(0, [3.0], 0.01, 0.01))  # the watermark passes 2.5 s: [0, 1) closes with its reads
    correlator.emit(_reads([2.6 + 0.01 * i for i in range(8)]))  # fits once the used reads of [0, 1) go
    assert correlator.windows.shed == {} and correlator.windows.buffered("read") == 8
    correlator.emit(_reads([2.7, 2.8, 2.9]))  # the 8 held belong to a window still open: this batch goes
    assert correlator.windows.shed == {"read": 3} and correlator.windows.buffered("read") == 8


@pytest.mark.parametrize("spread_s", [0.5, 30.0])  # offsets fit in 4 bytes, or the column stays int64
def test_merged_compact_chunks_hand_over_exactly_what_came_in(spread_s: float) -> None:
    rng = np.random.default_rng(7)
    n = MERGE_EVENTS + 4_000
    end = BASE_NS + 10**9 + np.sort(rng.integers(0, int(spread_s * 1e9), n))
    reads: dict[str, np.ndarray] = {"job": rng.integers(-2**31, 2**31, n).astype(np.int32),
                                    "rank": rng.integers(0, 3, n).astype(np.int32),
             "worker": np.full(n, -1, np.int16), "batch": rng.integers(-1, 40_000, n),
             "key": rng.integers(0, 2**64, n, dtype=np.uint64), "bytes": rng.integers(0, 2**40, n),
             "start_ns": end - rng.integers(0, 10**9, n), "end_ns": end,
             "verdict": rng.integers(0, 3, n).astype(np.int8)}
    windows = EventTimeWindows(window_ns=10**12, lateness_ns=0, lookback_ns=10**12, retention_ns=10**12,
                               max_buffered_events=10 * n)
    for rows in np.array_split(np.arange(n), 60):
        windows.add("read", {name: column[rows] for name, column in reads.items()})
    assert windows.buffered("read") == n
    (closed,) = windows.flush()
    for name, column in reads.items():
        assert closed.context["read"][name].dtype == SCHEMAS["read"].columns[name]
        assert np.array_equal(closed.context["read"][name], column), name


@given(st.lists(st.integers(-2**40, 2**40), min_size=1, max_size=40), st.integers(-2**41, 2**41))
@example([0, 255], 255)  # a row at the top of its narrow dtype, compared at that top
@example([7, 7 + 65_535], 65_535)
@example([0, 2**32 - 1], 2**32 - 1)
def test_a_compact_column_compares_as_its_restored_values_do(offsets: list[int], threshold_offset: int) -> None:
    """A window's time and batch tests run on the stored offsets, never restored: they must agree with the
    restored column at every threshold, below the column's base, past its narrow dtype's top, and between."""
    values = BASE_NS + np.array(offsets, dtype=np.int64)
    columns = {name: np.zeros(values.size, dtype=dtype) for name, dtype in SCHEMAS["read"].columns.items()}
    columns["end_ns"] = values
    chunk = _merge("read", [_Chunk(int(values.min()), int(values.max()), columns)])
    threshold = BASE_NS + threshold_offset
    for edge in (threshold, int(values.min()), int(values.max()), int(values.max()) + 1):
        assert np.array_equal(chunk.at_least("end_ns", edge), chunk.column("read", "end_ns") >= edge)


def test_a_window_is_handed_the_reads_its_stalls_may_need_and_not_the_rest_of_the_lookback() -> None:
    """Before the window and its earliest stall, only the reads of an awaited batch and of a rank reported
    waiting are handed over: the other reads of the lookback are evidence for no stall of the window."""
    second = 10**9
    windows = EventTimeWindows(window_ns=second, lateness_ns=0, lookback_ns=2 * second, retention_ns=60 * second,
                               max_buffered_events=1_000, stall_threshold_ns=1_000_000)
    start = BASE_NS + 10 * second  # the window [start, start + 1 s)
    reads = [(0, 5, start - 1500 * 10**6),  # rank 0's awaited batch, read long before its wait
             (0, 3, start - 1500 * 10**6),  # an earlier batch of rank 0: evidence for nothing here
             (1, 9, start - 1500 * 10**6),  # rank 1, reported waiting
             (2, 4, start - 1200 * 10**6),  # rank 2, neither
             (2, 4, start + 300 * 10**6)]  # in the window
    end = np.array([at for _, _, at in reads])
    windows.add("read", {"job": np.zeros(5, np.int32), "rank": np.array([r for r, _, _ in reads], np.int32),
                         "worker": np.zeros(5, np.int16), "batch": np.array([b for _, b, _ in reads]),
                         "key": np.arange(5, dtype=np.uint64), "bytes": np.full(5, 4096), "start_ns": end - 10**6,
                         "end_ns": end, "verdict": np.zeros(5, np.int8)})
    wait_start = start + 100 * 10**6
    windows.add("step", {"job": np.zeros(1, np.int32), "rank": np.zeros(1, np.int32), "gpu": np.zeros(1, np.int16),
                         "batch": np.array([5]), "wait_start_ns": np.array([wait_start]),
                         "wait_end_ns": np.array([wait_start + 200 * 10**6]),
                         "compute_end_ns": np.array([wait_start + 250 * 10**6]), "ready_ns": np.array([-1])})
    windows.add("open", {"job": np.zeros(1, np.int32), "rank": np.ones(1, np.int32), "gpu": np.ones(1, np.int16),
                         "worker": np.full(1, -1, np.int16), "state": np.array([wire.OPEN_WAIT], np.int8),
                         "batch": np.array([9]), "key": np.zeros(1, np.uint64), "since_ns": np.array([start]),
                         "as_of_ns": np.array([start + 400 * 10**6])})
    (window,) = [w for w in windows.flush() if w.start_ns == start]
    handed = sorted(zip(window.context["read"]["rank"].tolist(), window.context["read"]["batch"].tolist(),
                        window.context["read"]["end_ns"].tolist(), strict=True))
    assert handed == sorted([reads[0], reads[2], reads[4]])


def test_event_batches_are_built_to_the_contract() -> None:
    good: dict[str, Any] = {"ts_ns": [1, 2], "period_ns": [1, 1], "gpu": [0, 3], "util": np.array([0.5, 1.0])}
    batch = EventBatch.of("gpu_util", good)
    assert {name: column.dtype for name, column in batch.columns.items()} == dict(SCHEMAS["gpu_util"].columns)
    assert len(batch) == 2
    for kind, columns, problem in (
        ("gpu_util", {**good, "utilisation": [0.5, 1.0]}, "does not name: utilisation"),
        ("gpu_util", {**good, "gpu": [0]}, "unequal length"),
        ("gpu_util", {**good, "gpu": [0, 2**15]}, "gpu"),
        ("gpu_util", {**good, "ts_ns": np.array([1.0, 2.0])}, "ts_ns"),
        ("gpu_util", {name: good[name] for name in ("ts_ns", "gpu", "util")}, r"lacks column\(s\) period_ns"),
        ("gpu", good, "unknown batch kind"),
    ):
        with pytest.raises(MalformedEventBatchError, match=problem):
            EventBatch.of(kind, columns)


def test_malformed_batches_are_counted_and_the_pipeline_goes_on() -> None:
    correlator = CorrelatorPipeline()
    correlator.emit(EventBatch("step", {"job": np.zeros(3, np.int32)}))
    correlator.emit(EventBatch("nonsense", {"x": np.zeros(2)}))
    good = _steps(0, [0.0], 0.1, 0.1)
    uneven = dict(good.columns, rank=np.zeros(5, np.int32))
    correlator.emit(EventBatch("step", uneven))
    correlator.emit(good)
    assert correlator.malformed == {"step": 8, "nonsense": 2}
    assert sum(len(chunk.columns["job"]) for chunk in correlator.windows._buffers["step"]) == 1


def _scenario_batches() -> list[EventBatch]:
    return generate(Scenario([JobSpec(0, steps=300, preprocess_s=0.05)], cache_bytes=1 << 30, seed=5)).batches


def _recorded_scenario(path: Path) -> list[EventBatch]:
    """The small scenario's batches, also written to an event file at `path`."""
    batches = _scenario_batches()
    writer = EventFileWriter(path)
    for batch in batches:
        writer.write(batch)
    writer.close()
    return batches


def test_event_file_round_trip_and_damage(tmp_path: Path) -> None:
    path = tmp_path / "events.bin"
    batches = _recorded_scenario(path)
    again = list(read_events(path))
    assert [b.kind for b in again] == [b.kind for b in batches]
    for a, b in zip(again, batches, strict=True):
        for name in b.columns:
            np.testing.assert_array_equal(a.columns[name], b.columns[name])
    # A file of the first version (no wall-clock offset) still reads.
    _, records = path.read_bytes().split(b"\n", 1)
    old = tmp_path / "v1.bin"
    old.write_bytes(b"stallwatch-events 1\n" + records)
    assert recorded_wall_offset(old) is None and recorded_wall_offset(path) is not None
    assert [len(b) for b in read_events(old)] == [len(b) for b in batches]
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(EventFileError, match="truncated"):
        list(read_events(path))
    (tmp_path / "other").write_text("hello\n")
    with pytest.raises(EventFileError, match="not a stallwatch event file"):
        list(read_events(tmp_path / "other"))


@pytest.mark.parametrize(("record", "error"), [
    (b'{"kind": "step", "rows": -5, "columns": [["job", "<i4"]]}\n', "rows must be a whole number"),
    (b'{"kind": "step", "rows": 1099511627776, "columns": [["job", "<i4"]]}\n', "rows must be a whole number"),
    (b'{"kind": "step", "rows": 1000000, "columns": [["job", "<i4"]]}\n', "truncated"),
    (b'{"kind": "step", "rows": 1.5, "columns": [["job", "<i4"]]}\n', "rows must be a whole number"),
    (b'{"kind": "step", "rows": 1, "columns": [["job", "|O"]]}\n', "not a number of 8 bytes"),
    (b'{"kind": "step", "rows": 1, "columns": [["job", "<U20"]]}\n', "not a number of 8 bytes"),
    (b'["a list"]\n', "bad header"),
])
def test_a_hostile_event_file_gets_one_line_and_no_traceback(tmp_path: Path, record: bytes, error: str) -> None:
    path = tmp_path / "events.bin"
    path.write_bytes(b'stallwatch-events 2 {"wall_offset_ns": 0}\n' + record + b"\0" * 4)
    with pytest.raises(EventFileError, match=error):
        list(read_events(path))
    replay = subprocess.run([sys.executable, "-m", "stallwatch", "correlate", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert replay.returncode == 1 and "Traceback" not in replay.stderr and error in replay.stderr, replay.stderr


def test_a_record_line_of_gigabytes_is_refused_after_its_first_64_kib(tmp_path: Path) -> None:
    """A 1.5 GiB record header with no end of line (sparse: no disk) once took 3,165 MiB to read."""
    path = tmp_path / "events.bin"
    with path.open("wb") as stream:
        stream.write(b'stallwatch-events 2 {"wall_offset_ns": "soon"}\n{"kind": "')
        stream.truncate(3 << 29)
    with pytest.raises(EventFileError, match="no end of line within 65536 bytes"):
        list(read_events(path))
    with pytest.raises(EventFileError, match="wall_offset_ns is not a 64-bit integer"):
        recorded_wall_offset(path)


def test_stallwatch_correlate_replays_a_recorded_file_like_the_live_pipeline(tmp_path: Path) -> None:
    path = tmp_path / "events.bin"
    batches = _recorded_scenario(path)
    live: list[WindowResult] = []
    CorrelatorPipeline(listeners=[live.append]).run(batches)
    done = subprocess.run([sys.executable, "-m", "stallwatch", "correlate", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line]
    assert len(rows) == len(live)
    # At the wall-clock times of the recording: the offset the file recorded when it was written.
    offset = recorded_wall_offset(path)
    assert offset is not None and abs(offset - wall_offset_ns()) < 10**9
    assert [row["start_s"] for row in rows] == [(w.start_ns + offset) / 1e9 for w in live]
    assert "job 0 rank 0: stall s: remote_fetch" in done.stderr
    bad = subprocess.run([sys.executable, "-m", "stallwatch", "correlate", str(tmp_path / "missing")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 1 and "error" in bad.stderr


def test_the_whatif_is_labelled_by_the_spokes_the_spoke_collectors_interned() -> None:
    spokes = Interner()
    assert whatif_spoke_label(spokes) == "default"
    spokes.intern("edge")
    assert whatif_spoke_label(spokes) == "edge"
    spokes.intern("varnish")
    assert whatif_spoke_label(spokes) == "edge+varnish"


def test_stallwatch_correlate_takes_its_flags_from_the_correlator_not_the_agent() -> None:
    probe = ("import sys, stallwatch.correlator.replay; "
             "print(sorted(m for m in sys.modules if m.startswith('stallwatch.exporters')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.strip() == "[]"


def test_service_takes_batches_from_many_threads_and_serves_catalogue_metrics(tmp_path: Path) -> None:
    batches = _scenario_batches()
    newest = max(int(b.columns[SCHEMAS[b.kind].event_time].max()) for b in batches)
    settings = CorrelatorSettings(cache_capacity_bytes=1 << 30)
    # The clock just past the last window's close: a window closed later, empty, would find the ended job idle.
    settle_ns = seconds_to_ns(settings.window_s + settings.lateness_s)
    service = LiveCorrelator(settings, windows_path=tmp_path / "w.jsonl", clock_ns=lambda: newest + settle_ns,
                             start=False)
    threads = [threading.Thread(target=lambda part=part: list(map(service.submit, part)))
               for part in (batches[0::3], batches[1::3], batches[2::3])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Batches from three threads arrive out of order: the lateness absorbs it, as in the agent.
    service.drain()
    service.close()
    registry = CollectorRegistry()
    registry.register(service)
    text = generate_latest(registry).decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    published = set(catalogue.family_names(catalogue.by_subsystem("correlator")))
    assert names <= {n + suffix for n in published for suffix in ("", "_created")} | published
    assert 'stallwatch_stall_seconds_total{cause="remote_fetch",rank="0",training_job="0"}' in text
    assert 'stallwatch_cache_whatif_hit_ratio{capacity_factor="2",spoke="default"}' in text
    assert 'stallwatch_cache_whatif_sampling_ratio{spoke="default"} 1.0' in text  # 300 keys: all sampled
    assert 'stallwatch_cache_whatif_keys{spoke="default"}' in text
    assert 'stallwatch_warmup_phase{phase="steady",training_job="0"} 1.0' in text
    assert len((tmp_path / "w.jsonl").read_text().splitlines()) >= 3


def test_service_drops_and_counts_past_its_backlog() -> None:
    service = LiveCorrelator(max_backlog_events=10, start=False)
    service.submit(_steps(0, [0.0] * 8, 0.1, 0.1))
    service.submit(_steps(0, [0.0] * 8, 0.1, 0.1))
    service.drain()
    text = generate_latest(_registry(service)).decode()
    assert 'stallwatch_correlator_dropped_events_total{kind="step",reason="backlog"} 8.0' in text


def test_service_counts_what_the_window_store_sheds() -> None:
    service = LiveCorrelator(CorrelatorSettings(max_buffered_events=10), clock_ns=lambda: BASE_NS, start=False)
    service.submit(_steps(0, [0.0] * 8, 0.1, 0.1))
    service.submit(_steps(0, [0.0] * 3, 0.1, 0.1))
    service.drain()
    text = generate_latest(_registry(service)).decode()
    assert 'stallwatch_correlator_dropped_events_total{kind="step",reason="window_full"} 3.0' in text


def _registry(service: LiveCorrelator) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(service)
    return registry
