"""Warm-up phases per job: cold, transition, steady; time to steady, its cost, and regressions.

Per closed window a job is
- `cold` while most of its reads miss (hit ratio below `cold_hit_ratio`): the spoke is still filling,
  or, if it never leaves, the working set does not fit (thrash);
- `steady` when nearly all reads hit (`steady_hit_ratio`) and its step times are stable within the
  window (median absolute deviation / median at most `max_dispersion`), and, once a steady pace is
  known, it keeps at least `min_pace` of it;
- `transition` in between.
Leaving `steady` is a regression (evictions, thrash, hub trouble). A window in which the job, seen
recently, completed no step at all is a stall in progress: a window of zero pace.
Until the first steady window the job's idle GPU-seconds during stalls and its hub bytes (bytes of
reads that missed) add up to the warm-up's cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

COLD, TRANSITION, STEADY = "cold", "transition", "steady"


@dataclass(frozen=True)
class WarmupSettings:
    cold_hit_ratio: float = 0.5
    steady_hit_ratio: float = 0.9
    max_dispersion: float = 0.5
    min_pace: float = 0.5
    expiry_s: float = 120.0


@dataclass(frozen=True)
class JobWindow:
    """What one window says about one job."""

    steps: int
    ranks: int
    step_seconds: npt.NDArray[np.float64]
    reads: int
    hits: int
    hub_bytes: int
    stall_idle_gpu_seconds: float


@dataclass
class JobWarmup:
    first_event_ns: int
    last_step_ns: int
    ranks: int = 0
    phase: str = COLD
    hit_ratio: float | None = None
    steady_pace: float | None = None  # steps per rank per window while steady
    time_to_steady_s: float | None = None
    idle_gpu_seconds: float = 0.0
    hub_bytes: int = 0
    regressions: int = 0


class WarmupTracker:
    def __init__(self, settings: WarmupSettings | None = None) -> None:
        self.settings = settings or WarmupSettings()
        self.jobs: dict[int, JobWarmup] = {}

    def update(self, job: int, start_ns: int, end_ns: int, seen: JobWindow, first_event_ns: int,
               complete: bool) -> JobWarmup:
        """Fold one closed window into the job's state. `complete` is False for a flushed last window."""
        state = self.jobs.get(job)
        if state is None:
            state = self.jobs[job] = JobWarmup(first_event_ns=first_event_ns, last_step_ns=end_ns)
        if seen.reads:
            state.hit_ratio = seen.hits / seen.reads
        if seen.steps:
            state.last_step_ns = end_ns
            state.ranks = seen.ranks
        phase = self._phase(state, seen, complete)
        if state.time_to_steady_s is None:
            state.idle_gpu_seconds += seen.stall_idle_gpu_seconds
            state.hub_bytes += seen.hub_bytes
            if phase == STEADY:
                state.time_to_steady_s = max(start_ns - state.first_event_ns, 0) / 1e9
        if state.phase == STEADY and phase != STEADY:
            state.regressions += 1
        if phase == STEADY and seen.steps and seen.ranks:
            pace = seen.steps / seen.ranks
            state.steady_pace = pace if state.steady_pace is None else 0.8 * state.steady_pace + 0.2 * pace
        state.phase = phase
        return state

    def _phase(self, state: JobWarmup, seen: JobWindow, complete: bool) -> str:
        s = self.settings
        ratio = state.hit_ratio
        if ratio is None or ratio < s.cold_hit_ratio:
            return COLD
        if ratio < s.steady_hit_ratio:
            return TRANSITION
        if state.phase == STEADY and state.steady_pace is not None and complete:
            pace = seen.steps / seen.ranks if seen.ranks else 0.0
            if pace < s.min_pace * state.steady_pace:
                return TRANSITION
        if not seen.steps:
            return state.phase
        times = seen.step_seconds
        median = float(np.median(times))
        dispersion = float(np.median(np.abs(times - median))) / median if median > 0 else 0.0
        return STEADY if dispersion <= s.max_dispersion else TRANSITION

    def expire(self, now_ns: int) -> list[int]:
        """Forget jobs with no step for `expiry_s`; their ids, so their series can go too."""
        gone = [job for job, state in self.jobs.items() if now_ns - state.last_step_ns > self.settings.expiry_s * 1e9]
        for job in gone:
            del self.jobs[job]
        return gone
