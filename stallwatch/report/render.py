"""A run drawn as one self-contained HTML page, its PNG figures (matplotlib) inline.

Every figure says which metric it is; what the run cannot know (no GPU, no spoke, no reads) is said in words
where its figure would be."""

from __future__ import annotations

import base64
import html
import io
import math
import time
from typing import Any

import numpy as np

from stallwatch import catalogue as c
from stallwatch.mixin.config import Thresholds
from stallwatch.prices import SET_BY_FLAG, Prices
from stallwatch.report.cost import hit_ratio_now, period, sizing, smallest_under
from stallwatch.report.run import FloatArray, Run, Series
from stallwatch.report.stage import StageOrStream, Verdict, weigh

INPUT_BOUND_TARGET = Thresholds().input_bound_ratio  # the share at which the input-bound alert fires
PHASE_COLOURS = {"cold": "#4a90d9", "transition": "#f5a623", "steady": "#7ed321"}
CAUSE_COLOURS = {cause.name: cause.colour for cause in c.CAUSE_TABLE}
# What each timeline is, by source: the metric a user would query for the same figure.
WHAT = {
    "prometheus": {
        "gpu": f"mean of the job's GPUs' {c.GPU_UTILIZATION.name} over each step of the figure",
        "steps": f"increase of {c.STEP_COMPUTE.name}_count per second, all ranks",
        "hit": f"the spoke's {c.SPOKE_REQUESTS.name}{{result=\"hit\"}} over all its requests",
        "hub": f"increase of {c.SPOKE_BYTES.name}{{source=\"hub\"}} per second: the spoke's fetches",
    },
    "windows": {
        "steps": "steps per second of the job's ranks in each window",
        "hit": "the job's reads that crossed the spoke and hit, over all of them, in each window",
        "hub": "bytes of the job's reads that missed the spoke, per second, in each window",
    },
}


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


def _steps(series: Series, since: float) -> tuple[FloatArray, FloatArray]:
    """A series as steps, each value over its own span, broken where no span covers the time."""
    x: list[float] = []
    y: list[float] = []
    for i, (start, end, value) in enumerate(zip(series.t, series.end, series.v, strict=True)):
        x += [start - since, end - since]
        y += [value, value]
        if i + 1 < series.t.size and series.t[i + 1] > end + 1e-3:
            x.append(end - since)
            y.append(np.nan)
    return np.array(x), np.array(y)


def _axes(axis: Any, run: Run, label: str) -> None:
    for start, end, phase in run.phases:
        axis.axvspan(start - run.start, max(end, start + 1) - run.start, color=PHASE_COLOURS.get(phase, "#ddd"),
                     alpha=0.15, lw=0)
    if run.steady_at is not None:
        axis.axvline(run.steady_at - run.start, color="#2b7a0b", ls="--", lw=1.2, label="time to steady")
    axis.set_ylabel(label)
    axis.set_xlabel(f"seconds since {_clock(run.start)} UTC")
    axis.set_xlim(0, run.end - run.start)
    axis.grid(alpha=0.3)


def _timeline(run: Run, series: Series, label: str, scale: float = 1.0) -> str:
    def draw(axis: Any) -> None:
        _axes(axis, run, label)
        x, y = _steps(series, run.start)
        axis.plot(x, y * scale, lw=1.5, color="#333")

    return _figure_png(draw)


def _stalls(run: Run) -> str:
    def draw(axis: Any) -> None:
        _axes(axis, run, "stall s per s per rank")
        lower: FloatArray | None = None
        for cause in c.CAUSES:
            x, y = _steps(run.stall_by_cause[cause], run.start)
            base = np.zeros_like(y) if lower is None else lower
            if np.nansum(y) > 0:
                axis.fill_between(x, base, base + y, color=CAUSE_COLOURS[cause], lw=0, label=cause)
            lower = base + y
        axis.set_ylim(0, 1.05)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(loc="upper right", fontsize=8)

    return _figure_png(draw, 2.6)


def _fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{unit}"


def _header(run: Run) -> str:
    """When the run was (UTC wall clock), what it covers and its phases' spans."""
    same_day = time.gmtime(run.start)[:3] == time.gmtime(run.end)[:3]
    scope = "".join(f", {kind} {html.escape(name)}" for kind, name in (("job", run.job), ("node", run.node)) if name)
    spans = ", ".join(f"{html.escape(phase)} {_clock(start)}&ndash;{_clock(end)}" for start, end, phase in run.phases)
    nodes = f", {run.nodes} nodes combined" if run.nodes > 1 else ""
    return (f"Run from {_clock(run.start, True)} to {_clock(run.end, not same_day)} UTC "
            f"({run.end - run.start:,.0f} s){scope}{nodes}."
            f'<br><span id="phases">Phases as recognised: {spans or _no_phases(run)}</span>')


