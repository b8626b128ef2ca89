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

    def add(self, window: WindowSummary) -> None:
        self._windows.append(window)
        while self._windows[0].end_ns <= window.end_ns - 2 * self._span_ns:
            self._windows.popleft()

    def recent(self) -> list[WindowSummary]:
        """The span: the windows overlapping the last `span_ns` (at least the newest)."""
        since = self._windows[-1].end_ns - self._span_ns
        return [w for w in self._windows if w.end_ns > since]

    def hit_ratio(self, since_ns: int | None = None) -> float | None:
        """Hits over reads in the span, or in the windows held that start at `since_ns` or later; None
        if they hold no read."""
        windows = self.recent() if since_ns is None else [w for w in self._windows if w.start_ns >= since_ns]
        reads = sum(w.reads for w in windows)
        return sum(w.hits for w in windows) / reads if reads else None

    def start_ns(self) -> int:
        return self.recent()[0].start_ns

    def reads(self) -> int:
        return sum(w.reads for w in self.recent())

    def missed(self) -> bool:
        return any(w.hits < w.reads for w in self.recent())

    def steps(self) -> int:
        return sum(w.steps for w in self.recent())

    def pace(self, ranks: int) -> float:
        """Steps per rank per second of the span."""
        recent = self.recent()
        seconds = sum(w.end_ns - w.start_ns for w in recent) / 1e9
        return sum(w.steps for w in recent) / ranks / seconds if ranks and seconds > 0 else 0.0

    def dispersion(self) -> float:
        """How far the mean step time of the span's quarters spreads, relative to the span's mean.

        The quarters are of the span's event time (`span_s`, or the windows held if they are longer); each
        window's quarters fall into the span's quarter that holds their middle. So a young job's first
        window lies in the span's last quarter and is not judged against itself, and one window as long as
        the span is judged on its own quarters. Quarters without a step are left out."""
        recent = self.recent()
        end = recent[-1].end_ns
        start = min(end - self._span_ns, recent[0].start_ns)
        middles = np.concatenate([w.start_ns + (np.arange(4) + 0.5) * (w.end_ns - w.start_ns) / 4 for w in recent])
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
        recent = self.recent()
        since = recent[-1].start_ns
        for window in reversed(recent):
            if window.hits < hit_ratio * window.reads:
                break
            since = window.start_ns
        return since
