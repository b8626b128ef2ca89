"""Event micro-batches: the columnar contract between the agent's collectors and the correlator.

An event batch is one kind of event with equal-length NumPy columns. `SCHEMAS` is the contract in
code: each kind's columns with their dtypes, and the column that places an event in time (when it
became known: its end). Producers build batches with `EventBatch.of`, which checks them against it;
the correlator checks every batch it is handed with `conform` (an event file may hold anything).

Timestamps are `time.monotonic_ns()` of this node, the one clock every process on the node shares.
Jobs and spokes travel as small integer ids from the agent's `Interner`, never as strings, so every
column is a plain array. The kinds:

- `step` (training client, one row per training step): the source's job, rank and gpu (-1 unknown),
  then the wire's step record: batch (the batch index the step consumed), the loader wait
  wait_start_ns..wait_end_ns, compute_end_ns (the end of the step's work) and ready_ns (when a loader
  worker handed the batch over, -1 unknown).
- `read` (loader workers, one row per dataset read): the source's job, rank and worker, then the
  wire's read record: batch (-1 unknown), key (`keys.read_key`), bytes, start_ns, end_ns, verdict.
- `spoke_request` (spoke collectors, one row per request the cache served): spoke, key, bytes,
  end_ns, duration_ns, upstream_ns (-1 when the hub was not contacted), verdict.
- `gpu_util` (gpu collector, the driver's high-rate samples): ts_ns, period_ns (the time the sample
  covers), gpu, util (0..1).
- `open` (training client, what was in flight when a source flushed): the source's job, rank, gpu and worker,
  then the wire's open record: state (`wire.OPEN_*`), batch, key, since_ns, as_of_ns (when the source
  looked; it places the record in time).

A verdict column holds `Verdict` numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from stallwatch.client import wire

Columns = dict[str, npt.NDArray[Any]]


@dataclass(frozen=True)
class Schema:
    columns: Mapping[str, np.dtype[Any]]
    event_time: str  # the column that places an event in time


def _record_columns(fields: Sequence[tuple[str, str]]) -> dict[str, np.dtype[Any]]:
    """A wire record's fields as columns: struct and NumPy share the type codes (here in native order)."""
    return {name: np.dtype(code) for name, code in fields}


_I8, _I16, _I32, _I64 = np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64)
_U64, _F32 = np.dtype(np.uint64), np.dtype(np.float32)

SCHEMAS: Mapping[str, Schema] = {
    "step": Schema({"job": _I32, "rank": _I32, "gpu": _I16, **_record_columns(wire.STEP_FIELDS)}, "compute_end_ns"),
    "read": Schema({"job": _I32, "rank": _I32, "worker": _I16, **_record_columns(wire.READ_FIELDS)}, "end_ns"),
    "spoke_request": Schema({"spoke": _I32, "key": _U64, "bytes": _I64, "end_ns": _I64, "duration_ns": _I64,
                             "upstream_ns": _I64, "verdict": _I8}, "end_ns"),
    "gpu_util": Schema({"ts_ns": _I64, "period_ns": _I64, "gpu": _I16, "util": _F32}, "ts_ns"),
    "open": Schema({"job": _I32, "rank": _I32, "gpu": _I16, "worker": _I16, **_record_columns(wire.OPEN_FIELDS)},
                   "as_of_ns"),
}


class MalformedEventBatchError(ValueError):
    """Columns that do not follow the contract; the message says what is wrong."""


