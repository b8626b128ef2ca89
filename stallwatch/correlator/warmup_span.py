"""What the warm-up judges: spans of consecutive windows, at least `SPAN_S` long.

Windows are short (2 s by default) so that their results are published soon after the events. The
warm-up's rules need more time: a steady step time is judged on the mean of each quarter of what it
looks at, which needs a few steps per quarter, and a short window of a slow job holds only a handful.
So the windows' pieces are gathered per job until they span at least `SPAN_S`, and the warm-up
judges the span as one window: the phases keep the time scale they were designed at, while stall
seconds, compute seconds and GPU idle leave with every short window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stallwatch.correlator.warmup import JobWindow

SPAN_S = 5.0


@dataclass(frozen=True)
class WindowPiece:
    """What one window says about one job, before the span is put together."""

    start_ns: int
    ranks: npt.NDArray[np.int64]  # the rank of each step
    step_seconds: npt.NDArray[np.float64]
    step_end_ns: npt.NDArray[np.int64]
    reads: int
    hits: int
    hub_bytes: int
    stall_idle_gpu_seconds: float
    stall_start_ns: npt.NDArray[np.int64]
    stall_end_ns: npt.NDArray[np.int64]


class Spans:
    """The pieces of the windows since the last judgement, per job."""

    def __init__(self, span_ns: int) -> None:
        self._span_ns = span_ns
        self.start_ns: int | None = None
        self._pieces: dict[int, list[WindowPiece]] = {}

    def add(self, job: int, piece: WindowPiece) -> None:
        if self.start_ns is None:
            self.start_ns = piece.start_ns
        self._pieces.setdefault(job, []).append(piece)

    def complete(self, end_ns: int) -> bool:
        return self.start_ns is not None and end_ns - self.start_ns >= self._span_ns

    def close(self, end_ns: int, known_ranks: Callable[[int], int]) -> tuple[int, dict[int, JobWindow]]:
        """The span's start and, per job, the span as one window ending at `end_ns`; the next span starts
        empty. A span without steps keeps the ranks the job was last known with (`known_ranks`)."""
        start = self.start_ns if self.start_ns is not None else end_ns
        judged = {}
        for job, pieces in self._pieces.items():
            step_end = np.concatenate([p.step_end_ns for p in pieces])
            judged[job] = JobWindow(
                steps=int(step_end.size),
                ranks=int(np.unique(np.concatenate([p.ranks for p in pieces])).size) or known_ranks(job),
                step_seconds=np.concatenate([p.step_seconds for p in pieces]),
                step_quarter=np.clip((step_end - start) * 4 // max(end_ns - start, 1), 0, 3),
                reads=sum(p.reads for p in pieces),
                hits=sum(p.hits for p in pieces),
                hub_bytes=sum(p.hub_bytes for p in pieces),
                stall_idle_gpu_seconds=sum(p.stall_idle_gpu_seconds for p in pieces),
                stall_start_ns=np.concatenate([p.stall_start_ns for p in pieces]),
                stall_end_ns=np.concatenate([p.stall_end_ns for p in pieces]),
            )
        self.start_ns, self._pieces = None, {}
        return start, judged
