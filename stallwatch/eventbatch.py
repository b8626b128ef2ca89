"""Columnar micro-batches: what collectors hand to the correlator's stream.

A batch is one kind of event with equal-length NumPy columns. Timestamps are `time.monotonic_ns()`
of this node, the one clock every process on the node shares. Jobs and spokes travel as small
integer ids from the agent's `Interner`, never as strings, so every column is a plain array.

Kinds and their columns (the contract between exporters and the correlator):

- `step` (training client, one row per training step):
  job int32, rank int32, gpu int16 (-1 unknown), batch int64 (the batch index the step consumed),
  wait_start_ns int64, wait_end_ns int64 (the loader wait), compute_end_ns int64 (the step's work).
- `read` (loader workers, one row per dataset read):
  job int32, rank int32, worker int16, batch int64 (-1 unknown), key uint64 (`keys.read_key`),
  bytes int64, start_ns int64, end_ns int64, verdict int8 (`Verdict`).
- `spoke_request` (spoke collectors, one row per request the cache served):
  spoke int32, key uint64, bytes int64, end_ns int64, duration_ns int64,
  upstream_ns int64 (-1 when the hub was not contacted), verdict int8.
- `gpu_util` (gpu collector, the driver's high-rate samples):
  ts_ns int64, period_ns int64, gpu int16, util float32 (0..1).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt


class Verdict(IntEnum):
    """The cache's verdict on one read: from the spoke when known, else learnt from latency."""

    UNKNOWN = -1
    HIT = 0
    MISS = 1


@dataclass(frozen=True)
class EventBatch:
    kind: str
    columns: Mapping[str, npt.NDArray[np.generic]]

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0


EventSink = Callable[[EventBatch], None]


def discard(batch: EventBatch) -> None:
    """The sink used when nothing consumes batches (the correlator is disabled)."""


OVERFLOW = "__other__"


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
