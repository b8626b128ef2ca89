"""What one closed window yields: per rank, per GPU, per job, and the cache what-if.

A window's result also carries the pieces of its stalls that lie in earlier windows (`earlier`: a long
wait is cut at window boundaries), each job's stall spans (so that pieces merged into a window keep
the job's stalled seconds a union in time), and how far each rank's timeline is known (`known_ns`),
which is when the window hold (hold.py) may publish a job's window.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stallwatch.catalogue import CAUSES
from stallwatch.correlator.forecast import Forecast
from stallwatch.correlator.intervals import I64, union_length
from stallwatch.correlator.wallclock import unix_seconds

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
    forecast: Forecast | None = None  # while cold; once steady, what happened
    epoch_steps: int | None = None  # of its first epoch, as its trainers report it (`passes.py`)
    failed_reads: int = 0  # its reads here that got no bytes (failed fetches), as the agent counts them


@dataclass(frozen=True)
class WhatIfCurve:
    """The state of the what-if's miss-ratio curve: its sampling rate and the keys it tracks."""

    sample_rate: float
    keys: int


Spans = tuple[I64, I64]  # starts and ends (ns) of stall intervals


def stalled_seconds(spans: Spans) -> float:
    """The length of the union of the spans, in seconds."""
    starts, ends = spans
    return float(union_length(np.zeros(starts.size, dtype=np.int64), starts, ends, 1)[0]) / 1e9


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
    # Per job, its stall intervals clipped to this window: JobRow.stalled_s is their union.
    stall_spans: Mapping[int, Spans] = field(default_factory=dict, compare=False)
    # The pieces of this window's stalls in earlier windows, one result per window (no job rows, no steps).
    earlier: tuple[WindowResult, ...] = ()
    # Per (job, rank) seen here or buffered for later windows: the rank's timeline is complete up to this
    # time (ns); no later stall of it can reach back before it.
    known_ns: Mapping[tuple[int, int], int] = field(default_factory=dict)

    def job_ids(self) -> set[int]:
        return ({r.job for r in self.ranks} | {g.job for g in self.gpus} | {j.job for j in self.jobs}
                | set(self.stall_spans))

    def of_jobs(self, jobs: set[int]) -> WindowResult:
        """This window's rows of the given jobs only (no earlier pieces, no known times, no retirements)."""
        return dataclasses.replace(
            self, ranks=tuple(r for r in self.ranks if r.job in jobs),
            gpus=tuple(g for g in self.gpus if g.job in jobs),
            jobs=tuple(j for j in self.jobs if j.job in jobs),
            retired_jobs=(),
            stall_spans={j: s for j, s in self.stall_spans.items() if j in jobs}, earlier=(), known_ns={})

    def record(self, job_names: NameLookup, wall_offset_ns: int) -> dict[str, Any]:
        """The window as one JSON-ready row (a line of the window file), its bounds in unix seconds."""
        return {
            "start_s": unix_seconds(self.start_ns, wall_offset_ns),
            "end_s": unix_seconds(self.end_ns, wall_offset_ns),
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
                 "regressions": j.regressions, "stalled_s": j.stalled_s,
                 "epoch_steps": j.epoch_steps, "failed_reads": j.failed_reads, **_forecast_fields(j.forecast)}
                for j in self.jobs
            ],
            "whatif_hit_ratio": {str(factor): ratio for factor, ratio in self.whatif.items()},
            "whatif_sample_rate": self.whatif_curve.sample_rate if self.whatif_curve else None,
            "whatif_keys": self.whatif_curve.keys if self.whatif_curve else None,
        }


def combine(parts: Iterable[WindowResult]) -> WindowResult:
    """Parts of one window as one: several jobs' rows, or a held window and pieces of later stalls booked
    in it. The first part gives the window's bounds and a job's warm-up row, the first with a what-if the
    what-if; rank and GPU rows of the same key add up, and a job's stalled seconds become the union of all
    its spans."""
    first, *rest = parts
    ranks = {(r.job, r.rank): r for r in first.ranks}
    gpus = {(g.job, g.gpu): g for g in first.gpus}
    jobs = {j.job: j for j in first.jobs}
    spans = dict(first.stall_spans)
    for part in rest:
        for r in part.ranks:
            had = ranks.get((r.job, r.rank))
            ranks[(r.job, r.rank)] = r if had is None else RankRow(
                r.job, r.rank, had.steps + r.steps, had.wait_s + r.wait_s, had.compute_s + r.compute_s,
                _add(had.stall_s, r.stall_s))
        for g in part.gpus:
            had_gpu = gpus.get((g.job, g.gpu))
            gpus[(g.job, g.gpu)] = g if had_gpu is None else GpuRow(g.job, g.gpu, _add(had_gpu.idle_s, g.idle_s))
        for j in part.jobs:
            jobs.setdefault(j.job, j)
        for job, (starts, ends) in part.stall_spans.items():
            had_spans = spans.get(job)
            spans[job] = (starts, ends) if had_spans is None else (np.concatenate((had_spans[0], starts)),
                                                                   np.concatenate((had_spans[1], ends)))
    rows = tuple(dataclasses.replace(j, stalled_s=stalled_seconds(spans[j.job])) if j.job in spans else j
                 for j in jobs.values())
    return dataclasses.replace(
        first, ranks=tuple(ranks[k] for k in sorted(ranks)), gpus=tuple(gpus[k] for k in sorted(gpus)),
        jobs=tuple(sorted(rows, key=lambda j: j.job)), stall_spans=spans,
        whatif=next((p.whatif for p in (first, *rest) if p.whatif), {}),
        whatif_curve=next((p.whatif_curve for p in (first, *rest) if p.whatif_curve), None))


def _forecast_fields(forecast: Forecast | None) -> dict[str, float | str | None]:
    """The forecast's columns of a window file's job row: JSON has no infinity, so "never" says it."""
    if forecast is None:
        return {"forecast_time_to_steady_s": None, "forecast_idle_gpu_s": None, "forecast_hub_bytes": None}
    if math.isinf(forecast.time_to_steady_s):
        return {"forecast_time_to_steady_s": "never", "forecast_idle_gpu_s": None, "forecast_hub_bytes": None}
    return {"forecast_time_to_steady_s": forecast.time_to_steady_s, "forecast_idle_gpu_s": forecast.idle_gpu_seconds,
            "forecast_hub_bytes": forecast.hub_bytes}


def _add(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))