def _no_phases(run: Run) -> str:
    if run.several_jobs:
        return f"one per job ({html.escape(', '.join(run.several_jobs))}): pass --job to see one"
    return "none seen"


def _gpu_unknown(run: Run) -> str | None:
    """Why the run's GPU idle and utilization cannot be shown, if they cannot."""
    if run.gpu_devices == 0:
        return f"no GPU on this node ({c.GPU_DEVICES.name} 0)" if run.nodes == 1 else "no GPU on the job's nodes"
    if run.gpu_devices is None and not any(run.gpu_stall_idle_seconds.values()):
        return "not known: the source does not say whether the node has GPUs"
    return None


def _headline(run: Run) -> str:
    """The job's input-bound share and its stalls by cause, in seconds and shares; the GPU idle in them."""
    ratio = run.input_bound_ratio
    ranks = f"summed over {run.ranks} rank{'s' if run.ranks != 1 else ''}"
    said = ("no step seen" if ratio is None else
            f"of step time waiting for input: {run.stall_total:,.1f} s stalled, {run.compute_seconds:,.1f} s "
            f"computing ({ranks}; {c.STALL_SECONDS.name} over it plus {c.COMPUTE_SECONDS.name})")
    gpu = _gpu_unknown(run)
    rows = "".join(
        f"<tr><td style='text-align:left'><span style='color:{CAUSE_COLOURS[cause]}'>&#9632;</span> {cause}</td>"
        f"<td>{run.stall_seconds[cause]:,.1f} s</td>"
        f"<td>{(run.stall_seconds[cause] / run.stall_total * 100 if run.stall_total else 0):.1f} %</td>"
        f"<td>{'&ndash;' if gpu else f'{run.gpu_stall_idle_seconds[cause]:,.1f} s'}</td></tr>"
        for cause in c.CAUSES)
    return (f'<p>Input-bound: <span class="k" id="input-bound">{_fmt(None if ratio is None else ratio * 100, " %")}'
            f"</span> {html.escape(said)}.</p>"
            f'<table id="stalls"><tr><th>cause</th><th>stall seconds ({ranks})</th><th>share of the stall</th>'
            f'<th id="gpu-idle">GPU idle in these stalls ({html.escape(gpu or c.GPU_STALL_IDLE_SECONDS.name)})</th>'
            f"</tr>{rows}</table>{_failed_reads(run)}")


def _failed_reads(run: Run) -> str:
    """Whether reads failed: what tells an outage (the hub out, the spoke failing) from a cache that is cold."""
    if run.failed_reads is None:
        said = ("not in this window file (its agent did not count them)" if run.source == "windows" else
                f"not known: Prometheus holds no {c.DATASET_FAILED_READS.name} of the run (no agent counted its reads)")
    elif not run.failed_reads:
        said = "none: every read got its bytes"
    else:
        said = (f"{run.failed_reads:,.0f} reads got no bytes (an error reply, a request that got no reply, a read "
                "that raised: the hub out, or the spoke failing); their workers' back-off until each retry is in "
                f"{c.REMOTE_FETCH.name} above ({c.DATASET_FAILED_READS.name})")
    return f'<p id="failed-reads">Failed reads: {said}.</p>'


def _steady(run: Run) -> str:
    if run.not_steady:
        return f"not steady yet on {', '.join(run.not_steady)}"
    if run.time_to_steady_seconds is None:
        return "not steady in this run"
    recognised = next((start for start, _, phase in run.phases if phase == "steady"), None)
    said = [f"{c.WARMUP_TIME_TO_STEADY.name}: from the job's first event to the start of the windows that proved "
            "the cache warm"]
    if run.steady_at is not None:
        said.append(f"warm from {_clock(run.steady_at)} UTC (the dashed line)")
    if recognised is not None:
        said.append(f"steady recognised at {_clock(recognised)} UTC, when enough windows had proved it")
    if run.nodes > 1:
        said.append(f"the last of {run.nodes} nodes to be steady")
    return "; ".join(said)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.1f} s"
    return f"{seconds / 60:,.1f} min" if seconds < 7200 else f"{seconds / 3600:,.1f} h"


