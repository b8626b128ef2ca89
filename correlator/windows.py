"""Event-time windows with bounded lateness over columnar batches.

Every event is placed by the time it became known, its end: a step by `compute_end_ns`, a read or a
spoke request by `end_ns`, a GPU sample by `ts_ns`. A window [start, end) closes once the watermark
(the newest event time seen, or the agent's clock, minus the allowed lateness) passes its end; an
event whose time falls in a window already closed is late: counted by kind, then dropped.

A closing window hands over its steps plus the context they need: the reads, spoke requests and GPU
samples ending from `lookback` before its earliest stall up to the watermark, because a stall can
reach back past the window's start (a 30 s hub outage) and a batch's reads precede its wait.
Buffered context older than `retention` before the closed edge is let go, which bounds memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from stallwatch.batch import Batch

Columns = dict[str, npt.NDArray[Any]]

# The contract of stallwatch/batch.py: each kind's columns and dtypes, and which column is its time.
SCHEMAS: Mapping[str, Mapping[str, type[np.generic]]] = {
    "step": {"job": np.int32, "rank": np.int32, "gpu": np.int16, "batch": np.int64, "wait_start_ns": np.int64,
             "wait_end_ns": np.int64, "compute_end_ns": np.int64},
    "read": {"job": np.int32, "rank": np.int32, "worker": np.int16, "batch": np.int64, "key": np.uint64,
             "bytes": np.int64, "start_ns": np.int64, "end_ns": np.int64, "verdict": np.int8},
    "spoke_request": {"spoke": np.int32, "key": np.uint64, "bytes": np.int64, "end_ns": np.int64,
                      "duration_ns": np.int64, "upstream_ns": np.int64, "verdict": np.int8},
    "gpu_util": {"ts_ns": np.int64, "period_ns": np.int64, "gpu": np.int16, "util": np.float32},
}
EVENT_TIME = {"step": "compute_end_ns", "read": "end_ns", "spoke_request": "end_ns", "gpu_util": "ts_ns"}
CONTEXT_KINDS = ("read", "spoke_request", "gpu_util")
# When an event began: one that began after a window's end cannot overlap that window's stalls.
BEGIN = {"read": lambda c: c["start_ns"], "gpu_util": lambda c: c["ts_ns"] - c["period_ns"]}


class MalformedBatchError(ValueError):
    """A batch that does not follow the contract; the message says what is wrong."""


def validate(batch: Batch) -> Columns:
    """The batch's columns cast to the contract's dtypes, or MalformedBatchError."""
    schema = SCHEMAS.get(batch.kind)
    if schema is None:
        raise MalformedBatchError(f"unknown batch kind {batch.kind!r}")
    missing = sorted(set(schema) - set(batch.columns))
    if missing:
        raise MalformedBatchError(f"{batch.kind} batch lacks column(s) {', '.join(missing)}")
    columns: Columns = {}
    for name, dtype in schema.items():
        column = np.asarray(batch.columns[name])
        if column.ndim != 1:
            raise MalformedBatchError(f"{batch.kind}.{name} is not one-dimensional")
        try:
            columns[name] = column.astype(dtype, copy=False, casting="same_kind" if column.dtype.kind == "f"
                                          else "unsafe")
        except TypeError as error:
            raise MalformedBatchError(f"{batch.kind}.{name}: {error}") from error
    lengths = {column.size for column in columns.values()}
    if len(lengths) > 1:
        raise MalformedBatchError(f"{batch.kind} batch has columns of unequal length {sorted(lengths)}")
    return columns


@dataclass
class _Chunk:
    low: int
    high: int
    columns: Columns


@dataclass(frozen=True)
class WindowInput:
    start_ns: int
    end_ns: int
    steps: Columns
    context: Mapping[str, Columns]
    final: bool  # closed by a flush at the end of input rather than by the watermark


def _concat(chunks: list[_Chunk], kind: str) -> Columns:
    if not chunks:
        return {name: np.zeros(0, dtype=dtype) for name, dtype in SCHEMAS[kind].items()}
    if len(chunks) == 1:
        return chunks[0].columns
    return {name: np.concatenate([c.columns[name] for c in chunks]) for name in SCHEMAS[kind]}


def _select(columns: Columns, mask: npt.NDArray[np.bool_]) -> Columns:
    return {name: column[mask] for name, column in columns.items()}


@dataclass
class EventTimeWindows:
    window_ns: int
    lateness_ns: int
    lookback_ns: int
    retention_ns: int
    closed_until: int | None = None
    late: Counter[str] = field(default_factory=Counter)
    _buffers: dict[str, list[_Chunk]] = field(default_factory=lambda: {kind: [] for kind in SCHEMAS})
    _newest: int | None = None

    def add(self, kind: str, columns: Columns) -> None:
        times = columns[EVENT_TIME[kind]].astype(np.int64, copy=False)
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
        self._buffers[kind].append(_Chunk(int(times.min()), int(times.max()), columns))
        newest = int(times.max())
        self._newest = newest if self._newest is None else max(self._newest, newest)

    @property
    def newest_event_ns(self) -> int | None:
        return self._newest

    def advance(self, watermark_ns: int) -> list[WindowInput]:
        """Close every window whose end is at or before the watermark."""
        closed: list[WindowInput] = []
        while self.closed_until is not None and self.closed_until + self.window_ns <= watermark_ns:
            self._skip_empty(watermark_ns)
            if self.closed_until + self.window_ns > watermark_ns:
                break
            closed.append(self._close(final=False))
        return closed

    def flush(self) -> list[WindowInput]:
        """At the end of input: close every window that holds a buffered event."""
        closed: list[WindowInput] = []
        if self._newest is None:
            return closed
        while self.closed_until is not None and self.closed_until <= self._newest:
            self._skip_empty(self._newest + 1)
            closed.append(self._close(final=self.closed_until + self.window_ns > self._newest))
        return closed

    def _skip_empty(self, limit_ns: int) -> None:
        """Jump over a stretch with no buffered event at all instead of closing windows one by one."""
        assert self.closed_until is not None
        pending = [c.low for chunks in self._buffers.values() for c in chunks if c.high >= self.closed_until]
        earliest = min(pending) if pending else limit_ns
        if earliest >= self.closed_until + 2 * self.window_ns:
            self.closed_until = max(self.closed_until, (earliest // self.window_ns - 1) * self.window_ns)

    def _close(self, final: bool) -> WindowInput:
        assert self.closed_until is not None
        start, end = self.closed_until, self.closed_until + self.window_ns
        step_chunks = [c for c in self._buffers["step"] if c.low < end]
        steps = _concat(step_chunks, "step")
        in_window = steps["compute_end_ns"] < end
        mine = _select(steps, in_window)
        # Keep the steps of later windows that shared a chunk with this one.
        self._buffers["step"] = [c for c in self._buffers["step"] if c.low >= end]
        if not in_window.all():
            rest = _select(steps, ~in_window)
            self._buffers["step"].insert(0, _Chunk(int(rest["compute_end_ns"].min()),
                                                   int(rest["compute_end_ns"].max()), rest))
        earliest_need = int(mine["wait_start_ns"].min()) if mine["wait_start_ns"].size else start
        horizon = max(min(earliest_need, start) - self.lookback_ns, start - self.retention_ns)
        context: dict[str, Columns] = {}
        for kind in CONTEXT_KINDS:
            chunks = [c for c in self._buffers[kind] if c.high >= horizon]
            columns = _concat(chunks, kind)
            keep = columns[EVENT_TIME[kind]] >= horizon
            if kind in BEGIN:
                keep &= BEGIN[kind](columns) < end
            context[kind] = _select(columns, keep)
        self.closed_until = end
        keep_from = end - self.retention_ns
        for kind in CONTEXT_KINDS:
            self._buffers[kind] = [c for c in self._buffers[kind] if c.high >= keep_from]
        return WindowInput(start, end, mine, context, final)
