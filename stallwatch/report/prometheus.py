"""A run read from a Prometheus server: query_range over the run, counter rates computed from the raw series."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

import numpy as np

from stallwatch import catalogue as c
from stallwatch.report.run import FloatArray, Run, Series

RATE_WINDOW_SECONDS = 15.0


class Prometheus:
    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self._url = url.rstrip("/")
        self._timeout = timeout

    def _get(self, path: str, params: dict[str, str]) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self._url}{path}?{query}", timeout=self._timeout) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus: {body.get('error', body)}")
        return body["data"]["result"]

    def range(self, expr: str, start: float, end: float, step: float) -> list[tuple[dict[str, str], Series]]:
        result = self._get("/api/v1/query_range",
                           {"query": expr, "start": str(start), "end": str(end), "step": f"{step:.3f}"})
        out = []
        for item in result:
            values = np.array(item["values"], dtype=np.float64).reshape(-1, 2)
            out.append((item["metric"], Series(values[:, 0], values[:, 1])))
        return out

    def instant(self, expr: str, at: float) -> list[tuple[dict[str, str], float]]:
        return [(item["metric"], float(item["value"][1])) for item in self._get("/api/v1/query",
                                                                                 {"query": expr, "time": str(at)})]


def _one(series: list[tuple[dict[str, str], Series]]) -> Series:
    return series[0][1] if series else Series.empty()


def _scalar(values: list[tuple[dict[str, str], float]]) -> float | None:
    return max(v for _, v in values) if values else None


def _phases_from(series: list[tuple[dict[str, str], Series]]) -> list[tuple[float, float, str]]:
    """Contiguous spans of the phase whose gauge is 1."""
    samples = sorted((t, labels["phase"]) for labels, s in series for t, v in zip(s.t, s.v, strict=True) if v >= 1)
    spans: list[tuple[float, float, str]] = []
    for t, phase in samples:
        if spans and spans[-1][2] == phase:
            spans[-1] = (spans[-1][0], t, phase)
        else:
            spans.append((t, t, phase))
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


def run_from_prometheus(url: str, start: float, end: float) -> Run:
    prometheus = Prometheus(url)
    step = max(1.0, (end - start) / 400)
    window = max(RATE_WINDOW_SECONDS, 5 * step)

    def rates(counter: str, group: str = "") -> dict[str, Series]:
        return counter_rates(prometheus, counter, group, start, end, step, window)

    run = Run(start, end)
    run.gpu_utilization = _one(prometheus.range(
        f"avg(avg_over_time({c.GPU_UTILIZATION.name}[{window:.0f}s]))", start, end, step))
    run.steps_per_second = rates(f"{c.STEP_COMPUTE.name}_count").get("", Series.empty())
    by_result = rates(c.SPOKE_REQUESTS.name, "result")
    if by_result:
        grid = next(iter(by_result.values())).t
        total = np.sum([series.v for series in by_result.values()], axis=0)
        hits = by_result["hit"].v if "hit" in by_result else np.zeros_like(total)
        run.hit_ratio = Series(grid, np.divide(hits, total, out=np.full_like(total, np.nan), where=total > 0))
    run.hub_bytes_per_second = rates(c.SPOKE_BYTES.name, "source").get("hub", Series.empty())
    run.stall_by_cause = rates(c.STALL_SECONDS.name, "cause")
    run.phases = _phases_from(prometheus.range(f"max by (phase) ({c.WARMUP_PHASE.name})", start, end, step))
    if run.phases and run.phases[0][2] == "cold":  # the first window is published only once it closes
        run.phases[0] = (start, *run.phases[0][1:])
    run.time_to_steady_seconds = _scalar(prometheus.instant(f"max({c.WARMUP_TIME_TO_STEADY.name})", end))
    run.warmup_idle_gpu_seconds = _scalar(prometheus.instant(f"max({c.WARMUP_IDLE_GPU_SECONDS.name})", end))
    run.warmup_hub_bytes = _scalar(prometheus.instant(f"max({c.WARMUP_HUB_BYTES.name})", end))
    for labels, value in prometheus.instant(f"max by (capacity_factor) ({c.CACHE_WHATIF_HIT_RATIO.name})", end):
        run.whatif[labels["capacity_factor"]] = value
    return run