def _gb(hub_bytes: float) -> str:
    return f"{hub_bytes / 1e9:,.3f} GB"


def _streamed(weighed: StageOrStream) -> str:
    """What streaming cost: its warm-up, then each hour (from the start when it never got steady)."""
    said = []
    if (warmup := weighed.warmup) is not None:
        each = "" if warmup.seconds_per_gpu is None else f", {warmup.seconds_per_gpu:,.1f} s per GPU"
        said.append(f"Streaming through the spoke cost {_dollars(warmup.dollars)} in its warm-up "
                    f"({warmup.idle_gpu_seconds:,.1f} GPU-seconds idle in stalls until steady{each}, and "
                    f"{_gb(warmup.hub_bytes)} from the hub)")
    if (residual := weighed.residual) is not None:
        if weighed.steady:
            lead, since, over = "and" if said else "Streaming through the spoke cost", "since", "after steady"
        else:
            lead, since, over = ("The job never got steady (its spoke never held what it read again), so streaming "
                                 "kept paying:", "from its start", "of the run")
        said.append(f"{lead} {_dollars(residual.dollars_per_hour)} an hour {since} ({residual.idle_gpu_seconds:,.1f} "
                    f"GPU-seconds idle in remote fetches and {_gb(residual.hub_bytes)} from the hub in the "
                    f"{_duration(residual.seconds)} {over})")
    return " ".join(said) + "." if said else ""


def _staged(weighed: StageOrStream) -> str:
    """What the copy would have cost or, without the dataset's size, what it costs a GB."""
    if weighed.gpus is None or weighed.hub_bytes_per_second is None:
        return ""
    pace = (f"at {weighed.hub_bytes_per_second / 1e6:,.1f} MB/s (the hub's mean throughput over the spans in "
            f"which reads missed the spoke) with {weighed.gpus} GPU{'s' if weighed.gpus != 1 else ''} reserved")
    if (copy := weighed.copy) is None:
        return f"Staging costs {_dollars(weighed.copy_dollars_per_gb)} a GB: a copy {pace}, and its egress."
    what = "the dataset" if copy.given else "the data the job read until its cache was warm"
    return (f"Staging would have cost {_dollars(copy.dollars)} up front: a copy of {_gb(copy.dataset_bytes)} ({what}) "
            f"{pace} takes {_duration(copy.seconds)} ({_dollars(copy.gpu_dollars)}), plus "
            f"{_dollars(copy.egress_dollars)} of egress.")


def _verdict(weighed: StageOrStream, epoch_seconds: float | None) -> str:
    said = ""
    hours = None
    if (until := weighed.break_even_hours) is not None:
        hours = _duration(until * 3600)
        if epoch_seconds:
            hours += f" ({until * 3600 / epoch_seconds:,.1f} epochs at the run's pace)"
    if weighed.verdict is Verdict.STAGE_WINS:
        said = "Staging wins from the start: the copy costs no more than streaming's warm-up alone."
    elif weighed.verdict is Verdict.STREAM_WINS:
        said = "Streaming wins at any length: its steady state costs nothing more."
    elif hours is not None:  # streaming wins until then
        said = (f"Streaming wins unless the job runs longer than {hours} past its warm-up." if weighed.steady else
                f"Staging wins for any job longer than {hours}; streaming only for a shorter one.")
    elif weighed.verdict is Verdict.NOT_KNOWN:
        said = f"Not enough to weigh the two: not known, {'; '.join(weighed.missing)}."
    if not weighed.steady and (size := weighed.break_even_bytes_per_hour):
        said += (f" Staging wins for a dataset under {_gb(size)} per hour the job runs: an hour of streaming costs "
                 "what staging that much would.")
    return said


def _no_reuse(weighed: StageOrStream, tried: bool) -> str:
    fetched = "" if (residual := weighed.residual) is None else (
        f" ({_gb(residual.hub_bytes)} from the hub, its remote fetches idling the GPUs "
        f"{residual.idle_gpu_seconds:,.1f} GPU-seconds)")
    return (f"no read hit the spoke{', nor would at any capacity its what-if tried' if tried else ''}: the job read "
            f"each byte once. A copy would fetch the same bytes the stream fetched{fetched}, and hold the GPUs for "
            "all of it before the first step, where the stream overlapped its fetches with compute. Staging buys "
            "nothing the stream did not also pay.")


