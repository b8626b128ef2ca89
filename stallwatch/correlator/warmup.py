"""Warm-up phases per job: cold, transition, steady; time to steady, its cost, and regressions.

Phases are published per closed window but judged over the job's span: the windows overlapping
the last `span_s` of event time (`warmup_span.py`; one window when windows are that long). A
job is
- `cold` while most of the span's reads miss (hit ratio below `cold_hit_ratio`): the spoke is still
  filling, or, if it never leaves, the working set does not fit (thrash);
- `steady` when nearly all of the span's reads hit (`steady_hit_ratio`) and its step time is stable
  over the span: the mean step time of each quarter of the span stays within `max_dispersion` of the
  span's (quarters, not single steps, so a periodic pattern such as alternating workers is still
  steady), and, once a steady pace is known, it keeps at least `min_pace` of it (steps per rank per
  second of the span);
- `transition` in between.
Each threshold has hysteresis: a phase is entered at its threshold and left only past it by a margin
(`hit_ratio_hysteresis` below a hit-ratio threshold, `dispersion_hysteresis` times `max_dispersion`),
and steady is left on the hit ratio of the reads of up to two spans together (those since the span
that entered steady). So a job whose hit ratio or
step time wobbles (a working set that partly fits hits unevenly within an epoch) keeps its phase,
while a real change (an eviction, a hub outage) crosses the margin within a fraction of the span.
Leaving `steady` is a regression (evictions, thrash, hub trouble), counted only on the cache's
evidence. A fall on the hit ratio counts at once. When it leaves on pace alone (few or no steps: a
stall in progress, or the job ended) the phase turns `transition` at once but the regression is
counted only when a later step proves the trainer was waiting through that window; a job that simply
ended is never counted. When it leaves on step-time dispersion alone, it counts only if some of the
span's reads missed: uneven steps while every read hit are the CPU's doing (preprocessing jitter,
the fast last steps of a job draining its prefetched batches), not the cache's.
Time to steady runs from the job's first event to the start of the latest run of windows in the
first steady span whose own reads hit as steady does: the cache was warm from there, while the span
needed its length to prove it. Until the first steady span the job's idle GPU-seconds during stalls
and its hub bytes (bytes of reads that missed) add up to the warm-up's cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stallwatch.correlator.forecast import Forecast, WarmupForecast
from stallwatch.correlator.warmup_span import Span, summarise

COLD, TRANSITION, STEADY = "cold", "transition", "steady"
# Why a window is not steady: what the regression rule asks of a fall from steady.
HIT_RATIO, PACE, DISPERSION = "hit_ratio", "pace", "dispersion"


@dataclass(frozen=True)
class WarmupSettings:
    # The event time phases are judged over: a few hundred reads and a few steps per quarter even for
    # a slow job, as one window of the earlier 5 s default held; windows may be shorter.
    span_s: float = 5.0
    cold_hit_ratio: float = 0.5
    steady_hit_ratio: float = 0.9
    # A span's hit ratio moves a few points by chance (5 s hold a few hundred reads, and a partly
    # fitting working set hits unevenly within an epoch): a phase is left only this far past the
    # threshold that entered it.
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
    waiting: bool = False  # a rank of the job was seen waiting in this window: it is alive, though it took no step
    direct_reads: int = 0  # reads that crossed no spoke (not in `reads`)
    read_bytes: int = 0  # bytes of the `reads`
    first_pass: tuple[float, int] | None = None  # the job's progress through its first pass, its epoch's steps
    read_lead: float | None = None  # batches its loaders read ahead of its steps (`passes.read_lead`)


@dataclass
class JobWarmup:
    first_event_ns: int
    last_step_ns: int
    span: Span
    forecaster: WarmupForecast
    ranks: int = 0
    phase: str = COLD
    steady_from_ns: int = 0  # start of the span that last entered steady
    hit_ratio: float | None = None  # of the latest span with reads
    direct: bool = False  # it read through no spoke: nothing to warm until a read crosses one
    steady_pace: float | None = None  # steps per rank per second while steady
    time_to_steady_s: float | None = None
    idle_gpu_seconds: float = 0.0
    hub_bytes: int = 0
    regressions: int = 0
    unconfirmed_until_ns: int | None = None  # end of a window that left steady on pace alone
    forecast: Forecast | None = None  # while cold; once steady, what happened


class WarmupTracker:
    def __init__(self, settings: WarmupSettings | None = None, dataset_bytes: int | None = None,
                 cache_capacity_bytes: int | None = None) -> None:
        """`dataset_bytes` and `cache_capacity_bytes` are what the forecast knows beyond the jobs' events (the size
        of the dataset the node's jobs read, the spoke's capacity); either may be unknown."""
        self.settings = settings or WarmupSettings()
        self._dataset_bytes = dataset_bytes
        self._cache_capacity_bytes = cache_capacity_bytes
        self.jobs: dict[int, JobWarmup] = {}

    def update(self, job: int, start_ns: int, end_ns: int, seen: JobWindow, first_event_ns: int,
               complete: bool) -> JobWarmup:
        """Fold one closed window into the job's state. `complete` is False for a flushed last window."""
        state = self.jobs.get(job)
        if state is None:
            s = self.settings
            state = self.jobs[job] = JobWarmup(
                first_event_ns=first_event_ns, last_step_ns=end_ns, span=Span(round(s.span_s * 1e9)),
                forecaster=WarmupForecast(s.steady_hit_ratio, 1 * s.span_s, self._dataset_bytes,
                                          self._cache_capacity_bytes))
        state.span.add(summarise(start_ns, end_ns, seen.reads, seen.hits, seen.step_seconds, seen.step_quarter))
        ratio = state.span.hit_ratio()
        if ratio is not None:
            state.hit_ratio = ratio
        state.direct = state.direct or seen.direct_reads > 0
        if seen.steps or seen.waiting:
            state.last_step_ns = end_ns
        if seen.steps:
            state.ranks = seen.ranks
        if state.unconfirmed_until_ns is not None and seen.steps:
            until = state.unconfirmed_until_ns
            if np.any((seen.stall_start_ns < until) & (seen.stall_end_ns >= until)):
                state.regressions += 1  # a stall covered the quiet window's end: the trainer was waiting
            state.unconfirmed_until_ns = None
        filling = end_ns - state.first_event_ns < self.settings.span_s * 1e9
        phase, why = self._phase(state, complete, filling)
        if state.time_to_steady_s is None:
            state.idle_gpu_seconds += seen.stall_idle_gpu_seconds
            state.hub_bytes += seen.hub_bytes
            if phase == STEADY:
                warm_since = state.span.clean_since_ns(self.settings.steady_hit_ratio)
                state.time_to_steady_s = max(warm_since - state.first_event_ns, 0) / 1e9
                state.forecast = Forecast(state.time_to_steady_s, 0.0, 0.0)
            elif not state.direct:
                state.forecaster.add(start_ns, end_ns, seen.reads, seen.hits, seen.read_bytes, seen.hub_bytes,
                                     seen.stall_idle_gpu_seconds, state.ranks, seen.steps, seen.first_pass,
                                     seen.read_lead)
                state.forecast = state.forecaster.forecast((end_ns - state.first_event_ns) / 1e9)
        if state.phase == STEADY and phase != STEADY:
            if why == PACE:
                state.unconfirmed_until_ns = end_ns
            elif why == HIT_RATIO or state.span.missed():
                state.regressions += 1
        if phase == STEADY and seen.steps and state.ranks:
            pace = state.span.pace(state.ranks)
            state.steady_pace = pace if state.steady_pace is None else 0.8 * state.steady_pace + 0.2 * pace
        if phase == STEADY and state.phase != STEADY:
            state.steady_from_ns = state.span.start_ns()
        state.phase = phase
        return state

    def _phase(self, state: JobWarmup, complete: bool, filling: bool) -> tuple[str, str | None]:
        """The phase of the job's span and, when it is not steady, why (HIT_RATIO, PACE or DISPERSION). A job
        whose reads crossed no spoke is judged on its steps alone."""
        s = self.settings
        steady = state.phase == STEADY
        if state.hit_ratio is not None or not state.direct:
            cold = self._phase_by_hit_ratio(state, filling)
            if cold is not None:
                return cold, HIT_RATIO
        # Entering as well as staying: a span may end in a stall.
        if state.steady_pace is not None and complete and state.span.pace(state.ranks) < s.min_pace * state.steady_pace:
            return TRANSITION, PACE
        if not state.span.steps():
            return state.phase, None
        if filling:  # its first steps waited for the pipeline to start: step time is judged on a full span
            return STEADY, None
        allowed = s.max_dispersion * (s.dispersion_hysteresis if steady else 1.0)
        return (STEADY, None) if state.span.dispersion() <= allowed else (TRANSITION, DISPERSION)

    def _phase_by_hit_ratio(self, state: JobWarmup, filling: bool) -> str | None:
        """COLD or TRANSITION when the span's hit ratio says so (none yet is cold); None when it hits as steady."""
        s = self.settings
        ratio = state.hit_ratio
        if ratio is None:
            return COLD
        margin = s.hit_ratio_hysteresis
        reads = state.span.reads()
        if filling and reads:  # a young job's span holds few reads: judged on its ratio's upper bound
            ratio = min(1.0, ratio + 2 * math.sqrt(ratio * (1 - ratio) / reads))
        if ratio < s.cold_hit_ratio - (0.0 if state.phase == COLD else margin):
            return COLD
        steady = state.phase == STEADY
        if steady:  # staying steady is judged on up to two spans' reads: one span's wobble is not a change
            longer = state.span.hit_ratio(since_ns=state.steady_from_ns)
            ratio = ratio if longer is None else longer
        return TRANSITION if ratio < s.steady_hit_ratio - (margin if steady else 0.0) else None

    def expire(self, now_ns: int) -> list[int]:
        """Forget jobs with no step, and no rank seen waiting, for `expiry_s`; their ids, so their series can go too."""
        gone = [job for job, state in self.jobs.items() if now_ns - state.last_step_ns > self.settings.expiry_s * 1e9]
        for job in gone:
            del self.jobs[job]
        return gone
