"""A run read from a Prometheus server: each figure from the series the correlator and the agent publish.

The correlator publishes a job's series with the end of its latest window as their timestamp, so a counter's
value at a time is its total up to the last window that ended by then: the increase between two points of
the report's grid is what the windows between them booked, and the report draws it there, over that span,
as the window file draws each window over its own. Where a metric's timestamps did not move, no window was
published: nothing is known, and nothing is drawn.

A multi-node job is combined as its nodes' figures add up: seconds and bytes summed, the job steady once
its last node is (its time to steady the latest node's, each from the job's first window), and the
what-if's hit ratios averaged over the nodes weighted by the reads each node's curve replayed.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

import numpy as np

from stallwatch import catalogue as c
from stallwatch.mixin.promql import by
from stallwatch.report.api import PLAIN, Access, Labels, Prometheus
from stallwatch.report.run import FloatArray, Run, Series
from stallwatch.report.scope import EVERYTHING, Scope

NODE = "instance"  # what keeps nodes apart: every scrape sets it, whatever the relabelling
Spans = list[tuple[float, float, str]]


def range_step(start: float, end: float) -> float:
    """Seconds between the points of the report's range queries: 400 points at most, 1 s apart at least."""
    return max(1.0, (end - start) / 400)


def phase_spans(phases: list[tuple[Labels, Series]], stamps: Series) -> Spans:
    """Spans of one node's phases of the job from its phase gauges (`max by (phase)`) and, on the same grid, the
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
    spans: Spans = []
    for end in ends:
        if spans and spans[-1][2] == windows[end]:
            spans[-1] = (spans[-1][0], end, windows[end])
        else:
            spans.append((previous, end, windows[end]))
        previous = end
    return spans


def least_advanced(per_node: Iterable[Spans]) -> Spans:
    """A job's phases from its nodes': at each instant the least advanced phase of the nodes it ran on there
    (a job is steady once every node is)."""
    nodes = [spans for spans in per_node if spans]
    if len(nodes) == 1:
        return nodes[0]
    edges = sorted({t for spans in nodes for start, end, _ in spans for t in (start, end)})
    out: Spans = []
    for start, end in pairwise(edges):
        here = [c.PHASES.index(p) for spans in nodes for s, e, p in spans if s <= start and end <= e]
        if not here:
            continue
        phase = c.PHASES[min(here)]
        if out and out[-1][2] == phase and out[-1][1] == start:
            out[-1] = (out[-1][0], end, phase)
        else:
            out.append((start, end, phase))
    return out


def gpu_utilization_query(scope: Scope, window: float, run_seconds: float) -> str:
    """Mean utilization of the scope's GPUs; for a job, the GPUs the correlator saw its ranks on during the run
    (its GPU map, as the dashboards join it), looked up once over the whole run (`@ end()`)."""
    per_gpu = f"avg_over_time({scope.select(c.GPU_UTILIZATION)}[{window:.0f}s])"
    if scope.job is not None:
        seen = f"last_over_time({scope.select(c.GPU_STALL_IDLE_SECONDS)}[{run_seconds + window:.0f}s] @ end())"
        per_gpu = f"{per_gpu} and on (instance, gpu) {by('instance, gpu', 'group', seen)}"
    return by("", "avg", per_gpu)


class _Reader:
    """The report's queries over one span, on one grid: points `grid`, spans between consecutive points."""

    def __init__(self, prometheus: Prometheus, start: float, end: float) -> None:
        self.prometheus = prometheus
        self.start, self.end = start, end
        self.step = range_step(start, end)
        self.grid = np.arange(start, end + self.step / 2, self.step)
        self.span = f"{end - start + self.step:.0f}s"

    def series(self, values: FloatArray, known: FloatArray) -> Series:
        return Series(self.grid[:-1], np.where(known, values, np.nan), self.grid[1:])

    def increments(self, selector: str, group: str) -> tuple[dict[str, FloatArray], FloatArray]:
        """Per value of `group`, the counter's increase over each span of the grid, summed over its series;
        and which spans saw a new sample of any of them. A series that appears during the run starts from
        zero there (its first value is the first windows' own: the warm-up this report is about); a reset
        counts from zero."""
        totals: dict[str, FloatArray] = {}
        for labels, series in self.prometheus.range(selector, self.start, self.end, self.step):
            values = np.full(self.grid.size, np.nan)
            values[np.clip(np.searchsorted(self.grid, series.t - self.step / 2), 0, self.grid.size - 1)] = series.v
            before = np.concatenate(([np.nan], values[:-1]))
            born = np.isnan(before) & ~np.isnan(values) & (np.arange(self.grid.size) > 0)
            grew = np.where(values < before, values, values - before)  # a reset: it restarted from zero
            step_increase = np.where(born, values, np.nan_to_num(grew))[1:]
            key = labels.get(group, "") if group else ""
            totals[key] = totals.get(key, np.zeros(self.grid.size - 1)) + step_increase
        stamps = self.prometheus.range(by("", "max", f"timestamp({selector})"), self.start, self.end, self.step)
        known = np.zeros(self.grid.size - 1, dtype=bool)
        if stamps:
            at = np.full(self.grid.size, np.nan)
            at[np.clip(np.searchsorted(self.grid, stamps[0][1].t - self.step / 2), 0, self.grid.size - 1)] = \
                stamps[0][1].v
            known = ~np.isnan(at[1:]) & ~(at[1:] <= at[:-1])
        return totals, known

    def per_node(self, expr: str, agg: str = "max", also: str = "") -> dict[str, float]:
        """The latest value over the run of `expr`'s series, per node (and `also`)."""
        labels = ", ".join(filter(None, [NODE, also]))
        answer = self.prometheus.instant(by(labels, agg, f"last_over_time({expr}[{self.span}])"), self.end)
        return {"/".join(item.get(k, "") for k in labels.split(", ")): value for item, value in answer}


