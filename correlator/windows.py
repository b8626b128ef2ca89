"""Event-time windows with bounded lateness over columnar batches.

Every event is placed by the time it became known, its end: a step by `compute_end_ns`, a read or a
spoke request by `end_ns`, a GPU sample by `ts_ns`. A window [start, end) closes once the watermark
(the newest event time seen, or the agent's clock, minus the allowed lateness) passes its end; an
event whose time falls in a window already closed is late: counted by kind, then dropped.

A closing window hands over its steps plus the context they need: the reads, spoke requests and GPU
samples ending from `lookback` before its earliest stall up to the watermark, because a stall can
reach back past the window's start (a 30 s hub outage) and a batch's reads precede its wait.
Buffered context older than `retention` before the closed edge is let go.

Memory is bounded by count as well as by time: each kind holds at most `max_buffered_events`. A batch
that would pass the cap first lets go of context already handed to closed windows, oldest first (it
was counted in its own window; only a later long stall loses it as evidence, and since reads slow
down in a stall, a cap in events still spans a long stall). If events of still-open windows alone
would pass the cap, the whole incoming batch is shed and counted in `shed` by kind: under a flood the
store keeps what it has, and nothing is lost without a count.
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

    @property
    def events(self) -> int:
        return int(next(iter(self.columns.values())).size)


@dataclass(frozen=True)
class WindowInput:
    start_ns: int
    end_ns: int
    steps: Columns
    context: Mapping[str, Columns]
    final: bool  # closed by a flush at the end of input rather than by the watermark


def _concat(parts: list[Columns], kind: str) -> Columns:
    if not parts:
        return {name: np.zeros(0, dtype=dtype) for name, dtype in SCHEMAS[kind].items()}
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([part[name] for part in parts]) for name in SCHEMAS[kind]}


def _select(columns: Columns, mask: npt.NDArray[np.bool_]) -> Columns:
    return {name: column[mask] for name, column in columns.items()}


@dataclass
class EventTimeWindows:
    window_ns: int
    lateness_ns: int
    lookback_ns: int
    retention_ns: int
    max_buffered_events: int  # per kind
    closed_until: int | None = None
    late: Counter[str] = field(default_factory=Counter)
    shed: Counter[str] = field(default_factory=Counter)  # events dropped whole-batch at the cap, by kind
    _buffers: dict[str, list[_Chunk]] = field(default_factory=lambda: {kind: [] for kind in SCHEMAS})
    _buffered: Counter[str] = field(default_factory=Counter)
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
        excess = self._buffered[kind] + times.size - self.max_buffered_events
        if excess > 0 and not self._release_delivered(kind, excess):
            self.shed[kind] += int(times.size)
            return
        self._buffers[kind].append(_Chunk(int(times.min()), int(times.max()), columns))
        self._buffered[kind] += int(times.size)
        newest = int(times.max())
        self._newest = newest if self._newest is None else max(self._newest, newest)

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
        # Chunk by chunk, never one concatenation of everything buffered: a close then costs about
        # the size of what it hands over, not of the whole store.
        parts: list[Columns] = []
        later: list[_Chunk] = []  # the steps of later windows, some from chunks shared with this one
        for chunk in self._buffers["step"]:
            if chunk.high < end:
                parts.append(chunk.columns)
            elif chunk.low >= end:
                later.append(chunk)
            else:
                in_window = chunk.columns["compute_end_ns"] < end
                parts.append(_select(chunk.columns, in_window))
                rest = _select(chunk.columns, ~in_window)
                later.append(_Chunk(int(rest["compute_end_ns"].min()), chunk.high, rest))
        mine = _concat(parts, "step")
        self._keep("step", later)
        earliest_need = int(mine["wait_start_ns"].min()) if mine["wait_start_ns"].size else start
        horizon = max(min(earliest_need, start) - self.lookback_ns, start - self.retention_ns)
        context: dict[str, Columns] = {}
        for kind in CONTEXT_KINDS:
            parts = []
            for chunk in self._buffers[kind]:
                if chunk.high < horizon:
                    continue
                keep = chunk.columns[EVENT_TIME[kind]] >= horizon
                if kind in BEGIN:
                    keep &= BEGIN[kind](chunk.columns) < end
                if keep.all():
                    parts.append(chunk.columns)
                elif keep.any():
                    parts.append(_select(chunk.columns, keep))
            context[kind] = _concat(parts, kind)
        self.closed_until = end
        keep_from = end - self.retention_ns
        for kind in CONTEXT_KINDS:
            self._keep(kind, [c for c in self._buffers[kind] if c.high >= keep_from])
        return WindowInput(start, end, mine, context, final)
