"""What one closed window yields: per rank, per GPU, per job, and the cache what-if."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stallwatch.catalogue import CAUSES

NameLookup = Callable[[int], str]  # a small id (job, spoke) -> the name it was interned from


@dataclass(frozen=True)
class RankRow:
    job: int
    rank: int
    steps: int
    wait_s: float
    compute_s: float
    stall_s: tuple[float, ...]  # CAUSES order

    @property
    def input_bound_ratio(self) -> float:
        total = self.wait_s + self.compute_s
        return self.wait_s / total if total > 0 else 0.0


@dataclass(frozen=True)
class GpuRow:
    job: int
    gpu: int
    idle_s: tuple[float, ...]  # CAUSES order


@dataclass(frozen=True)
class JobRow:
    job: int
    phase: str
    hit_ratio: float | None
    reads: int
    hub_bytes: int
    time_to_steady_s: float | None
    warmup_idle_gpu_s: float
    warmup_hub_bytes: int
    regressions: int
    # Seconds in which at least one of the job's ranks here stalled (the union of their stalls in time). In a
    # synchronous job the ranks' waits of one step start together, so this is the sum over steps of the
    # longest local wait: what the job loses per GPU to this node's stalls.
    stalled_s: float = 0.0


@dataclass(frozen=True)
class WhatIfCurve:
    """The state of the what-if's miss-ratio curve: its sampling rate and the keys it tracks."""

    sample_rate: float
    keys: int


@dataclass(frozen=True)
class WindowResult:
    start_ns: int
    end_ns: int
    ranks: tuple[RankRow, ...]
    gpus: tuple[GpuRow, ...]
    jobs: tuple[JobRow, ...]
    whatif: dict[float, float] = field(default_factory=dict)  # capacity factor -> hit ratio
    retired_jobs: tuple[int, ...] = ()
    whatif_curve: WhatIfCurve | None = None  # None before the curve saw a reference

    def record(self, job_names: NameLookup) -> dict[str, Any]:
        """The window as one JSON-ready row (a line of the window file)."""
        return {
            "start_s": self.start_ns / 1e9,
            "end_s": self.end_ns / 1e9,
            "ranks": [
                {"job": job_names(r.job), "rank": r.rank, "steps": r.steps, "wait_s": r.wait_s,
                 "compute_s": r.compute_s, "input_bound_ratio": r.input_bound_ratio,
                 "stall_s": dict(zip(CAUSES, r.stall_s, strict=True))}
                for r in self.ranks
            ],
            "gpus": [
                {"job": job_names(g.job), "gpu": g.gpu, "idle_s": dict(zip(CAUSES, g.idle_s, strict=True))}
                for g in self.gpus
            ],
            "jobs": [
                {"job": job_names(j.job), "phase": j.phase, "hit_ratio": j.hit_ratio, "reads": j.reads,
                 "hub_bytes": j.hub_bytes, "time_to_steady_s": j.time_to_steady_s,
                 "warmup_idle_gpu_s": j.warmup_idle_gpu_s, "warmup_hub_bytes": j.warmup_hub_bytes,
                 "regressions": j.regressions, "stalled_s": j.stalled_s}
                for j in self.jobs
            ],
            "whatif_hit_ratio": {str(factor): ratio for factor, ratio in self.whatif.items()},
            "whatif_sample_rate": self.whatif_curve.sample_rate if self.whatif_curve else None,
            "whatif_keys": self.whatif_curve.keys if self.whatif_curve else None,
        }
