"""A run read from a Prometheus server: query_range over the run, counter rates computed from the raw series."""

from __future__ import annotations

import numpy as np

from stallwatch import catalogue as c
from stallwatch.mixin.promql import by
from stallwatch.report.api import PLAIN, Access, Labels, Prometheus
from stallwatch.report.run import FloatArray, Run, Series
from stallwatch.report.scope import EVERYTHING, Scope

RATE_WINDOW_SECONDS = 15.0


def _one(series: list[tuple[Labels, Series]]) -> Series:
    return series[0][1] if series else Series.empty()


def _scalar(values: list[tuple[Labels, float]]) -> float | None:
    return max(v for _, v in values) if values else None


def phase_spans(phases: list[tuple[Labels, Series]], stamps: Series) -> list[tuple[float, float, str]]:
    """Spans of the job's phases from the phase gauges (`max by (phase)`) and, on the same grid, the
    timestamp of the sample each step saw (`timestamp()`).

    The correlator stamps a window's series with the window's end, so each distinct stamp is one window,
    covering the time since the stamp before it (the first: one typical gap before its own)."""
    seen = {t: labels["phase"] for labels, series in phases for t, v in zip(series.t, series.v, strict=True) if v >= 1}
    windows = {stamp: seen[t] for t, stamp in zip(stamps.t, stamps.v, strict=True) if t in seen}
    ends = sorted(windows)
    if not ends:
        return []
    gaps = np.diff(ends)
    previous = ends[0] - (float(np.median(gaps)) if gaps.size else 0.0)
    spans: list[tuple[float, float, str]] = []
    for end in ends:
        if spans and spans[-1][2] == windows[end]:
            spans[-1] = (spans[-1][0], end, windows[end])
        else:
            spans.append((previous, end, windows[end]))
        previous = end
    return spans


def counter_rates(prometheus: Prometheus, counter: str, group: str, start: float, end: float, step: float,
                  window: float) -> dict[str, Series]:
    """Per-second rates of the counter summed by `group`, over `window` seconds, on a grid of `step`.

    Computed here from the raw series rather than with PromQL's rate(): a counter born during the run
    (the first misses of a cold cache, the first stall of a job) starts at its first value, which
    rate() cannot see, and that first value is exactly the warm-up this report is about.
    """
    grid = np.arange(start, end + step / 2, step)
    totals: dict[str, FloatArray] = {}
    for labels, series in prometheus.range(counter, start, end, step):
        values = series.v
        steps = np.diff(values, prepend=values[0] if series.t[0] <= start + 2 * step else 0.0)
        steps = np.where(steps < 0, values, steps)  # a reset: the counter restarted from zero
        increments = np.zeros(grid.size)
        np.add.at(increments, np.clip(np.searchsorted(grid, series.t - step / 2), 0, grid.size - 1), steps)
        key = labels.get(group, "") if group else ""
        totals[key] = totals.get(key, np.zeros(grid.size)) + increments
    width = max(1, round(window / step))
    kernel = np.ones(width)
    return {key: Series(grid, np.convolve(inc, kernel)[: grid.size] / (width * step)) for key, inc in totals.items()}


def gpu_utilization_query(scope: Scope, window: float, run_seconds: float) -> str:
    """Mean utilization of the scope's GPUs; for a job, the GPUs the correlator saw its ranks on during the run
    (its GPU map, as the dashboards join it), looked up once over the whole run (`@ end()`)."""
    per_gpu = f"avg_over_time({scope.select(c.GPU_UTILIZATION)}[{window:.0f}s])"
    if scope.job is not None:
        seen = f"last_over_time({scope.select(c.GPU_STALL_IDLE_SECONDS)}[{run_seconds + window:.0f}s] @ end())"
        per_gpu = f"{per_gpu} and on (instance, gpu) {by('instance, gpu', 'group', seen)}"
    return by("", "avg", per_gpu)


def range_step(start: float, end: float) -> float:
    """Seconds between the points of the report's range queries: 400 points at most, 1 s apart at least."""
    return max(1.0, (end - start) / 400)


def run_from_prometheus(url: str, start: float, end: float, scope: Scope = EVERYTHING,
                        access: Access = PLAIN) -> Run:
    prometheus = Prometheus(url, access)
    step = range_step(start, end)
    window = max(RATE_WINDOW_SECONDS, 5 * step)

    def rates(counter: str, group: str = "") -> dict[str, Series]:
        return counter_rates(prometheus, counter, group, start, end, step, window)

    def latest(expr: str) -> float | None:
        return _scalar(prometheus.instant(by("", "max", expr), end))

    run = Run(start, end, job=scope.job, node=scope.node)
    run.gpu_utilization = _one(prometheus.range(gpu_utilization_query(scope, window, end - start), start, end, step))
    run.steps_per_second = rates(scope.select(c.STEP_COMPUTE, suffix="_count")).get("", Series.empty())
    by_result = rates(scope.select(c.SPOKE_REQUESTS), "result")
    if by_result:
        grid = next(iter(by_result.values())).t
        total = np.sum([series.v for series in by_result.values()], axis=0)
        hits = by_result["hit"].v if "hit" in by_result else np.zeros_like(total)
        run.hit_ratio = Series(grid, np.divide(hits, total, out=np.full_like(total, np.nan), where=total > 0))
    run.hub_bytes_per_second = rates(scope.select(c.SPOKE_BYTES), "source").get("hub", Series.empty())
    run.stall_by_cause = rates(scope.select(c.STALL_SECONDS), "cause")
    phase = scope.select(c.WARMUP_PHASE)
    if scope.job is None:  # over several jobs, their phases are each job's: which jobs are there?
        seen = by(c.JOB_LABEL, "group", f"last_over_time({phase}[{end - start:.0f}s] @ end())")
        jobs = sorted(labels.get(c.JOB_LABEL, "") for labels, _ in prometheus.instant(seen, end))
        run.several_jobs = tuple(jobs) if len(jobs) > 1 else ()
    if not run.several_jobs:
        run.phases = phase_spans(prometheus.range(by("phase", "max", phase), start, end, step),
                                 _one(prometheus.range(by("", "max", f"timestamp({phase})"), start, end, step)))
        run.time_to_steady_seconds = latest(scope.select(c.WARMUP_TIME_TO_STEADY))
        run.warmup_idle_gpu_seconds = latest(scope.select(c.WARMUP_IDLE_GPU_SECONDS))
        run.warmup_hub_bytes = latest(scope.select(c.WARMUP_HUB_BYTES))
    whatif = by("capacity_factor", "max", scope.select(c.CACHE_WHATIF_HIT_RATIO))
    for labels, value in prometheus.instant(whatif, end):
        run.whatif[labels["capacity_factor"]] = value
    return run
