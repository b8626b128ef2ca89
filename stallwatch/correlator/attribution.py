"""Split every stall's seconds among `remote_fetch`, `cache_read`, `direct_read`, `preprocess`, `delivery`, `other`.

A stall is a loader wait [wait_start, wait_end] longer than the threshold. Each instant of it gets
one cause, so the causes always sum to the stall:

- Delivery, when the step says when its batch was handed over (the loader worker finished it at
  `ready`): every instant after it is `delivery` (the batch travelling to the trainer: pickling, the
  result queue, pin-memory, unpickling); the rules below split the wait up to it.
- Critical path, when the step's batch has tagged reads: the trainer waiting on batch k waits on the
  worker producing batch k. From the first read of batch k on, that worker is busy with it: an
  instant covered by a missed read of batch k is `remote_fetch`, else by a read that crossed no spoke
  `direct_read`, else by a hit `cache_read`, else (busy but not reading) `preprocess`. Before the
  worker started batch k: `other`. A failed fetch is a miss until the worker tries its key again
  (`with_retry_backoff`).
- Overlap, when it has none: the rank's reads (any worker) overlapping the wait, in the same order;
  uncovered instants are `other` (without tags, a busy worker cannot be told from an idle one).

All of it is joins, clips and per-group union lengths on arrays (see intervals.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from stallwatch import catalogue as c
from stallwatch.catalogue import CAUSES
from stallwatch.correlator.intervals import (
    F64,
    I64,
    composite_key,
    covered_and_subsets,
    distinct_rows,
    equal_join_columns,
    overlap_join,
    ragged_pairs,
)
from stallwatch.eventbatch import Verdict

# Columns of a split, by the catalogue's table.
REMOTE, CACHE, DIRECT, PREPROCESS, DELIVERY, OTHER = (c.CAUSE_TABLE.index(cause) for cause in (
    c.REMOTE_FETCH, c.CACHE_READ, c.DIRECT_READ, c.PREPROCESS, c.DELIVERY, c.OTHER))


@dataclass(frozen=True)
class Steps:
    job: I64
    rank: I64
    gpu: I64
    batch: I64
    wait_start: I64
    wait_end: I64
    compute_end: I64
    ready: I64  # when a loader worker handed the step's batch over; -1 unknown

    def __len__(self) -> int:
        return int(self.job.size)

    def columns(self) -> tuple[I64, ...]:
        """In field order. Spelt out: `dataclasses.fields` costs microseconds a call, and a window makes dozens."""
        return (self.job, self.rank, self.gpu, self.batch, self.wait_start, self.wait_end, self.compute_end,
                self.ready)

    def take(self, rows: slice | I64) -> Steps:
        return Steps(*(column[rows] for column in self.columns()))


@dataclass(frozen=True)
class Reads:
    job: npt.NDArray[np.signedinteger[Any]]  # as the batch carries them (int32): a window's reads are many
    rank: npt.NDArray[np.signedinteger[Any]]
    batch: I64
    start: I64
    end: I64
    verdict: npt.NDArray[np.int8]  # resolved: HIT, MISS (went to the hub) or DIRECT (crossed no spoke)

    def __len__(self) -> int:
        return int(self.job.size)


@dataclass(frozen=True)
class Attribution:
    """Per step: the wait, the compute, and the stall's split (ns, columns in CAUSES order)."""

    wait_ns: I64
    compute_ns: I64
    stalled: npt.NDArray[np.bool_]
    cause_ns: I64  # shape (steps, len(CAUSES)); all zero where not stalled


def is_stall(wait_start: I64, wait_end: I64, threshold_ns: int) -> npt.NDArray[np.bool_]:
    """Which loader waits are stalls: longer than the threshold."""
    stalled: npt.NDArray[np.bool_] = np.maximum(wait_end - wait_start, 0) > threshold_ns
    return stalled


def _clipped(reads: Reads, rows: I64, low: I64, high: I64) -> tuple[I64, I64]:
    """The chosen reads' starts and ends clipped to [low, high] (per row), in place of their gathered copies:
    `np.clip` takes as much again over a window's reads."""
    clipped = []
    for times in (reads.start, reads.end):
        values = times[rows]
        np.maximum(values, low, out=values)
        np.minimum(values, high, out=values)
        clipped.append(values)
    return clipped[0], clipped[1]


