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
  wait_start_ns..wait_end_ns and compute_end_ns (the end of the step's work).
- `read` (loader workers, one row per dataset read): the source's job, rank and worker, then the
  wire's read record: batch (-1 unknown), key (`keys.read_key`), bytes, start_ns, end_ns, verdict.
- `spoke_request` (spoke collectors, one row per request the cache served): spoke, key, bytes,
  end_ns, duration_ns, upstream_ns (-1 when the hub was not contacted), verdict.
- `gpu_util` (gpu collector, the driver's high-rate samples): ts_ns, period_ns (the time the sample
  covers), gpu, util (0..1).

A verdict column holds `Verdict` numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

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
    """The cache's verdict on one read: from the spoke when known, else learnt from latency."""

    UNKNOWN = -1
    HIT = 0
    MISS = 1


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


class Interner:
    """Label value <-> small int, capped: past `limit` distinct values, new ones fold into one.

    This is the agent's cardinality cap for client-supplied names (jobs): `folded` counts what was
    folded, for the metric that reports it. `limit` may be changed until the first name is interned.
    """

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        self._lock = threading.Lock()
        self.folded = 0

    def intern(self, name: str) -> int:
        found = self._ids.get(name)
        if found is not None:
            return found
        with self._lock:
            if name in self._ids:
                return self._ids[name]
            if len(self._names) >= self.limit:
                self.folded += 1
                name = OVERFLOW
                if name in self._ids:
                    return self._ids[name]
            self._ids[name] = len(self._names)
            self._names.append(name)
            return self._ids[name]

    def name(self, ident: int) -> str:
        return self._names[ident]

    def __len__(self) -> int:
        return len(self._names)
