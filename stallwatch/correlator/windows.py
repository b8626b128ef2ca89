"""Event-time windows with bounded lateness over columnar batches.

Every event is placed by the time it became known, its end: a step by `compute_end_ns`, a read or a
spoke request by `end_ns`, a GPU sample by `ts_ns`. A window [start, end) closes once the watermark
(the newest event time seen, or the agent's clock, minus the allowed lateness) passes its end; an
event whose time falls in a window already closed is late: counted by kind, then dropped.

A GPU's idle time in a stall comes from its next utilization sample (a sample is the mean since the one
before it), and the driver skips samples, a second and more at times: a window also waits until every
GPU sampled lately has a sample past its end, for at most `gpu_gap` past the watermark. A GPU that
stopped sampling is waited for no longer once its last sample is `gpu_gap` old.

A closing window hands over its steps, the steps buffered for later windows, and the context they need:
the reads, spoke requests, GPU samples and open records (what the clients had in flight) from `lookback`
before its earliest stall (a wait past `stall_threshold`, of its steps, of a buffered step or reported
open; else from its start) up to the newest at hand, because a stall can reach back past the window's
start (a 30 s hub outage) and a batch's reads precede its wait. Of the reads that ended before the
window and its earliest stall, only those of a stalled step's batch or of a rank reported waiting go:
no stall of the window can take the others as evidence.
Buffered context older than `retention` before the closed edge is let go.

Memory is bounded by count as well as by time: each kind holds at most `max_buffered_events`. A batch
that would pass the cap first lets go of context already handed to closed windows, oldest first (it
was counted in its own window; only a later long stall loses it as evidence, and since reads slow
down in a stall, a cap in events still spans a long stall). If events of still-open windows alone
would pass the cap, the whole incoming batch is shed and counted in `shed` by kind: under a flood the
store keeps what it has, and nothing is lost without a count.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from stallwatch.client import wire
from stallwatch.correlator.attribution import is_stall
from stallwatch.correlator.intervals import I64, equal_join_columns
from stallwatch.eventbatch import SCHEMAS, Columns

CONTEXT_KINDS = ("read", "spoke_request", "gpu_util", "open")
END_OF_INPUT = np.iinfo(np.int64).max  # the watermark of a flush: nothing more will come
# When an event began: one that began after a window's end cannot overlap that window's stalls. A GPU
# sample's real period reaches back to the sample before it, past the period it carries (bounded by
# the agent), so GPU samples are all kept.
BEGIN: Mapping[str, str] = {"read": "start_ns"}


# Small batches (a receiver batch is a few hundred events) are merged into one chunk per this many
# events: thousands of small arrays freed on another thread fragment the heap, a few large ones do not.
MERGE_EVENTS = 32_768
# A kind whose batches are tiny (GPU samples: a few per batch) would never reach MERGE_EVENTS, and every close
# walks every chunk: its unmerged batches are merged once this many are waiting.
MERGE_CHUNKS = 16
# The unsigned dtypes a compact column's offsets may take, narrowest first, with the largest offset each holds
# (`np.iinfo` costs microseconds a call).
_OFFSET_MAX = {np.dtype(d): int(np.iinfo(d).max) for d in (np.uint8, np.uint16, np.uint32)}


@dataclass
class _Chunk:
    """Buffered events of one kind. A merged chunk stores an integer column as unsigned offsets from its
    minimum, in the narrowest dtype that holds its range (a second of timestamps fits in 4 bytes, a job
    id in 1): about half the bytes of the contract's dtypes, restored exactly on the way out."""

    low: int
    high: int
    columns: Columns
    bases: dict[str, int] = field(default_factory=dict)  # column -> the value its offsets start from
    merged: bool = False
    events: int = field(init=False)

    def __post_init__(self) -> None:
        self.events = int(next(iter(self.columns.values())).size)

    def column(self, kind: str, name: str, rows: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """One column in the contract's dtype, of all rows or of the chosen ones (a mask, or places)."""
        stored = self.columns[name] if rows is None else self.columns[name][rows]
        if name not in self.bases:
            return stored
        # Restored on every call, never kept: the compact columns are what keeps a flood's store small.
        dtype = SCHEMAS[kind].columns[name]
        values: npt.NDArray[Any] = stored.astype(dtype)
        values += dtype.type(self.bases[name])
        return values

    def column_into(self, name: str, rows: npt.NDArray[np.intp] | None, out: npt.NDArray[Any]) -> None:
        """`column` of all rows or of the chosen places, written into `out` of the contract's dtype: no restored
        copy in between."""
        stored = self.columns[name]
        out[...] = stored if rows is None else stored[rows]
        if name in self.bases:
            out += out.dtype.type(self.bases[name])

    def at_least(self, name: str, value: int) -> npt.NDArray[np.bool_]:
        """`column >= value` for every row, compared on the stored offsets: no column restored."""
        stored = self.columns[name]
        if name not in self.bases:
            at_least: npt.NDArray[np.bool_] = stored >= value
            return at_least
        offset = value - self.bases[name]  # Python ints: exact whatever the distance
        if offset <= 0:
            return np.ones(stored.size, dtype=bool)
        if offset > _OFFSET_MAX[stored.dtype]:
            return np.zeros(stored.size, dtype=bool)
        at_least = stored >= stored.dtype.type(offset)
        return at_least

    def subset(self, kind: str, rows: npt.NDArray[np.bool_]) -> _Chunk:
        times = self.column(kind, SCHEMAS[kind].event_time, rows)
        return _Chunk(int(times.min()), int(times.max()), _select(self.columns, rows), self.bases, self.merged)


def _unmerged_tail(chunks: list[_Chunk]) -> int:
    """Where the chunks after the last merged one begin."""
    tail = len(chunks)
    while tail > 0 and not chunks[tail - 1].merged:
        tail -= 1
    return tail


def _merge(kind: str, chunks: list[_Chunk]) -> _Chunk:
    """One chunk of the given ones' rows in order, integer columns narrowed where their range allows."""
    columns: Columns = {}
    bases: dict[str, int] = {}
    for name in SCHEMAS[kind].columns:
        values = np.concatenate([chunk.column(kind, name) for chunk in chunks])
        if values.dtype.kind in "iu" and values.dtype.itemsize > 1:
            low, high = int(values.min()), int(values.max())
            narrow = next((d for d, top in _OFFSET_MAX.items() if high - low <= top), None)
            if narrow is not None and narrow.itemsize < values.dtype.itemsize:
                values -= values.dtype.type(low)
                values = values.astype(narrow)
                bases[name] = low
        columns[name] = values
    return _Chunk(min(c.low for c in chunks), max(c.high for c in chunks), columns, bases, merged=True)


@dataclass(frozen=True)
class WindowInput:
    start_ns: int
    end_ns: int
    steps: Columns
    context: Mapping[str, Columns]
    final: bool  # closed by a flush at the end of input rather than by the watermark
    # Every event up to this time is at hand (lateness allowing); END_OF_INPUT after a flush.
    watermark_ns: int
    # The steps already buffered for later windows: how far each rank's timeline is known (window_analysis.py).
    later_steps: Columns = field(default_factory=dict)


def _gather(parts: list[tuple[_Chunk, npt.NDArray[np.bool_] | None]], kind: str) -> Columns:
    """The chosen rows of the chunks (all where the mask is None), in the contract's dtypes."""
    if len(parts) == 1 and parts[0][1] is None and not parts[0][0].bases:
        return parts[0][0].columns
    # Each mask turned into places once, not scanned again for every column: the rows a window keeps of an
    # older chunk (its stalls' evidence) are scattered, and a scattered mask selects several times slower.
    chosen = [(chunk, None if rows is None else np.flatnonzero(rows)) for chunk, rows in parts]
    bounds = list(itertools.pairwise(itertools.accumulate(
        (chunk.events if rows is None else rows.size for chunk, rows in chosen), initial=0)))
    columns: Columns = {}
    for name, dtype in SCHEMAS[kind].columns.items():
        columns[name] = np.empty(bounds[-1][1] if bounds else 0, dtype=dtype)
        for (chunk, rows), (first, last) in zip(chosen, bounds, strict=True):
            chunk.column_into(name, rows, columns[name][first:last])
    return columns


def _evidence(chunk: _Chunk, kept: npt.NDArray[np.bool_], since_ns: int, awaited: tuple[I64, ...] | None,
              waiting: set[tuple[int, int]]) -> npt.NDArray[np.bool_]:
    """Which of a chunk's reads count for a window's stalls: every one that ended at `since_ns` or later, and of
    the `kept` before it, those of an `awaited` (batch, job, rank) or of a `waiting` (job, rank)."""
    evidence = chunk.at_least(SCHEMAS["read"].event_time, since_ns)
    before = kept & ~evidence
    if awaited is not None:  # the batch first, on the stored column: it leaves out most of the rows at once
        low, high = int(awaited[0].min()), int(awaited[0].max())
        rows = np.flatnonzero(before & chunk.at_least("batch", low) & ~chunk.at_least("batch", high + 1))
        columns = tuple(chunk.column("read", name, rows) for name in ("batch", "job", "rank"))
        evidence[rows[equal_join_columns(awaited, columns)[1]]] = True
    if waiting:
        rows = np.flatnonzero(before)
        job, rank = chunk.column("read", "job", rows), chunk.column("read", "rank", rows)
        for waiting_job, waiting_rank in waiting:
            evidence[rows[(job == waiting_job) & (rank == waiting_rank)]] = True
    return evidence


def _select(columns: Columns, mask: npt.NDArray[np.bool_]) -> Columns:
    return {name: column[mask] for name, column in columns.items()}


@dataclass
class EventTimeWindows:
    window_ns: int
    lateness_ns: int
    lookback_ns: int
    retention_ns: int
    max_buffered_events: int  # per kind
    gpu_gap_ns: int = 0
    stall_threshold_ns: int = 0
    closed_until: int | None = None
    late: Counter[str] = field(default_factory=Counter)
    shed: Counter[str] = field(default_factory=Counter)  # events dropped whole-batch at the cap, by kind
    _buffers: dict[str, list[_Chunk]] = field(default_factory=lambda: {kind: [] for kind in SCHEMAS})
    _buffered: Counter[str] = field(default_factory=Counter)
    _unmerged: Counter[str] = field(default_factory=Counter)  # events in the chunks after the last merged one
    _unmerged_chunks: Counter[str] = field(default_factory=Counter)  # and those chunks
    _newest: int | None = None
    _gpu_sampled: dict[int, int] = field(default_factory=dict)  # per GPU, its newest sample's stamp

    def add(self, kind: str, columns: Columns) -> None:
        times = columns[SCHEMAS[kind].event_time].astype(np.int64, copy=False)
        if times.size == 0:
            return
        if self.closed_until is None:
            self.closed_until = int(times.min()) // self.window_ns * self.window_ns
        late = times < self.closed_until
        if late.any():
            self.late[kind] += int(late.sum())
            columns, times = _select(columns, ~late), times[~late]
            if times.size == 0:
                return
        excess = self._buffered[kind] + times.size - self.max_buffered_events
        if excess > 0 and not self._release_delivered(kind, excess):
            self.shed[kind] += int(times.size)
            return
        chunks = self._buffers[kind]
        chunks.append(_Chunk(int(times.min()), int(times.max()), columns))
        self._buffered[kind] += int(times.size)
        self._unmerged[kind] += int(times.size)
        self._unmerged_chunks[kind] += 1
        if self._unmerged[kind] >= MERGE_EVENTS or self._unmerged_chunks[kind] >= MERGE_CHUNKS:
            tail = _unmerged_tail(chunks)
            chunks[tail:] = [_merge(kind, chunks[tail:])]
            self._unmerged[kind] = 0
            self._unmerged_chunks[kind] = 0
        newest = int(times.max())
        self._newest = newest if self._newest is None else max(self._newest, newest)
        if kind == "gpu_util":  # a node's few GPUs
            for gpu in np.unique(columns["gpu"]).tolist():
                newest_here = int(times[columns["gpu"] == gpu].max())
                self._gpu_sampled[gpu] = max(newest_here, self._gpu_sampled.get(gpu, newest_here))

    @property
    def newest_event_ns(self) -> int | None:
        return self._newest

    def buffered(self, kind: str) -> int:
        """Events of `kind` the store holds now."""
        return self._buffered[kind]

    def _release_delivered(self, kind: str, excess: int) -> bool:
        """Let go of at least `excess` events of context closed windows already had, oldest first.

        False, releasing nothing, when that context is too small: the caller sheds its batch then,
        and the context stays for the long stalls it may still explain.
        """
        assert self.closed_until is not None
        delivered = sorted((c for c in self._buffers[kind] if c.high < self.closed_until), key=lambda c: c.high)
        if sum(c.events for c in delivered) < excess:
            return False
        released: set[int] = set()
        for chunk in delivered:
            if excess <= 0:
                break
            released.add(id(chunk))
            excess -= chunk.events
        self._keep(kind, [c for c in self._buffers[kind] if id(c) not in released])
        return True

    def _keep(self, kind: str, chunks: list[_Chunk]) -> None:
        self._buffers[kind] = chunks
        self._buffered[kind] = sum(c.events for c in chunks)
        tail = _unmerged_tail(chunks)
        self._unmerged[kind] = sum(c.events for c in chunks[tail:])
        self._unmerged_chunks[kind] = len(chunks) - tail

    def advance(self, watermark_ns: int) -> list[WindowInput]:
        """Close every window whose end is at or before the watermark."""
        closed: list[WindowInput] = []
        while self.closed_until is not None and self.closed_until + self.window_ns <= watermark_ns:
            self._skip_empty(watermark_ns)
            end = self.closed_until + self.window_ns
            if end > watermark_ns or not self._gpus_sampled_past(end, watermark_ns):
                break
            closed.append(self._close(final=False, watermark_ns=watermark_ns))
        return closed

    def _gpus_sampled_past(self, end_ns: int, watermark_ns: int) -> bool:
        """Whether every GPU sampled within `gpu_gap` before `end_ns` has a sample past it, or the wait is over."""
        if watermark_ns >= end_ns + self.gpu_gap_ns:
            return True
        return all(ts >= end_ns or ts < end_ns - self.gpu_gap_ns for ts in self._gpu_sampled.values())

    def flush(self) -> list[WindowInput]:
        """At the end of input: close every window that holds a buffered event."""
        closed: list[WindowInput] = []
        if self._newest is None:
            return closed
        while self.closed_until is not None and self.closed_until <= self._newest:
            self._skip_empty(self._newest + 1)
            final = self.closed_until + self.window_ns > self._newest
            closed.append(self._close(final=final, watermark_ns=END_OF_INPUT))
        return closed

    def _stalled(self, steps: Columns) -> Columns:
        return _select(steps, is_stall(steps["wait_start_ns"], steps["wait_end_ns"], self.stall_threshold_ns))

    def _open_waits(self, since_ns: int, *names: str) -> list[npt.NDArray[Any]]:
        """Columns of the waits reported open at or after `since_ns`: stalls still under way (cuts.py)."""
        chosen = [(chunk, (chunk.column("open", "as_of_ns") >= since_ns)
                   & (chunk.column("open", "state") == wire.OPEN_WAIT))
                  for chunk in self._buffers["open"] if chunk.high >= since_ns]
        return [np.concatenate([chunk.column("open", name, rows) for chunk, rows in chosen]) if chosen
                else np.zeros(0, dtype=SCHEMAS["open"].columns[name]) for name in names]

    def _skip_empty(self, limit_ns: int) -> None:
        """Jump over a stretch with no buffered event at all instead of closing windows one by one."""
        assert self.closed_until is not None
        pending = [c.low for chunks in self._buffers.values() for c in chunks if c.high >= self.closed_until]
        earliest = min(pending) if pending else limit_ns
        if earliest >= self.closed_until + 2 * self.window_ns:
            self.closed_until = max(self.closed_until, (earliest // self.window_ns - 1) * self.window_ns)

    def _close(self, final: bool, watermark_ns: int) -> WindowInput:
        assert self.closed_until is not None
        start, end = self.closed_until, self.closed_until + self.window_ns
        # Chunk by chunk, never one concatenation of everything buffered: a close then costs about
        # the size of what it hands over, not of the whole store.
        parts: list[tuple[_Chunk, npt.NDArray[np.bool_] | None]] = []
        later: list[_Chunk] = []  # the steps of later windows, some from chunks shared with this one
        for chunk in self._buffers["step"]:
            if chunk.high < end:
                parts.append((chunk, None))
            elif chunk.low >= end:
                later.append(chunk)
            else:
                in_window = chunk.column("step", "compute_end_ns") < end
                parts.append((chunk, in_window))
                later.append(chunk.subset("step", ~in_window))
        mine = _gather(parts, "step")
        self._keep("step", later)
        later_steps = _gather([(chunk, None) for chunk in later], "step")
        # Steps of later windows whose waits began already may be booked now too (cuts.py). Only a stall
        # needs reads from before the window (its batch's): without one, the window's own are enough.
        stalled = [self._stalled(steps) for steps in (mine, later_steps) if steps]
        starts = [steps["wait_start_ns"] for steps in stalled] + self._open_waits(start, "since_ns")
        earliest = min((int(s.min()) for s in starts if s.size), default=None)  # the earliest stall's start
        since = start if earliest is None else min(earliest, start)
        horizon = max(start if earliest is None else since - self.lookback_ns, start - self.retention_ns)
        # Before `since`, a read is evidence only for a stall awaiting its batch, or for a rank reported waiting
        # (whose batch the analysis learns from what it has in flight): the rest of the lookback, most of it, is
        # left out.
        stalled = [steps for steps in stalled if steps["batch"].size]
        awaited = (tuple(np.concatenate([steps[name] for steps in stalled]).astype(np.int64)
                         for name in ("batch", "job", "rank")) if stalled else None)
        waiting = set(zip(*(column.tolist() for column in self._open_waits(horizon, "job", "rank")), strict=True))
        context: dict[str, Columns] = {}
        for kind in CONTEXT_KINDS:
            parts = []
            for chunk in self._buffers[kind]:
                if chunk.high < horizon:
                    continue
                keep = (chunk.at_least(SCHEMAS[kind].event_time, horizon) if chunk.low < horizon
                        else np.ones(chunk.events, dtype=bool))
                if kind in BEGIN and chunk.high >= end:  # an event that ended before `end` began before it
                    keep &= ~chunk.at_least(BEGIN[kind], end)
                if kind == "read" and chunk.low < since:
                    keep &= _evidence(chunk, keep, since, awaited, waiting)
                if keep.all():
                    parts.append((chunk, None))
                elif keep.any():
                    parts.append((chunk, keep))
            context[kind] = _gather(parts, kind)
        self.closed_until = end
        keep_from = end - self.retention_ns
        for kind in CONTEXT_KINDS:
            if any(c.high < keep_from for c in self._buffers[kind]):
                self._keep(kind, [c for c in self._buffers[kind] if c.high >= keep_from])
        return WindowInput(start, end, mine, context, final, watermark_ns, later_steps)