def with_retry_backoff(reads: Reads, key: npt.NDArray[np.uint64], failed: I64, now_ns: int) -> Reads:
    """The reads with each failed fetch (rows `failed`: through a spoke, no bytes) a miss that lasts until its worker
    tries the same key again. It went to the hub and got nothing, however fast (a spoke answers an unreachable hub at
    once), and the worker's back-off before the retry waits on the hub too: without this, an outage whose fetches
    fail fast is booked `preprocess`, the sleeps between them. A failed fetch followed by a read of another key of
    its batch was given up (the worker moved on): its own time is all. One followed by no read of its batch yet
    lasts until `now_ns`, as the back-off under way does; attribution clips it to the wait."""
    verdict = reads.verdict.copy()
    verdict[failed] = Verdict.MISS
    end = reads.end
    tagged = failed[reads.batch[failed] >= 0]  # a worker's back-off is known by the batch it serves
    if tagged.size:
        end = end.copy()
        columns = (reads.batch, reads.job, reads.rank)
        first, group = distinct_rows(*(column[tagged] for column in columns))
        group_of, member = equal_join_columns(tuple(column[tagged[first]].astype(np.int64) for column in columns),
                                              columns)
        # Each failed fetch beside every read of its batch, those in order of start: its next read is the first
        # that starts once it ended.
        order = np.lexsort((reads.start[member], group_of))
        member = member[order]
        group_end = np.cumsum(np.bincount(group_of, minlength=first.size))
        fetch_of, place = ragged_pairs(np.concatenate(([0], group_end[:-1]))[group], group_end[group])
        beside = member[place]
        fetch = tagged[fetch_of]
        after = np.flatnonzero((reads.start[beside] >= reads.end[fetch]) & (beside != fetch))
        fetches_followed, first_after = np.unique(fetch_of[after], return_index=True)
        following = np.full(tagged.size, -1, dtype=np.int64)
        following[fetches_followed] = beside[after[first_after]]
        retried = (following >= 0) & (key[np.maximum(following, 0)] == key[tagged])
        end[tagged[retried]] = reads.start[following[retried]]
        open_ended = tagged[following < 0]
        end[open_ended] = np.maximum(end[open_ended], now_ns)
    return Reads(reads.job, reads.rank, reads.batch, reads.start, end, verdict)


def attribute(steps: Steps, reads: Reads, threshold_ns: int, stalled: npt.NDArray[np.bool_] | None = None
              ) -> Attribution:
    """`stalled`, when given, says which rows are stalls instead of the threshold: a piece of a long stall cut
    at a window boundary is a stall however short (window_analysis.py)."""
    n = len(steps)
    wait = np.maximum(steps.wait_end - steps.wait_start, 0)
    compute = np.maximum(steps.compute_end - steps.wait_end, 0)
    if stalled is None:
        stalled = wait > threshold_ns
    causes = np.zeros((n, len(CAUSES)), dtype=np.int64)
    stall_index = np.flatnonzero(stalled)
    if stall_index.size == 0:
        return Attribution(wait, compute, stalled, causes)
    ws, waited = steps.wait_start[stall_index], steps.wait_end[stall_index]
    ready = steps.ready[stall_index]
    we = np.where(ready >= 0, np.clip(ready, ws, waited), waited)  # the worker's part of the wait ends here
    m = stall_index.size

    # Critical path: reads of the awaited batch, joined on (job, rank, batch); untagged steps join nothing.
    tagged = np.flatnonzero(steps.batch[stall_index] >= 0)
    tagged_rows = stall_index[tagged]
    tagged_of, read_of = equal_join_columns(  # the batch first: it leaves out most of the reads at once
        (steps.batch[tagged_rows], steps.job[tagged_rows], steps.rank[tagged_rows]),
        (reads.batch, reads.job, reads.rank))
    step_of = tagged[tagged_of]
    start, end = _clipped(reads, read_of, ws[step_of], we[step_of])
    # From its batch's first read on, the worker is busy with it (clipped to the wait, as the reads are).
    # Nested by priority: the misses, then the misses and the reads that crossed no spoke (only when any did).
    # Masks of the joined reads only: a window's context holds several times as many.
    with_direct = bool((reads.verdict == Verdict.DIRECT).any())

    def subsets(rows: I64) -> tuple[npt.NDArray[np.bool_], ...]:
        verdict = reads.verdict[rows]
        return (verdict == Verdict.MISS,) + ((verdict != Verdict.HIT,) if with_direct else ())

    tagged_cover, tagged_subsets, busy_from = covered_and_subsets(step_of, start, end, subsets(read_of), m)
    on_path = busy_from != np.iinfo(np.int64).max
    busy = np.where(on_path, we - busy_from, 0)

    # Overlap fallback for stalls with no read of their batch.
    fallback = ~on_path
    overlap_cover = np.zeros(m, dtype=np.int64)
    overlap_subsets = tuple(np.zeros(m, dtype=np.int64) for _ in tagged_subsets)
    if len(reads) and fallback.any():
        which = np.flatnonzero(fallback)
        # One packing for both sides so equal (job, rank) gets equal keys.
        owner = composite_key(np.concatenate((steps.job[stall_index[which]], reads.job)),
                              np.concatenate((steps.rank[stall_index[which]], reads.rank)))
        step_of, read_of = overlap_join(owner[:which.size], ws[which], we[which],
                                        owner[which.size:], reads.start, reads.end)
        stall_of = which[step_of]
        start, end = _clipped(reads, read_of, ws[stall_of], we[stall_of])
        overlap_cover, overlap_subsets, _ = covered_and_subsets(stall_of, start, end, subsets(read_of), m)

    cover = np.where(on_path, tagged_cover, overlap_cover)
    covers = [np.where(on_path, tagged, overlap) for tagged, overlap in zip(tagged_subsets, overlap_subsets,
                                                                              strict=True)]
    missed, not_hit = covers[0], covers[-1]
    split = causes[stall_index]
    split[:, REMOTE] = missed
    split[:, DIRECT] = not_hit - missed
    split[:, CACHE] = cover - not_hit
    split[:, PREPROCESS] = np.where(on_path, np.maximum(busy - cover, 0), 0)
    split[:, DELIVERY] = waited - we
    split[:, OTHER] = (waited - ws) - split.sum(axis=1)  # the rest: the other columns are set, this one is 0
    causes[stall_index] = split
    return Attribution(wait, compute, stalled, causes)


