"""What the report shows, whichever source it came from: time series on a shared clock and the warm-up figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from stallwatch import catalogue as c

FloatArray = npt.NDArray[np.float64]


@dataclass
class Series:
    """Values over spans of time: `v[i]` holds from `t[i]` to `end[i]` (unix seconds); between one span's end and
    the next one's start nothing is known. Instants (a Prometheus answer before it is put on spans) end where
    they start."""

    t: FloatArray
    v: FloatArray
    end: FloatArray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        if self.end.size != self.t.size:
            self.end = self.t.copy()

    @classmethod
    def empty(cls) -> Series:
        return cls(np.zeros(0), np.zeros(0))

    def integral(self, since: float = -np.inf) -> float:
        """Each value times the time it holds for, from `since` on (a span across `since` counts in part); a
        value not known (NaN) counts as none."""
        held = np.clip(self.end - np.maximum(self.t, since), 0.0, None)
        return float(np.nansum(self.v * held))


@dataclass
class Run:
    """Everything the report shows, whichever source it came from. Totals are over the run, summed over its
    ranks (or GPUs); None where the source cannot know."""

    start: float  # unix seconds
    end: float
    source: str = "windows"  # or "prometheus": which metrics the figures were read from
    job: str | None = None  # the training job the run was narrowed to, if any
    node: str | None = None
    nodes: int = 1  # how many nodes the run's figures combine
    ranks: int = 0  # the training ranks seen: stall rates are averaged over them
    stall_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(c.CAUSES, 0.0))
    compute_seconds: float = 0.0
    gpu_devices: int | None = None  # GPUs NVML reports on the run's nodes; None: not known
    gpu_stall_idle_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(c.CAUSES, 0.0))
    # The same GPU idle in remote_fetch stalls over time (GPU-seconds per second): what staging would save.
    remote_fetch_gpu_idle: Series = field(default_factory=Series.empty)
    job_gpus: int | None = None  # GPUs the correlator saw the run's job(s) on; None: it named none
    gpu_utilization: Series | None = None  # None: the source holds none (a window file)
    steps_per_second: Series = field(default_factory=Series.empty)
    spoke_reads: float = 0.0  # reads that crossed a spoke: none, no hit ratio or hub bytes to show
    failed_reads: float | None = None  # reads that got no bytes (failed fetches); None: the source does not say
    hit_ratio: Series = field(default_factory=Series.empty)
    hub_bytes_per_second: Series = field(default_factory=Series.empty)
    # Stall-seconds per second per rank, by cause.
    stall_by_cause: dict[str, Series] = field(default_factory=lambda: {k: Series.empty() for k in c.CAUSES})
    phases: list[tuple[float, float, str]] = field(default_factory=list)
    # Phases and warm-up figures are a job's: over several jobs, left empty, and these are the jobs.
    several_jobs: tuple[str, ...] = ()
    job_started: float | None = None  # the start of the job's first window, when the run holds it
    time_to_steady_seconds: float | None = None
    not_steady: tuple[str, ...] = ()  # nodes of a multi-node job that have not reached steady
    warmup_idle_gpu_seconds: float | None = None
    warmup_hub_bytes: float | None = None
    # The correlator's forecast of the time to steady (seconds from the job's start; inf: never), at each instant
    # it was published while the job was cold.
    forecast_time_to_steady: Series = field(default_factory=Series.empty)
    dataset_bytes: float | None = None  # as the agents were given it (Prometheus only)
    epoch_steps: int | None = None  # an epoch of the job, as its trainers' loaders report it
    gpu_types: tuple[str, ...] = ()  # the GPU types the agents priced idle at (Prometheus only: the price gauge's)
    whatif: dict[str, float] = field(default_factory=dict)
    whatif_keys: float | None = None  # keys the what-if's curve tracks; None: it saw no read

    @property
    def stall_total(self) -> float:
        return sum(self.stall_seconds.values())

    @property
    def input_bound_ratio(self) -> float | None:
        """Stall seconds over stall plus compute seconds, as the demo's epoch lines give it."""
        total = self.stall_total + self.compute_seconds
        return self.stall_total / total if total > 0 else None

    @property
    def hub_bytes(self) -> float:
        """Bytes fetched from the hub over the run: the hub throughput over the spans it holds for."""
        return self.hub_bytes_per_second.integral()

    @property
    def epoch_seconds(self) -> float | None:
        """An epoch at the run's pace: its steps over each rank's steps a second, over the run."""
        steps = self.steps_per_second.integral()
        if not self.epoch_steps or steps <= 0 or self.end <= self.start:
            return None
        return self.epoch_steps * max(self.ranks, 1) * (self.end - self.start) / steps

    @property
    def steady_at(self) -> float | None:
        """The instant the time to steady points at: the cache was warm from there."""
        if self.job_started is None or self.time_to_steady_seconds is None:
            return None
        return self.job_started + self.time_to_steady_seconds
