"""How far each job is through its first pass over its data, from its trainers' epoch progress (`wire.OPEN_EPOCH`).

A trainer whose loader knows its length reports, with the steps it sends, the steps its epoch has taken and will
take. A rank's first pass is its first epoch of that length: the steps taken over the length while it runs, 1 once
an epoch of the same length began later. Loops of another length (a validation loader) are not the pass. The
warm-up forecast (`forecast.py`) reads the job's progress, the mean over its ranks (a synchronous job's ranks
step together): one pass fetches the working set. A loader reads ahead of its trainer (its workers' prefetch), so
the pass's reads end that many batches before its steps do (`window_analysis._read_lead`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stallwatch.client import wire
from stallwatch.eventbatch import Columns


@dataclass
class _FirstEpoch:
    since_ns: int
    length: int
    progress: float = 0.0  # steps taken over the length; 1 once it is over


class FirstPasses:
    def __init__(self) -> None:
        self._ranks: dict[tuple[int, int], _FirstEpoch] = {}

    def update(self, opens: Columns) -> None:
        """Fold the open records at hand in (any order; records seen before change nothing)."""
        epoch = opens["state"] == wire.OPEN_EPOCH
        if not epoch.any():
            return
        order = np.argsort(opens["as_of_ns"][epoch], kind="stable")
        columns = [opens[name][epoch][order].tolist() for name in ("job", "rank", "batch", "key", "since_ns")]
        for job, rank, done, length, since in zip(*columns, strict=True):
            if length < 1:  # the decoder lets none through; a recorded or built batch might hold one
                continue
            first = self._ranks.get((job, rank))
            if first is None:
                self._ranks[(job, rank)] = _FirstEpoch(since, length, min(done / length, 1.0))
            elif length == first.length:
                if since == first.since_ns:
                    first.progress = max(first.progress, min(done / length, 1.0))
                elif since > first.since_ns:  # the next epoch began: the first is over
                    first.progress = 1.0

    def of(self, job: int) -> tuple[float, int] | None:
        """The job's first pass: its ranks' mean progress and the epoch's length in steps; None if not reported."""
        firsts = [first for (j, _), first in self._ranks.items() if j == job]
        if not firsts:
            return None
        return sum(first.progress for first in firsts) / len(firsts), firsts[0].length

    def forget(self, jobs: list[int]) -> None:
        for key in [key for key in self._ranks if key[0] in jobs]:
            del self._ranks[key]

