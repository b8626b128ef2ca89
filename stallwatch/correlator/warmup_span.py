"""What the warm-up judges a job on: a span of its recent windows, kept as small summaries.

Windows are short (1 s by default) so that their results are published soon after the events, but
one short window holds too few reads for a hit ratio and too few steps for a step-time dispersion
that mean anything. So each job keeps one summary per recent window (its counts, and its steps'
count and seconds per quarter of the window; never events) and the warm-up judges the span: the
windows that overlap the last `span_s` of event time. Staying steady is judged on up to twice that.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class WindowSummary:
    start_ns: int
    end_ns: int
    steps: int
    reads: int
    hits: int
    quarter_steps: npt.NDArray[np.float64]  # steps that ended in each quarter of the window
    quarter_seconds: npt.NDArray[np.float64]  # those steps' seconds (wait and compute)


def summarise(start_ns: int, end_ns: int, reads: int, hits: int, step_seconds: npt.NDArray[np.float64],
              step_quarter: npt.NDArray[np.int64]) -> WindowSummary:
    counts = np.bincount(step_quarter, minlength=4).astype(np.float64)
    seconds = np.bincount(step_quarter, weights=step_seconds, minlength=4)
    return WindowSummary(start_ns, end_ns, int(step_seconds.size), reads, hits, counts, np.asarray(seconds, np.float64))


class Span:
    """A job's summaries of the windows overlapping the last two spans of event time."""

    def __init__(self, span_ns: int) -> None:
        self._span_ns = span_ns
        self._windows: deque[WindowSummary] = deque()
        # The span (the windows overlapping the last `span_ns`, at least the newest) and its totals, worked
        # out once per window added: an update asks for them many times, and a span holds ten summaries or
        # more of 0.5 s windows.
        self._recent: tuple[WindowSummary, ...] = ()
        self._reads = self._hits = self._steps = 0

    def add(self, window: WindowSummary) -> None:
        self._windows.append(window)
        while self._windows[0].end_ns <= window.end_ns - 2 * self._span_ns:
            self._windows.popleft()
        since = window.end_ns - self._span_ns
        self._recent = tuple(w for w in self._windows if w.end_ns > since)
        self._reads = sum(w.reads for w in self._recent)
        self._hits = sum(w.hits for w in self._recent)
        self._steps = sum(w.steps for w in self._recent)

    def hit_ratio(self, since_ns: int | None = None) -> float | None:
        """Hits over reads in the span, or in the windows held that start at `since_ns` or later; None
        if they hold no read."""
        if since_ns is None:
            return self._hits / self._reads if self._reads else None
        windows = [w for w in self._windows if w.start_ns >= since_ns]
        reads = sum(w.reads for w in windows)
        return sum(w.hits for w in windows) / reads if reads else None

    def start_ns(self) -> int:
        return self._recent[0].start_ns

    def reads(self) -> int:
        return self._reads

    def missed(self) -> bool:
        return any(w.hits < w.reads for w in self._recent)

    def steps(self) -> int:
        return self._steps

    def pace(self, ranks: int) -> float:
        """Steps per rank per second of the span."""
        seconds = sum(w.end_ns - w.start_ns for w in self._recent) / 1e9
        return self._steps / ranks / seconds if ranks and seconds > 0 else 0.0

    def dispersion(self) -> float:
        """How far the mean step time of the span's quarters spreads, relative to the span's mean.

        The quarters are of the span's event time (`span_s`, or the windows held if they are longer); each
        window's quarters fall into the span's quarter that holds their middle. So a young job's first
        window lies in the span's last quarter and is not judged against itself, and one window as long as
        the span is judged on its own quarters. Quarters without a step are left out."""
        recent = self._recent
        end = recent[-1].end_ns
        start = min(end - self._span_ns, recent[0].start_ns)
        starts = np.array([w.start_ns for w in recent], dtype=np.int64)
        ends = np.array([w.end_ns for w in recent], dtype=np.int64)
        middles = (starts[:, None] + (np.arange(4) + 0.5) * (ends - starts)[:, None] / 4).ravel()
        quarter = np.clip((middles - start) * 4 // (end - start), 0, 3).astype(np.int64)
        counts = np.bincount(quarter, weights=np.concatenate([w.quarter_steps for w in recent]), minlength=4)
        seconds = np.bincount(quarter, weights=np.concatenate([w.quarter_seconds for w in recent]), minlength=4)
        if not counts.sum():
            return 0.0
        means = seconds[counts > 0] / counts[counts > 0]
        overall = seconds.sum() / counts.sum()
        return float(means.max() - means.min()) / overall if overall > 0 else 0.0

    def clean_since_ns(self, hit_ratio: float) -> int:
        """Start of the latest run of the span's windows whose own reads hit at least `hit_ratio` (a window
        without reads missed nothing); the newest window's start if it missed more."""
        recent = self._recent
        since = recent[-1].start_ns
        for window in reversed(recent):
            if window.hits < hit_ratio * window.reads:
                break
            since = window.start_ns
        return since
