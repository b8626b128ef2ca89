"""A run drawn as one self-contained HTML page, its PNG figures (matplotlib) inline."""

from __future__ import annotations

import base64
import html
import io
import time
from typing import Any

import numpy as np

from stallwatch import catalogue as c
from stallwatch.report.run import Run, Series

PHASE_COLOURS = {"cold": "#4a90d9", "transition": "#f5a623", "steady": "#7ed321"}
CAUSE_COLOURS = {cause.name: cause.colour for cause in c.CAUSE_TABLE}


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


def _clock(t: float, with_date: bool = False) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S" if with_date else "%H:%M:%S", time.gmtime(t))


def _shade(axis: Any, run: Run) -> None:
    for start, end, phase in run.phases:
        axis.axvspan(start - run.start, max(end, start + 1) - run.start, color=PHASE_COLOURS.get(phase, "#ddd"),
                     alpha=0.15, lw=0)


def _timeline(run: Run, series: Series, label: str, unit: str, scale: float = 1.0) -> str:
    def draw(axis: Any) -> None:
        _shade(axis, run)
        axis.plot(series.t - run.start, series.v * scale, lw=1.5, color="#333")
        axis.set_ylabel(f"{label} ({unit})" if unit else label)
        axis.set_xlabel(f"seconds since {_clock(run.start)} UTC")
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
        axis.set_xlabel(f"seconds since {_clock(run.start)} UTC")
        axis.set_xlim(0, run.end - run.start)
        axis.grid(alpha=0.3)

    return _figure_png(draw, 2.6)


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{unit}"


def _header(run: Run) -> str:
    """When the run was (UTC wall clock), what it covers and its phases' spans."""
    same_day = time.gmtime(run.start)[:3] == time.gmtime(run.end)[:3]
    scope = "".join(f", {kind} {html.escape(name)}" for kind, name in (("job", run.job), ("node", run.node)) if name)
    spans = ", ".join(f"{html.escape(phase)} {_clock(start)}&ndash;{_clock(end)}" for start, end, phase in run.phases)
    return (f"Run from {_clock(run.start, True)} to {_clock(run.end, not same_day)} UTC "
            f"({run.end - run.start:,.0f} s){scope}."
            f'<br><span id="phases">Phases: {spans or _no_phases(run)}</span>')


def _no_phases(run: Run) -> str:
    if run.several_jobs:
        return f"one per job ({html.escape(', '.join(run.several_jobs))}): pass --job to see one"
    return "none seen"


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
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>stallwatch warm-up report</title>
<style>body{{font-family:sans-serif;max-width:1040px;margin:2em auto;color:#222}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}
img{{width:100%}}.k{{font-size:1.6em;font-weight:bold}}</style></head>
<body>
<h1>stallwatch warm-up report</h1>
<p id="run">{_header(run)}</p>
<p>Shading: {legend}</p>
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
