"""Stage or stream: for a job as measured, would copying its whole dataset next to the GPUs first have cost less
than streaming it through the spoke?

The model (docs/cost.md): staging copies D bytes at the hub's measured throughput M while the job's N GPUs wait,
then reads them locally: no remote fetch, no hub byte after. Streaming paid its warm-up as measured (the GPU idle
in stalls and the hub bytes until steady) and, from steady on, a residual per hour (the GPU idle in remote_fetch
stalls and the hub bytes since); a job that never got steady pays the residual from its start. The other causes'
stalls are the same either way, so they are left out of both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import numpy as np

from stallwatch.prices import GB, Prices
from stallwatch.report.cost import HOUR
from stallwatch.report.run import Run, Series


class Verdict(enum.Enum):
    NOTHING_TO_STAGE = enum.auto()  # no read crossed a spoke
    SEVERAL_JOBS = enum.auto()  # warm-up figures are a job's: one job at a time
    NO_REUSE = enum.auto()  # no read hit: a copy fetches what the stream fetched, and waits for all of it first
    STAGE_WINS = enum.auto()  # the copy costs no more than streaming's warm-up alone
    STREAM_WINS = enum.auto()  # streaming costs nothing more once steady
    STREAM_WINS_UNTIL = enum.auto()  # until `break_even_hours`, when streaming's residual has paid for the copy
    NOT_KNOWN = enum.auto()  # a figure is missing: `missing` says which


@dataclass(frozen=True)
class Copy:
    """Staging: the dataset copied at the hub's throughput while the job's GPUs wait."""

    dataset_bytes: float
    given: bool  # from --dataset-size; otherwise the hub bytes until steady
    seconds: float
    gpu_dollars: float  # the GPUs reserved while it runs
    egress_dollars: float

    @property
    def dollars(self) -> float:
        return self.gpu_dollars + self.egress_dollars


@dataclass(frozen=True)
class Warmup:
    """Streaming until steady, as the correlator measured it."""

    idle_gpu_seconds: float  # in stalls of every cause
    hub_bytes: float
    dollars: float
    seconds_per_gpu: float | None  # the idle per GPU, how much later the job finished for it; None: GPUs not known


@dataclass(frozen=True)
class Residual:
    """Streaming from steady on (from the start when never steady): what staging would have saved each hour."""

    seconds: float  # the time it was measured over
    idle_gpu_seconds: float  # in remote_fetch stalls
    hub_bytes: float
    dollars_per_hour: float


@dataclass(frozen=True)
class StageOrStream:
    """Both sides of the choice; None where the run does not give a figure, and `missing` says which."""

    verdict: Verdict
    missing: tuple[str, ...] = ()
    steady: bool = False
    gpus: int | None = None
    hub_bytes_per_second: float | None = None  # the hub's mean throughput over the spans whose reads missed
    copy_dollars_per_gb: float | None = None  # what each GB of dataset adds to the copy's cost
    copy: Copy | None = None
    warmup: Warmup | None = None  # None when never steady
    residual: Residual | None = None
    break_even_hours: float | None = None  # past the warm-up (in all when never steady)
    break_even_bytes_per_hour: float | None = None  # the dataset an hour of streaming's residual would stage


def fetch_throughput(hub: Series) -> float | None:
    """Bytes per second from the hub over the spans in which it sent any: the pace of the job's misses. A copy
    that is not paced by the job may go faster, so this prices staging high, if anything."""
    fetching = np.nan_to_num(hub.v) > 0
    seconds = float(np.sum((hub.end - hub.t)[fetching]))
    return float(np.sum((hub.v * (hub.end - hub.t))[fetching])) / seconds if seconds > 0 else None


def warm_from(run: Run) -> float | None:
    """Where streaming's residual starts: the window that recognised steady, up to which the warm-up figures
    count (the time to steady points earlier, at the windows that proved it)."""
    recognised = next((start for start, _, phase in run.phases if phase == "steady"), None)
    return recognised if recognised is not None else run.steady_at


def weigh(run: Run, prices: Prices, dataset_bytes: float | None = None) -> StageOrStream:
    """The run's stage-or-stream figures and verdict; `dataset_bytes` from --dataset-size, if given."""
    if not run.spoke_reads:
        return StageOrStream(Verdict.NOTHING_TO_STAGE)
    if run.several_jobs:
        return StageOrStream(Verdict.SEVERAL_JOBS)
    missing: list[str] = []
    steady = run.time_to_steady_seconds is not None and not run.not_steady
    gpus, throughput = run.job_gpus, fetch_throughput(run.hub_bytes_per_second)
    if gpus is None:
        missing.append("how many GPUs the job holds (the source names none of its GPUs)")
    if throughput is None:
        missing.append("the hub's throughput (no span of the run fetched from it)")
    size = dataset_bytes if dataset_bytes is not None else run.warmup_hub_bytes if steady else None
    if not size:  # a spoke already warm when the job began read nothing until steady: no size either
        missing.append("the dataset's size (--dataset-size gives it)" if steady else "the dataset's size (the job "
                       "never got warm, so what it read until then is no measure of it; --dataset-size gives it)")
    copy = per_gb = None
    if gpus is not None and throughput is not None:
        per_gb = prices.gpu_cost(gpus * GB / throughput) + prices.egress_cost(GB)
        if size:
            copy = Copy(size, dataset_bytes is not None, size / throughput,
                        prices.gpu_cost(gpus * size / throughput), prices.egress_cost(size))

    warmup = None
    if steady:
        idle, hub = run.warmup_idle_gpu_seconds, run.warmup_hub_bytes
        if idle is None or hub is None:
            missing.append("the warm-up's GPU idle and hub bytes")
        else:
            warmup = Warmup(idle, hub, prices.gpu_cost(idle) + prices.egress_cost(hub), idle / gpus if gpus else None)
    residual = None
    since = warm_from(run) if steady else run.start
    if since is None:
        missing.append("when the cache got warm")
    elif (seconds := run.end - max(since, run.start)) <= 0:
        missing.append("any time after steady to measure streaming's cost since")
    else:
        idle, hub = run.remote_fetch_gpu_idle.integral(since), run.hub_bytes_per_second.integral(since)
        residual = Residual(seconds, idle, hub, (prices.gpu_cost(idle) + prices.egress_cost(hub)) * HOUR / seconds)

    weighed = StageOrStream(
        Verdict.NOT_KNOWN, tuple(missing), steady, gpus, throughput, per_gb, copy, warmup, residual,
        break_even_bytes_per_hour=None if residual is None or not per_gb else residual.dollars_per_hour / per_gb * GB)
    if not np.nansum(run.hit_ratio.v) and not any(run.whatif.values()):  # no hit now, nor at any capacity
        return replace(weighed, verdict=Verdict.NO_REUSE, missing=())
    return _decide(weighed)


def _decide(weighed: StageOrStream) -> StageOrStream:
    """The copy against streaming's warm-up (none when never steady), then against its residual per hour."""
    already: float | None = 0.0  # never steady: all it paid is residual
    if weighed.steady:
        already = None if weighed.warmup is None else weighed.warmup.dollars
    if weighed.copy is None or already is None:
        return weighed
    if weighed.copy.dollars <= already:
        return replace(weighed, verdict=Verdict.STAGE_WINS, missing=())
    if weighed.residual is None:
        return weighed
    if weighed.residual.dollars_per_hour == 0:
        return replace(weighed, verdict=Verdict.STREAM_WINS, missing=())
    return replace(weighed, verdict=Verdict.STREAM_WINS_UNTIL, missing=(),
                   break_even_hours=(weighed.copy.dollars - already) / weighed.residual.dollars_per_hour)