def run_from_prometheus(url: str, start: float, end: float, scope: Scope = EVERYTHING,
                        access: Access = PLAIN) -> Run:
    read = _Reader(Prometheus(url, access), start, end)
    run = Run(start, end, "prometheus", job=scope.job, node=scope.node)
    stalls, known = read.increments(scope.select(c.STALL_SECONDS), "cause")
    ranks = read.prometheus.instant(by("", "count", by(f"{NODE}, {c.JOB_LABEL}, rank", "group",
                                                      f"last_over_time({scope.select(c.STALL_SECONDS)}[{read.span}])")),
                                    end)
    run.ranks = int(ranks[0][1]) if ranks else 0
    for cause in c.CAUSES:
        stalled = stalls.get(cause, np.zeros(read.grid.size - 1))
        run.stall_seconds[cause] = float(stalled.sum())
        run.stall_by_cause[cause] = read.series(stalled / read.step / max(run.ranks, 1), known)
    compute, _ = read.increments(scope.select(c.COMPUTE_SECONDS), "")
    run.compute_seconds = float(sum(v.sum() for v in compute.values()))
    idle, idled = read.increments(scope.select(c.GPU_STALL_IDLE_SECONDS), "cause")
    run.gpu_stall_idle_seconds.update({cause: float(v.sum()) for cause, v in idle.items()})
    if c.REMOTE_FETCH.name in idle:
        run.remote_fetch_gpu_idle = read.series(idle[c.REMOTE_FETCH.name] / read.step, idled)
    steps, stepped = read.increments(scope.select(c.STEP_COMPUTE, suffix="_count"), "")
    if steps:
        run.steps_per_second = read.series(np.sum(list(steps.values()), axis=0) / read.step, stepped)
    failed, _ = read.increments(scope.select(c.DATASET_FAILED_READS), "")
    if failed:  # the agents count them from their first read of a job
        run.failed_reads = float(sum(v.sum() for v in failed.values()))
    _gpus(read, scope, run)
    _spoke(read, scope, run)
    _warmup(read, scope, run)
    _whatif(read, scope, run)
    return run


def _gpus(read: _Reader, scope: Scope, run: Run) -> None:
    """The scope's GPUs: how many its nodes have (a job's: the nodes its ranks ran on), how many the correlator saw
    its jobs on, and their utilization."""
    counts = read.per_node(scope.select(c.GPU_DEVICES))
    if scope.job is not None:  # GPUs are the node's: a job's nodes are those with its stalls counted
        ran_on = read.per_node(scope.select(c.STALL_SECONDS))
        counts = {node: count for node, count in counts.items() if node in ran_on}
    run.gpu_devices = int(sum(counts.values())) if counts else None
    # The correlator's GPU map: a GPU idle-seconds series per GPU it saw a job's ranks on.
    run.job_gpus = len(read.per_node(scope.select(c.GPU_STALL_IDLE_SECONDS), also="gpu")) or None
    priced = read.per_node(scope.select(c.GPU_PRICE), also="gpu_type")
    if scope.job is not None:  # as the GPUs: the job's nodes'
        priced = {key: price for key, price in priced.items() if key.rsplit("/", 1)[0] in ran_on}
    run.gpu_types = tuple(sorted({key.rsplit("/", 1)[1] for key in priced}))
    run.dataset_bytes = max(read.per_node(scope.select(c.DATASET_SIZE)).values(), default=None)
    if run.gpu_devices != 0:
        answer = read.prometheus.range(gpu_utilization_query(scope, read.step, read.end - read.start),
                                       read.start + read.step, read.end, read.step)
        points = answer[0][1] if answer else Series.empty()
        run.gpu_utilization = Series(points.t - read.step, points.v, points.t)


