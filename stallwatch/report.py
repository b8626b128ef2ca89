"""`stallwatch report`: one self-contained HTML page (PNG figures inline) about a run's warm-up.

It answers the question a platform team asks before moving a cluster away from its data: how long
until the cache made remote data as fast as local, what that cost in idle GPU time and cross-region
bytes, where the stalls came from, and what a bigger or smaller spoke would buy.

Sources: a Prometheus server (`--prometheus URL`, query_range over the run) or the correlator's
recorded windows (`--windows FILE`, JSON lines).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from stallwatch import catalogue as c

FloatArray = npt.NDArray[np.float64]
RATE_WINDOW_SECONDS = 15.0


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

    start: float
    end: float
    gpu_utilization: Series = field(default_factory=Series.empty)
    steps_per_second: Series = field(default_factory=Series.empty)
    hit_ratio: Series = field(default_factory=Series.empty)
    hub_bytes_per_second: Series = field(default_factory=Series.empty)
    stall_by_cause: dict[str, Series] = field(default_factory=dict)
    phases: list[tuple[float, float, str]] = field(default_factory=list)
    time_to_steady_seconds: float | None = None
    warmup_idle_gpu_seconds: float | None = None
    warmup_hub_bytes: float | None = None
    whatif: dict[str, float] = field(default_factory=dict)


# --- from Prometheus -----------------------------------------------------------------------------------
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


# --- from the correlator's recorded windows -------------------------------------------------------------
def run_from_windows(path: Path, job: str | None = None) -> Run:
    """A run from `--correlator.record-windows` rows: one per closed window, times on the node's monotonic clock."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no windows recorded")
    t = np.array([(row["start_s"] + row["end_s"]) / 2 for row in rows])
    length = np.array([row["end_s"] - row["start_s"] for row in rows])

    def total(key: str, pick: Any) -> FloatArray:
        return np.array([sum(pick(item) for item in row[key] if job is None or item["job"] == job) for row in rows],
                        dtype=np.float64)

    compute = total("ranks", lambda r: r["compute_s"])
    ranks = np.maximum(np.array([len(row["ranks"]) for row in rows], dtype=np.float64), 1)
    reads = total("jobs", lambda j: j["reads"])
    hits = total("jobs", lambda j: j["reads"] * j["hit_ratio"])
    run = Run(start=float(rows[0]["start_s"]), end=float(rows[-1]["end_s"]))
    run.gpu_utilization = Series(t, compute / length / ranks)  # the emulated GPU is busy while its rank computes
    run.steps_per_second = Series(t, total("ranks", lambda r: r["steps"]) / length)
    run.hit_ratio = Series(t, np.divide(hits, reads, out=np.full_like(hits, np.nan), where=reads > 0))
    run.hub_bytes_per_second = Series(t, total("jobs", lambda j: j["hub_bytes"]) / length)
    for cause in c.CAUSES:
        run.stall_by_cause[cause] = Series(t, total("ranks", lambda r, k=cause: r["stall_s"][k]) / length)
    for row in rows:
        for item in row["jobs"]:
            if job is None or item["job"] == job:
                if run.phases and run.phases[-1][2] == item["phase"]:
                    run.phases[-1] = (run.phases[-1][0], row["end_s"], item["phase"])
                else:
                    run.phases.append((row["start_s"], row["end_s"], item["phase"]))
                if item["time_to_steady_s"] is not None:
                    run.time_to_steady_seconds = item["time_to_steady_s"]
                    run.warmup_idle_gpu_seconds = item["warmup_idle_gpu_s"]
                    run.warmup_hub_bytes = item["warmup_hub_bytes"]
        if row["whatif_hit_ratio"]:
            run.whatif = {k: float(v) for k, v in row["whatif_hit_ratio"].items()}
    return run


# --- rendering -----------------------------------------------------------------------------------------
PHASE_COLOURS = {"cold": "#4a90d9", "transition": "#f5a623", "steady": "#7ed321"}
CAUSE_COLOURS = {"remote_fetch": "#d0021b", "cache_read": "#f5a623", "preprocess": "#9013fe", "other": "#9b9b9b"}


def _figure_png(draw: Any, height: float = 2.2) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, height), dpi=100)
    draw(axis)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _shade(axis: Any, run: Run) -> None:
    for start, end, phase in run.phases:
        axis.axvspan(start - run.start, max(end, start + 1) - run.start, color=PHASE_COLOURS.get(phase, "#ddd"),
                     alpha=0.15, lw=0)


def _timeline(run: Run, series: Series, label: str, unit: str, scale: float = 1.0) -> str:
    def draw(axis: Any) -> None:
        _shade(axis, run)
        axis.plot(series.t - run.start, series.v * scale, lw=1.5, color="#333")
        axis.set_ylabel(f"{label} ({unit})" if unit else label)
        axis.set_xlabel("seconds since start")
        axis.set_xlim(0, run.end - run.start)
        axis.grid(alpha=0.3)

    return _figure_png(draw)