def conform(kind: str, columns: Mapping[str, npt.ArrayLike]) -> Columns:
    """The kind's columns cast to the contract's dtypes, or MalformedEventBatchError.

    A sequence converts straight to the column's dtype (a value out of its range is an error). An
    array's integers cast to the contract's width (as C would); its floats never become integers.
    Columns the contract does not name are left out; arrays already in their dtypes are not copied.
    """
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise MalformedEventBatchError(f"unknown batch kind {kind!r}")
    missing = sorted(set(schema.columns) - set(columns))
    if missing:
        raise MalformedEventBatchError(f"{kind} batch lacks column(s) {', '.join(missing)}")
    conformed: Columns = {}
    for name, dtype in schema.columns.items():
        given = columns[name]
        try:
            if isinstance(given, np.ndarray):
                column = given.astype(dtype, copy=False, casting="same_kind" if given.dtype.kind == "f" else "unsafe")
            else:
                column = np.asarray(given, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as error:
            raise MalformedEventBatchError(f"{kind}.{name}: {error}") from error
        if column.ndim != 1:
            raise MalformedEventBatchError(f"{kind}.{name} is not one-dimensional")
        conformed[name] = column
    lengths = {column.size for column in conformed.values()}
    if len(lengths) > 1:
        raise MalformedEventBatchError(f"{kind} batch has columns of unequal length {sorted(lengths)}")
    return conformed


class Verdict(IntEnum):
    """The cache's verdict on one read: from the spoke when known, else learnt from latency. The wire's
    numbers: a client's verdict column is used as it arrives."""

    UNKNOWN = wire.VERDICT_UNKNOWN
    HIT = wire.VERDICT_HIT
    MISS = wire.VERDICT_MISS
    DIRECT = wire.VERDICT_DIRECT  # the read crossed no spoke


@dataclass(frozen=True)
class EventBatch:
    """One kind of event in columns. Build one with `of`; the plain constructor checks nothing."""

    kind: str
    columns: Mapping[str, npt.NDArray[np.generic]]

    @classmethod
    def of(cls, kind: str, columns: Mapping[str, npt.ArrayLike]) -> EventBatch:
        """A batch that follows the contract: exactly the kind's columns, in its dtypes, of equal length."""
        conformed = conform(kind, columns)
        unknown = sorted(set(columns) - set(conformed))
        if unknown:
            raise MalformedEventBatchError(f"{kind} batch has column(s) the contract does not name: "
                                           f"{', '.join(unknown)}")
        return cls(kind, conformed)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0


EventSink = Callable[[EventBatch], None]


def discard(batch: EventBatch) -> None:
    """The sink used when nothing consumes batches (the correlator is disabled)."""


OVERFLOW = wire.OVERFLOW_NAME
DEFAULT_EXPIRE_AFTER_S = 120.0  # a job or rank that sent nothing for this long is finished (`--events.expire-after`)
_SCAN_EVERY_NS = 1_000_000_000  # the longest an expired series is still exposed, past its idle time

Job = TypeVar("Job", int, str)


class Interner:
    """Label value <-> small int, capped: at most `limit` live values, past it new ones fold into one.

    This is the agent's cardinality cap for client-supplied names (jobs): `folded` counts what was
    folded, for the metric that reports it. With `expire_after_s`, a value not interned for that long
    is released and its place freed for a new one: the cap means "at most `limit` live jobs", not
    "the first `limit` jobs since the agent started". Ids are never reused, and a released id still
    names its value for one more `expire_after_s`, for consumers that lag (the correlator's windows).
    `limit` and `expire_after_s` may be changed until the first name is interned.
    """

    def __init__(self, limit: int = 64, expire_after_s: float | None = None,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.limit = limit
        self.expire_after_s = expire_after_s
        self._clock_ns = clock_ns
        self._ids: dict[str, int] = {}  # live values
        self._names: dict[int, str] = {}  # live and recently released ids
        self._seen: dict[int, int] = {}  # live id -> when last interned
        self._released: dict[int, int] = {}  # released id -> when
        self._next = 0
        self._lock = threading.Lock()
        self.folded = 0

    def intern(self, name: str) -> int:
        found = self._ids.get(name)
        if found is not None:
            if self.expire_after_s is not None:
                self._seen[found] = self._clock_ns()
            return found
        with self._lock:
            now = self._clock_ns()
            self._expire(now)
            if name not in self._ids and len(self._ids) - (OVERFLOW in self._ids) >= self.limit:
                self.folded += 1
                name = OVERFLOW
            ident = self._ids.get(name)
            if ident is None:
                ident = self._ids[name] = self._next
                self._names[ident] = name
                self._next += 1
            self._seen[ident] = now
            return ident

    def _expire(self, now: int) -> None:
        if self.expire_after_s is None:
            return
        idle_ns = self.expire_after_s * 1e9
        for ident in [ident for ident, seen in self._seen.items() if now - seen > idle_ns]:
            del self._ids[self._names[ident]], self._seen[ident]
            self._released[ident] = now
        for ident in [ident for ident, released in self._released.items() if now - released > idle_ns]:
            del self._names[ident], self._released[ident]

    def name(self, ident: int) -> str:
        """The value of a live or recently released id; `OVERFLOW` for one long gone."""
        return self._names.get(ident, OVERFLOW)

    def names(self) -> list[str]:
        """The live values, oldest first."""
        return [self._names[ident] for ident in sorted(self._ids.values())]

    def __len__(self) -> int:
        return len(self._ids)


class SeriesCap(Generic[Job]):
    """The (job, rank) label pairs that have series: past `limit` pairs, a new pair folds into the
    rank `OVERFLOW` of its job; with `expire_after_s`, a pair not seen for that long expires (its
    series go) and frees its place. `folded` counts the folds. Not thread-safe: callers lock.

    The receiver keys by job id, the correlator by job name; both hold at most `limit` pairs plus one
    `OVERFLOW` pair per job, so their series are bounded whatever ranks clients claim.
    """

    def __init__(self, limit: int, expire_after_s: float | None = None) -> None:
        self.limit = limit
        self._idle_ns = None if expire_after_s is None else expire_after_s * 1e9
        self._seen: dict[tuple[Job, str], int] = {}
        self._next_scan = 0
        self.folded = 0

    def admit(self, job: Job, rank: str, now_ns: int) -> tuple[Job, str]:
        """The pair (job, rank) is labelled with: itself, or (job, OVERFLOW) past the cap."""
        key = (job, rank)
        if key not in self._seen and len(self._seen) >= self.limit:
            self.folded += 1
            key = (job, OVERFLOW)
        self._seen[key] = now_ns
        return key

    def expire(self, now_ns: int) -> list[tuple[Job, str]]:
        """The pairs idle past `expire_after_s`, now forgotten (checked at most once a second)."""
        if self._idle_ns is None or now_ns < self._next_scan:
            return []
        self._next_scan = now_ns + min(_SCAN_EVERY_NS, int(self._idle_ns / 4))
        gone = [key for key, seen in self._seen.items() if now_ns - seen > self._idle_ns]
        for key in gone:
            del self._seen[key]
        return gone

    def __len__(self) -> int:
        return len(self._seen)