def gpu_idle_in_stalls(
    steps: Steps, attribution: Attribution, sample_ts: I64, sample_period: I64, sample_gpu: I64,
    sample_util: npt.NDArray[np.floating],
) -> F64:
    """Per step, ns its GPU idled during its stall, split like the stall (shape (steps, 4)).

    A utilization sample is the GPU's mean over its real period, from the GPU's sample before it to
    its own stamp: the driver's periods are irregular and it skips samples, so the period a sample
    carries (the agent bounds it) is used only for the first sample at hand. Its idle time,
    (1 - util) x period, goes to the stalls it overlaps first, up to each one's overlap, since the
    trainer waits while no kernel runs; stalls that together overlap it for longer than it was idle
    (kernels still running into a wait, two ranks on one GPU) share its idle time by overlap. A
    stall's idle time is shared among causes in proportion to the stall's split.
    """
    n = len(steps)
    out = np.zeros((n, len(CAUSES)), dtype=np.float64)
    stalled = np.flatnonzero(attribution.stalled & (steps.gpu >= 0))
    if stalled.size == 0 or sample_ts.size == 0:
        return out
    begin = _sample_begin(sample_ts, sample_period, sample_gpu)
    step_of, sample_of = overlap_join(steps.gpu[stalled], steps.wait_start[stalled], steps.wait_end[stalled],
                                      sample_gpu, begin, sample_ts)
    s = stalled[step_of]
    overlap = np.clip(np.minimum(sample_ts[sample_of], steps.wait_end[s])
                      - np.maximum(begin[sample_of], steps.wait_start[s]), 0, None).astype(np.float64)
    idle_time = (1.0 - np.clip(sample_util.astype(np.float64), 0.0, 1.0)) * (sample_ts - begin)
    claimed = np.bincount(sample_of, weights=overlap, minlength=sample_ts.size)
    placed = np.minimum(1.0, idle_time / np.maximum(claimed, 1.0))[sample_of]
    idle_ns = np.bincount(step_of, weights=overlap * placed, minlength=stalled.size)
    share = attribution.cause_ns[stalled] / np.maximum(attribution.wait_ns[stalled], 1)[:, None]
    out[stalled] = share * idle_ns[:, None]
    return out


def _sample_begin(ts: I64, period: I64, gpu: I64) -> I64:
    """Where each sample's real period begins: the same GPU's previous stamp, else ts - period."""
    order = np.lexsort((ts, gpu))
    begin = np.empty_like(ts)
    sorted_ts, sorted_gpu = ts[order], gpu[order]
    follows = np.concatenate(([False], sorted_gpu[1:] == sorted_gpu[:-1]))
    begin[order] = np.where(follows, np.concatenate((sorted_ts[:1], sorted_ts[:-1])), sorted_ts - period[order])
    return begin