def _stalls(run: Run) -> str:
    def draw(axis: Any) -> None:
        _shade(axis, run)
        causes = [cause for cause in c.CAUSES if cause in run.stall_by_cause]
        if causes:
            t = run.stall_by_cause[causes[0]].t
            stacked = [np.interp(t, run.stall_by_cause[k].t, run.stall_by_cause[k].v) for k in causes]
            axis.stackplot(t - run.start, *stacked, labels=causes, colors=[CAUSE_COLOURS[k] for k in causes])
            axis.legend(loc="upper right", fontsize=8)
        axis.set_ylabel("stall s per s")
        axis.set_xlabel("seconds since start")
        axis.set_xlim(0, run.end - run.start)
        axis.grid(alpha=0.3)

    return _figure_png(draw, 2.6)


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{unit}"


def render_html(run: Run, price_per_gb: float) -> str:
    hub_gb = None if run.warmup_hub_bytes is None else run.warmup_hub_bytes / 1e9
    cost = None if hub_gb is None else hub_gb * price_per_gb
    figures = [
        ("GPU utilization", _timeline(run, run.gpu_utilization, "GPU utilization", "%", 100)),
        ("Step throughput", _timeline(run, run.steps_per_second, "steps/s", "")),
        ("Spoke hit ratio", _timeline(run, run.hit_ratio, "hit ratio", "%", 100)),
        ("Hub throughput (cross-region)", _timeline(run, run.hub_bytes_per_second, "hub", "MB/s", 1e-6)),
        ("Stall seconds by cause", _stalls(run)),
    ]
    whatif_rows = "".join(
        f"<tr><td>{html.escape(k)}&times;</td><td>{v * 100:.1f} %</td></tr>"
        for k, v in sorted(run.whatif.items(), key=lambda kv: float(kv[0]))
    ) or "<tr><td colspan=2>no estimate (no reads seen)</td></tr>"
    legend = " ".join(f'<span style="background:{colour}33;padding:2px 6px">{phase}</span>'
                      for phase, colour in PHASE_COLOURS.items())
    blocks = "".join(f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" src="data:image/png;base64,{png}">'
                     for title, png in figures)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run.start))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>stallwatch warm-up report</title>
<style>body{{font-family:sans-serif;max-width:1040px;margin:2em auto;color:#222}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}
img{{width:100%}}.k{{font-size:1.6em;font-weight:bold}}</style></head>
<body>
<h1>stallwatch warm-up report</h1>
<p>Run from {when}, {run.end - run.start:,.0f} s. Phases: {legend}</p>
<table><tr><th>time to steady</th><th>idle GPU-seconds during warm-up</th><th>hub bytes during warm-up</th>
<th>cross-region cost at ${price_per_gb:.3f}/GB</th></tr>
<tr><td class="k" id="time-to-steady">{_fmt(run.time_to_steady_seconds, " s")}</td>
<td class="k" id="warmup-idle">{_fmt(run.warmup_idle_gpu_seconds, " s")}</td>
<td class="k" id="warmup-hub-bytes">{_fmt(hub_gb, " GB", 3)}</td>
<td class="k" id="warmup-cost">{'n/a' if cost is None else f'${cost:,.4f}'}</td></tr></table>
{blocks}
<h2>What a different spoke would buy</h2>
<table id="whatif"><tr><th>capacity</th><th>estimated hit ratio</th></tr>{whatif_rows}</table>
</body></html>
"""


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallwatch report", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prometheus", metavar="URL", help="read the run from this Prometheus")
    source.add_argument("--windows", type=Path, metavar="FILE", help="read the run from the correlator's "
                        "recorded windows (the agent's --correlator.record-windows FILE)")
    parser.add_argument("--start", type=float, help="run start, unix seconds (default: 15 minutes ago)")
    parser.add_argument("--end", type=float, help="run end, unix seconds (default: now)")
    parser.add_argument("--price-per-gb", type=float, default=0.02,
                        help="cross-region transfer price in $/GB (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("stallwatch-report.html"), help="(default: %(default)s)")
    options = parser.parse_args(argv)
    import matplotlib  # noqa: F401  # the figures need it: without the extra, fail before reading the run

    end = options.end or time.time()
    start = options.start or end - 900
    try:
        run = (run_from_windows(options.windows) if options.windows
               else run_from_prometheus(options.prometheus, start, end))
    except (OSError, RuntimeError, ValueError) as error:
        print(f"stallwatch report: error: {error}", file=sys.stderr)
        return 1
    options.out.write_text(render_html(run, options.price_per_gb))
    print(f"report: {options.out}")
    return 0