def _stage_or_stream(run: Run, prices: Prices, dataset_bytes: float | None) -> str:
    """Would copying the dataset next to the GPUs first have cost less than streaming it through the spoke?"""
    weighed = weigh(run, prices, dataset_bytes)
    if weighed.verdict is Verdict.NOTHING_TO_STAGE:
        said = "no read crossed a spoke: there is nothing to stage."
    elif weighed.verdict is Verdict.SEVERAL_JOBS:
        said = (f"the run holds several jobs ({html.escape(', '.join(run.several_jobs))}): pass --job to weigh "
                "staging one job's dataset against streaming it.")
    elif weighed.verdict is Verdict.NO_REUSE:
        said = _no_reuse(weighed, bool(run.whatif))
    else:
        said = " ".join(filter(None, (_streamed(weighed), _staged(weighed), _verdict(weighed, run.epoch_seconds))))
    return f'<p id="stage-or-stream">Stage or stream: {said}</p>'


def _warmup(run: Run, prices: Prices) -> str:
    hub_gb = None if run.warmup_hub_bytes is None else run.warmup_hub_bytes / 1e9
    cost = None if run.warmup_hub_bytes is None else prices.egress_cost(run.warmup_hub_bytes)
    summed = f", summed over {run.nodes} nodes" if run.nodes > 1 else ""
    return f"""<h2>Warm-up</h2>
<table><tr><th>time to steady</th><th>GPU idle in stalls until steady was recognised</th>
<th>hub bytes until steady was recognised</th><th>cross-region cost at ${prices.egress_dollars_per_gb:.3f}/GB</th></tr>
<tr><td class="k" id="time-to-steady">{_fmt(run.time_to_steady_seconds, " s")}</td>
<td class="k" id="warmup-idle">{_fmt(run.warmup_idle_gpu_seconds, " s")}</td>
<td class="k" id="warmup-hub-bytes">{_fmt(hub_gb, " GB", 3)}</td>
<td class="k" id="warmup-cost">{'n/a' if cost is None else f'${cost:,.4f}'}</td></tr></table>
<p id="steady">{html.escape(_steady(run))}. The warm-up's cost: {c.WARMUP_IDLE_GPU_SECONDS.name} (the GPU idle in
the stalls above, up to the window that recognised steady) and {c.WARMUP_HUB_BYTES.name}{summed}.</p>
<p id="forecast">{html.escape(_forecast(run))}</p>"""


def _forecast(run: Run) -> str:
    """What the correlator's forecast said while the job was cold: a third of the way in when it got steady, its
    latest word when it did not."""
    told, name = run.forecast_time_to_steady, c.WARMUP_FORECAST_TIME_TO_STEADY.name
    known = ~np.isnan(told.v)
    if not known.any():
        return (f"No forecast of the time to steady ({name}): none was published in the run (a job that reads each "
                "item once per pass shows no reuse until its second pass; --correlator.dataset-size gives it the size "
                "to forecast from).")
    times, values = told.t[known], told.v[known]
    if run.time_to_steady_seconds is not None and run.job_started is not None:
        if run.time_to_steady_seconds <= 0:
            return f"The job was steady from its start: there was no warm-up to forecast ({name})."
        third = run.time_to_steady_seconds / 3
        at = np.flatnonzero(times >= run.job_started + third)
        if not at.size:
            return f"The forecast ({name}) was published only in the first third of the warm-up."
        said = values[at[0]]
        if math.isinf(said):
            return f"A third of the way in ({third:,.1f} s), the forecast ({name}) said never steady; it was."
        error = (said - run.time_to_steady_seconds) / run.time_to_steady_seconds
        return (f"A third of the way in ({third:,.1f} s), the forecast ({name}) said steady {said:,.1f} s after the "
                f"job's start: {error:+.0%} of the time it took.")
    if math.isinf(values[-1]):
        since = times[np.flatnonzero(~np.isinf(values))[-1] + 1] if np.isfinite(values).any() else times[0]
        return (f"The forecast ({name}) says never steady, since {_clock(since)} UTC: the job has fetched more than "
                "its spoke holds and still misses (a working set larger than the spoke, or nothing read twice).")
    return f"The forecast ({name}) says steady {values[-1]:,.1f} s after the job's start."



def _dollars(value: float | None) -> str:
    return "n/a" if value is None else f"${value:,.4f}"


