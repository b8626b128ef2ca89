"""Warm-up phases per job: cold, transition, steady; time to steady, its cost, and regressions.

Per closed window a job is
- `cold` while most of its reads miss (hit ratio below `cold_hit_ratio`): the spoke is still filling,
  or, if it never leaves, the working set does not fit (thrash);
- `steady` when nearly all reads hit (`steady_hit_ratio`) and its step time is stable within the
  window: the mean step time of each quarter of the window stays within `max_dispersion` of the
  window's (quarters, not single steps, so a periodic pattern such as alternating workers is still
  steady), and, once a steady pace is known, it keeps at least `min_pace` of it;
- `transition` in between.
Each threshold has hysteresis: a phase is entered at its threshold and left only past it by a margin
(`hit_ratio_hysteresis` below a hit-ratio threshold, `dispersion_hysteresis` times `max_dispersion`),
and steady is left on the hit ratio of this window's and the previous window's reads together. So a
job whose hit ratio or step time wobbles from window to window (a working set that partly fits hits
unevenly within an epoch) keeps its phase, while a real change (an eviction, a hub outage) crosses
the margin in the window it begins in.
Leaving `steady` is a regression (evictions, thrash, hub trouble), counted only on the cache's
evidence. A fall on the hit ratio counts at once. When it leaves on pace alone (few or no steps: a
stall in progress, or the job ended) the phase turns `transition` at once but the regression is
counted only when a later step proves the trainer was waiting through that window; a job that simply
ended is never counted. When it leaves on step-time dispersion alone, it counts only if some of the
window's reads missed: uneven steps while every read hit are the CPU's doing (preprocessing jitter,
the fast last steps of a job draining its prefetched batches), not the cache's.
Until the first steady window the job's idle GPU-seconds during stalls and its hub bytes (bytes of
reads that missed) add up to the warm-up's cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

COLD, TRANSITION, STEADY = "cold", "transition", "steady"
# Why a window is not steady: what the regression rule asks of a fall from steady.
HIT_RATIO, PACE, DISPERSION = "hit_ratio", "pace", "dispersion"


@dataclass(frozen=True)
class WarmupSettings:
    cold_hit_ratio: float = 0.5
    steady_hit_ratio: float = 0.9
    # A window's hit ratio moves a few points by chance (a 5 s window holds a few hundred reads, and
    # a partly fitting working set hits unevenly within an epoch): a phase is left only this far past
    # the threshold that entered it.
    hit_ratio_hysteresis: float = 0.1
    max_dispersion: float = 0.5
    dispersion_hysteresis: float = 2.0  # steady is left on dispersion only past this times max_dispersion
    min_pace: float = 0.5
    expiry_s: float = 120.0


@dataclass(frozen=True)
class JobWindow:
    """What one window says about one job."""

    steps: int
    ranks: int
    step_seconds: npt.NDArray[np.float64]
    step_quarter: npt.NDArray[np.int64]  # which quarter of the window each step ended in (0..3)
    reads: int
    hits: int
    hub_bytes: int
    stall_idle_gpu_seconds: float
    stall_start_ns: npt.NDArray[np.int64]  # this window's stalls
    stall_end_ns: npt.NDArray[np.int64]


@dataclass
class JobWarmup:
    first_event_ns: int
    last_step_ns: int
    ranks: int = 0
    phase: str = COLD
    hit_ratio: float | None = None
    latest: tuple[int, int] = (0, 0)  # hits and reads of the latest window with reads
    reads: tuple[int, int] = (0, 0)  # hits and reads of the latest two windows with reads
    steady_pace: float | None = None  # steps per rank per window while steady
    time_to_steady_s: float | None = None
    idle_gpu_seconds: float = 0.0
    hub_bytes: int = 0
    regressions: int = 0
    unconfirmed_until_ns: int | None = None  # end of a window that left steady on pace alone


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
            state.reads = (state.latest[0] + seen.hits, state.latest[1] + seen.reads)
            state.latest = (seen.hits, seen.reads)
        if seen.steps:
            state.last_step_ns = end_ns
            state.ranks = seen.ranks
        if state.unconfirmed_until_ns is not None and seen.steps:
            until = state.unconfirmed_until_ns
            if np.any((seen.stall_start_ns < until) & (seen.stall_end_ns >= until)):
                state.regressions += 1  # a stall covered the quiet window's end: the trainer was waiting
            state.unconfirmed_until_ns = None
        phase, why = self._phase(state, seen, complete)
        if state.time_to_steady_s is None:
            state.idle_gpu_seconds += seen.stall_idle_gpu_seconds
            state.hub_bytes += seen.hub_bytes
            if phase == STEADY:
                state.time_to_steady_s = max(start_ns - state.first_event_ns, 0) / 1e9
        if state.phase == STEADY and phase != STEADY:
            if why == PACE:
                state.unconfirmed_until_ns = end_ns
            elif why == HIT_RATIO or seen.hits < seen.reads:
                state.regressions += 1
        if phase == STEADY and seen.steps and seen.ranks:
            pace = seen.steps / seen.ranks
            state.steady_pace = pace if state.steady_pace is None else 0.8 * state.steady_pace + 0.2 * pace
        state.phase = phase
        return state

    def _phase(self, state: JobWarmup, seen: JobWindow, complete: bool) -> tuple[str, str | None]:
        """The window's phase and, when it is not steady, why (HIT_RATIO, PACE or DISPERSION)."""
        s = self.settings
        ratio = state.hit_ratio
        margin = s.hit_ratio_hysteresis
        if ratio is None:
            return COLD, HIT_RATIO
        if ratio < s.cold_hit_ratio - (0.0 if state.phase == COLD else margin):
            return COLD, HIT_RATIO
        steady = state.phase == STEADY
        if steady:  # staying steady is judged on two windows' reads: one window's wobble is not a change
            ratio = state.reads[0] / state.reads[1]
        if ratio < s.steady_hit_ratio - (margin if steady else 0.0):
            return TRANSITION, HIT_RATIO
        if steady and state.steady_pace is not None and complete:
            pace = seen.steps / seen.ranks if seen.ranks else 0.0
            if pace < s.min_pace * state.steady_pace:
                return TRANSITION, PACE
        if not seen.steps:
            return state.phase, None
        counts = np.bincount(seen.step_quarter, minlength=4)
        sums = np.bincount(seen.step_quarter, weights=seen.step_seconds, minlength=4)
        means = sums[counts > 0] / counts[counts > 0]
        overall = float(seen.step_seconds.mean())
        dispersion = float(means.max() - means.min()) / overall if overall > 0 else 0.0
        allowed = s.max_dispersion * (s.dispersion_hysteresis if steady else 1.0)
        return (STEADY, None) if dispersion <= allowed else (TRANSITION, DISPERSION)

    def expire(self, now_ns: int) -> list[int]:
        """Forget jobs with no step for `expiry_s`; their ids, so their series can go too."""
        gone = [job for job, state in self.jobs.items() if now_ns - state.last_step_ns > self.settings.expiry_s * 1e9]
        for job in gone:
            del self.jobs[job]
        return gone
