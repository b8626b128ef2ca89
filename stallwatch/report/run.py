"""What the report shows, whichever source it came from: time series on a shared clock and the warm-up figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclass
class Series:
    t: FloatArray
    v: FloatArray

    @classmethod
    def empty(cls) -> Series:
        return cls(np.zeros(0), np.zeros(0))


@dataclass
class Run:
    """Everything the report shows, whichever source it came from."""

    start: float  # unix seconds
    end: float
    job: str | None = None  # the training job the run was narrowed to, if any
    node: str | None = None
    gpu_utilization: Series = field(default_factory=Series.empty)
    steps_per_second: Series = field(default_factory=Series.empty)
    hit_ratio: Series = field(default_factory=Series.empty)
    hub_bytes_per_second: Series = field(default_factory=Series.empty)
    stall_by_cause: dict[str, Series] = field(default_factory=dict)
    phases: list[tuple[float, float, str]] = field(default_factory=list)
    # Phases and warm-up figures are a job's: over several jobs, left empty, and these are the jobs.
    several_jobs: tuple[str, ...] = ()
    time_to_steady_seconds: float | None = None
    warmup_idle_gpu_seconds: float | None = None
    warmup_hub_bytes: float | None = None
    whatif: dict[str, float] = field(default_factory=dict)