def _prices(prices: Prices) -> str:
    def dated(read_on: str) -> str:
        return read_on if read_on == SET_BY_FLAG else f"list price read {read_on}"

    unnamed = ", as no GPU type was known here: --prices.gpu-type names it" if prices.by_gpu_name else ""
    return (f"a GPU-hour at ${prices.gpu_dollars_per_hour:,.4g} ({html.escape(prices.gpu_type)}{unnamed}, "
            f"{dated(prices.gpu_read_on)}), a GB from the hub at ${prices.egress_dollars_per_gb:,.4g} "
            f"({html.escape(prices.region_pair)}, {dated(prices.egress_read_on)}); --prices.* to change them, "
            "docs/cost.md for the table")


def _cost(run: Run, prices: Prices) -> str:
    """The run's GPU idle in stalls and hub bytes, priced."""
    gpu = _gpu_unknown(run)
    idle = sum(run.gpu_stall_idle_seconds.values())
    of = f"job {html.escape(run.job)}" if run.job else "the run's jobs together"
    hub = (_gb(run.hub_bytes) if run.spoke_reads else "none: no read crossed a spoke")
    rows = (f'<tr><td style="text-align:left">GPU idle in stalls</td><td>{"&ndash;" if gpu else f"{idle:,.1f} s"}</td>'
            f'<td class="k" id="cost-gpu">{_dollars(None if gpu else prices.gpu_cost(idle))}</td></tr>'
            f'<tr><td style="text-align:left">bytes from the hub</td><td>{hub}</td>'
            f'<td class="k" id="cost-egress">{_dollars(prices.egress_cost(run.hub_bytes))}</td></tr>')
    return (f"<h2>What it cost</h2><p>Of {of}, over the run: {c.GPU_STALL_IDLE_SECONDS.name} at the GPU-second "
            f"price ({c.STALL_GPU_COST.name} live), and the bytes of its reads that missed the spoke at the hub's "
            f"({c.EGRESS_COST.name} live){f'; GPU idle {html.escape(gpu)}' if gpu else ''}.</p>"
            f'<table id="cost"><tr><th>what</th><th>amount</th><th>$</th></tr>{rows}</table>'
            f'<p id="prices">Prices: {_prices(prices)}.</p>')


def _sizing(run: Run, prices: Prices, target: float) -> tuple[str, str]:
    """Which capacity is enough (empty when none can be estimated), and the what-if's rows with each capacity's
    stalls and dollars per epoch or hour."""
    rows = sizing(run, prices, _gpu_unknown(run) is None)
    cells = {row.factor: (f"<td>{row.stall_seconds:,.1f} s</td><td>{_fmt(_percent(row.input_bound_ratio), ' %')}</td>"
                          f"<td>{_dollars(row.gpu_dollars)}</td><td>{_dollars(row.egress_dollars)}</td>")
             for row in rows}
    rows_html = "".join(f"<tr><td>{html.escape(k)}&times;</td><td>{v * 100:.1f} %</td>"
                        f'{cells.get(k, "<td colspan=4>&ndash;</td>")}</tr>'
                        for k, v in sorted(run.whatif.items(), key=lambda kv: float(kv[0])))
    if not rows:
        return "", rows_html
    enough = smallest_under(rows, target)
    said = (f"{enough.factor}&times; the spoke's capacity now" if enough is not None else
            f"none of these capacities: even at {rows[-1].factor}&times; the job stays "
            f"{_fmt(_percent(rows[-1].input_bound_ratio), ' %')} input-bound")
    return (f'<p id="sizing">The smallest spoke that keeps the job under {target * 100:.0f} % input-bound '
            f"(--input-bound-target): {said}.</p>", rows_html)


def _percent(ratio: float | None) -> float | None:
    return None if ratio is None else ratio * 100