def _spoke(read: _Reader, scope: Scope, run: Run) -> None:
    by_result, served = read.increments(scope.select(c.SPOKE_REQUESTS), "result")
    if not by_result:
        return
    requests = np.sum(list(by_result.values()), axis=0)
    run.spoke_reads = float(requests.sum())
    hits = by_result.get("hit", np.zeros_like(requests))
    run.hit_ratio = read.series(np.divide(hits, requests, out=np.zeros_like(requests), where=requests > 0),
                                served & (requests > 0))
    hub, fetched = read.increments(scope.select(c.SPOKE_BYTES), "source")
    run.hub_bytes_per_second = read.series(hub.get("hub", np.zeros_like(requests)) / read.step, fetched)


def _warmup(read: _Reader, scope: Scope, run: Run) -> None:
    """The job's phases and warm-up figures, combined over its nodes; over several jobs, only their names."""
    phase = scope.select(c.WARMUP_PHASE)
    if scope.job is None:  # over several jobs, their phases are each job's: which jobs are there?
        jobs = sorted({key.rsplit("/", 1)[1] for key in read.per_node(phase, "group", c.JOB_LABEL)})
        run.several_jobs = tuple(jobs) if len(jobs) > 1 else ()
        if run.several_jobs:
            return
    gauges = read.prometheus.range(by(f"{NODE}, phase", "max", phase), read.start, read.end, read.step)
    stamps = read.prometheus.range(by(NODE, "max", f"timestamp({phase})"), read.start, read.end, read.step)
    names = {labels.get(NODE, ""): labels.get("node", labels.get(NODE, "")) for labels, _ in stamps}
    per_node = {node: phase_spans([(labels, series) for labels, series in gauges if labels.get(NODE) == node], stamp)
                for node, stamp in ((labels.get(NODE, ""), series) for labels, series in stamps)}
    run.phases = least_advanced(per_node.values())
    run.nodes = max(len(per_node), 1)
    if run.phases and all(stamp.t[0] > read.start for _, stamp in stamps):  # the job began within the run
        run.job_started = run.phases[0][0]
    steady = read.per_node(scope.select(c.WARMUP_TIME_TO_STEADY))
    started = {node: spans[0][0] for node, spans in per_node.items() if spans}
    run.not_steady = tuple(sorted(names[node] for node in per_node if node not in steady))
    if steady and not run.not_steady:
        # Each node counts from its own first window: the job's is its earliest node's.
        first = min(started.values(), default=0.0)
        run.time_to_steady_seconds = max(t + started.get(node, first) - first for node, t in steady.items())
    idle = read.per_node(scope.select(c.WARMUP_IDLE_GPU_SECONDS))
    hub = read.per_node(scope.select(c.WARMUP_HUB_BYTES))
    run.warmup_idle_gpu_seconds = sum(idle.values()) if idle else None
    run.warmup_hub_bytes = sum(hub.values()) if hub else None
    epoch = read.per_node(scope.select(c.EPOCH_STEPS))
    run.epoch_steps = int(max(epoch.values())) if epoch else None
    # The last node to be steady sets the job's time: so does its forecast.
    told = read.prometheus.range(by("", "max", scope.select(c.WARMUP_FORECAST_TIME_TO_STEADY)), read.start, read.end,
                                 read.step)
    if told:
        run.forecast_time_to_steady = told[0][1]


def _whatif(read: _Reader, scope: Scope, run: Run) -> None:
    """Each node's curve replays that node's reads: the job's hit ratio at a capacity is the nodes' estimates
    weighted by those reads (`dataset_reads_total`, all of the node's jobs, as the curve has them)."""
    node_only = Scope(node=scope.node)
    estimates = read.per_node(node_only.select(c.CACHE_WHATIF_HIT_RATIO), also="capacity_factor")
    reads = read.per_node(node_only.select(c.DATASET_READS), agg="sum")
    keys = read.per_node(node_only.select(c.CACHE_WHATIF_KEYS))
    run.whatif_keys = sum(keys.values()) if keys else None
    factors = sorted({key.rsplit("/", 1)[1] for key in estimates}, key=float)
    for factor in factors:
        weighted = [(value, reads.get(key.rsplit("/", 1)[0], 0.0)) for key, value in estimates.items()
                    if key.endswith("/" + factor)]
        weight = sum(w for _, w in weighted)
        if len(weighted) == 1 or weight > 0:  # one node's estimate needs no weight
            run.whatif[factor] = weighted[0][0] if len(weighted) == 1 else sum(v * w for v, w in weighted) / weight