def _whatif(run: Run, prices: Prices, target: float) -> str:
    sized, rows = _sizing(run, prices, target)
    why = None
    if not run.spoke_reads:  # its curve replays only reads that crossed a spoke: none, no spoke to size
        why = "no read crossed a spoke"
    elif run.whatif_keys is None:
        why = "the correlator's what-if saw no read"
    elif not rows:
        why = (f"the correlator was not given the spoke's capacity (--correlator.cache-capacity); its curve "
               f"tracks {run.whatif_keys:,.0f} keys")
    elif hit_ratio_now(run) is None:
        why = "the what-if has no estimate at the spoke's own capacity (factor 1) to scale from"
    if why is not None:
        rows = f'<tr><td colspan=6 id="whatif-none">no estimate: {html.escape(why)}</td></tr>'
        sized = ""
    combined = " (each node's estimate weighted by the reads it replayed)" if run.nodes > 1 and run.whatif else ""
    per, seconds = period(run)
    counted = (f"per epoch ({run.epoch_steps:,} steps, as the job's loaders report: {seconds:,.1f} s at the run's "
               f"pace, {c.EPOCH_STEPS.name})" if per == "epoch" else
               "per hour of the run (its trainers reported no epoch length)")
    return (f"<h2>What a different spoke would buy</h2><p>{c.CACHE_WHATIF_HIT_RATIO.name}{combined}; {counted}, the "
            "remote_fetch stalls, their GPU idle and the hub bytes scaled by the miss ratio against the spoke's now, "
            "the other causes as they were (docs/cost.md).</p>"
            f"{sized}"
            f'<table id="whatif"><tr><th>capacity</th><th>estimated hit ratio</th><th>stall seconds per {per}</th>'
            f"<th>input-bound</th><th>GPU idle in stalls, $ per {per}</th><th>hub bytes, $ per {per}</th></tr>"
            f"{rows}</table>")


def _figures(run: Run) -> list[tuple[str, str, str]]:
    """(title, what it is, a PNG or, where the run cannot know, why) per timeline."""
    what = WHAT[run.source]
    no_spoke = "no read crossed a spoke in this run: no hit ratio, no hub bytes"
    no_gpu = _gpu_unknown(run)
    if no_gpu is None and run.gpu_utilization is not None:
        gpu = ("GPU utilization", what["gpu"], _timeline(run, run.gpu_utilization, "GPU utilization (%)", 100))
    else:
        gpu = ("GPU utilization", no_gpu or "not in the window file (it holds the GPU idle in stalls, above): "
               "read the run with --prometheus", "")
    ranks = f"stall-seconds per second per rank, averaged over the {run.ranks} rank{'s' if run.ranks != 1 else ''}"
    return [
        gpu,
        ("Step throughput", what["steps"], _timeline(run, run.steps_per_second, "steps/s")),
        ("Spoke hit ratio", what["hit"] if run.spoke_reads else no_spoke,
         _timeline(run, run.hit_ratio, "hit ratio (%)", 100) if run.spoke_reads else ""),
        ("Hub throughput (cross-region)", what["hub"] if run.spoke_reads else no_spoke,
         _timeline(run, run.hub_bytes_per_second, "hub (MB/s)", 1e-6) if run.spoke_reads else ""),
        ("Stall seconds by cause", f"{c.STALL_SECONDS.name}: {ranks}", _stalls(run)),
    ]


def render_html(run: Run, prices: Prices | None = None, input_bound_target: float = INPUT_BOUND_TARGET,
                dataset_bytes: float | None = None) -> str:
    """The report's page. `dataset_bytes` (--dataset-size) wins over the size the agents were given."""
    prices = prices or Prices()
    if len(run.gpu_types) == 1:  # under `auto`, the type the agents priced the GPUs at
        prices = prices.for_gpu(run.gpu_types[0])
    dataset_bytes = run.dataset_bytes if dataset_bytes is None else dataset_bytes
    legend = " ".join(f'<span style="background:{colour}33;padding:2px 6px">{phase}</span>'
                      for phase, colour in PHASE_COLOURS.items())
    blocks = "".join(
        f"<h2>{html.escape(title)}</h2><p class='what'>{html.escape(what)}</p>"
        + (f'<img alt="{html.escape(title)}" src="data:image/png;base64,{png}">' if png else "")
        for title, what, png in _figures(run))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>stallwatch warm-up report</title>
<style>body{{font-family:sans-serif;max-width:1040px;margin:2em auto;color:#222}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}
img{{width:100%}}.k{{font-size:1.6em;font-weight:bold}}.what{{color:#555;font-size:0.9em}}</style></head>
<body>
<h1>stallwatch warm-up report</h1>
<p id="run">{_header(run)}</p>
{_headline(run)}
{_stage_or_stream(run, prices, dataset_bytes)}
{_warmup(run, prices)}
{_cost(run, prices)}
<p>Shading: {legend}, each phase from the window that recognised it; dashed line: the time to steady.</p>
{blocks}
{_whatif(run, prices, input_bound_target)}
</body></html>
"""
