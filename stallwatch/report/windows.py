"""A run read from the correlator's recorded windows (`--correlator.record-windows FILE`, JSON lines).

A window file is one node's record and does not name its node, so it takes a job filter only.

The file is read a line at a time and each line folded into its window's sums at once, so memory grows
with the windows of the run (a few hundred bytes each: an hour of 0.5 s windows is ~2 MB), not with the
file; a line longer than `MAX_LINE_BYTES` (far above a node's 64 jobs of 64 ranks) is refused before
it is held. Every value is checked as it is read: a file that is not what the agent writes gets one line
naming the file, the line and what is wrong.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from stallwatch import catalogue as c
from stallwatch.report.run import FloatArray, Run, Series

WINDOW_KEYS = {"start_s", "end_s", "ranks", "gpus", "jobs", "whatif_hit_ratio"}
MAX_LINE_BYTES = 4 << 20
MAX_NAMES = 100_000  # distinct jobs, or (job, rank) pairs, a file may name
SUMS = ("steps", "compute_s", "reads", "hits", "hub_bytes", "failed_reads", *(f"stall_{k}" for k in c.CAUSES),
        *(f"idle_{k}" for k in c.CAUSES))


class WindowFileError(ValueError):
    """The window file cannot be read as one: the message is the one line to print."""


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        file: BinaryIO = path.open("rb")
    except OSError as error:
        raise WindowFileError(f"cannot read {path}: {error.strerror}") from None
    with file:
        for number in range(1, 2**63):
            try:
                line = file.readline(MAX_LINE_BYTES + 1)
            except OSError as error:
                raise WindowFileError(f"cannot read {path}: {error.strerror}") from None
            if not line:
                return
            if len(line) > MAX_LINE_BYTES:
                raise WindowFileError(f"{path}:{number}: not a window row (longer than {MAX_LINE_BYTES >> 20} MiB)")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise WindowFileError(f"{path}:{number}: not a window row (not JSON)") from None
            if not isinstance(row, dict) or not row.keys() >= WINDOW_KEYS:
                raise WindowFileError(f"{path}:{number}: not a window row (a row has "
                                      f"{', '.join(sorted(WINDOW_KEYS))})")
            yield number, row


def _number(value: Any, what: str, *, at_most: float = math.inf, none: bool = False) -> float:
    """A finite number from 0 to `at_most` (None where `none` allows it, as 0)."""
    if value is None and none:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= at_most:
        raise ValueError(f"{what} is {json.dumps(value)[:40]}, not a number from 0 to {at_most:g}")
    return float(value)


def _items(row: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = row[key]
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ValueError(f"{key} is not a list of rows")
    return items


def _name(item: dict[str, Any], key: str) -> str:
    name = item.get("job")
    if not isinstance(name, str):
        raise ValueError(f"a row of {key} has no job name")
    return name


def _by_cause(item: dict[str, Any], key: str) -> list[float]:
    seconds = item.get(key)
    if not isinstance(seconds, dict):
        raise ValueError(f"{key} is not an object of seconds by cause")
    return [_number(seconds.get(cause, 0.0), f"{key}.{cause}") for cause in c.CAUSES]


@dataclass
class _Windows:
    """Each window's sums of the run's job(s), in the order first seen; merged by start (a job held for a
    stall is published in a line of its own, the same `start_s` as its window's first line)."""

    job: str | None
    since: float | None  # the run's span: the per-run figures below are of the windows that overlap it
    until: float | None
    at: dict[float, int] = field(default_factory=dict)
    starts: array[float] = field(default_factory=lambda: array("d"))
    ends: array[float] = field(default_factory=lambda: array("d"))
    active: array[float] = field(default_factory=lambda: array("d"))  # rows of the run's jobs in the window
    sums: dict[str, array[float]] = field(default_factory=lambda: {key: array("d") for key in SUMS})
    # Per job of the run: the windows it has a row in and its phase there (an index into PHASES), and its
    # warm-up figures as the latest window of the span that gave them published them (start, figures).
    phases: dict[str, tuple[array[int], array[int]]] = field(default_factory=dict)
    steady: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)
    forecasts: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # job -> (window end, forecast)
    epoch_steps: dict[str, int] = field(default_factory=dict)  # job -> its epoch's steps, as last reported
    jobs: set[str] = field(default_factory=set)  # every job named, in or out of the run
    ranks: set[tuple[str, int]] = field(default_factory=set)  # of the run's windows
    gpus: set[tuple[str, int]] = field(default_factory=set)  # (job, GPU) pairs of the run's windows
    job_started: float | None = None  # the first window of the run's job(s), in the span or not
    gpu_devices: int | None = None
    failures_counted: bool = False  # a job row said its failed reads (the agents before it did not write them)
    whatif: tuple[float, dict[str, float]] | None = None  # (window start, curve) of the latest window with one
    whatif_keys: tuple[float, float] | None = None

    def ours(self, name: str) -> bool:
        return self.job is None or name == self.job

    def add(self, row: dict[str, Any]) -> None:
        start, end = (_number(row[key], key, at_most=2**40) for key in ("start_s", "end_s"))
        if end <= start:
            raise ValueError(f"end_s {end} is not after start_s {start}")
        ranks, gpus, jobs = _items(row, "ranks"), _items(row, "gpus"), _items(row, "jobs")
        index = self._window(round(start, 3), start, end)
        spanned = (self.since is None or end > self.since) and (self.until is None or start < self.until)
        sums = {key: 0.0 for key in SUMS}
        active = 0
        for item in ranks:
            name = _name(item, "ranks")
            self._named(name)
            if not self.ours(name):
                continue
            rank = int(_number(item.get("rank"), "rank", at_most=2**31))
            if spanned and (name, rank) not in self.ranks:
                if len(self.ranks) >= MAX_NAMES:
                    raise ValueError(f"more than {MAX_NAMES:,} ranks")
                self.ranks.add((name, rank))
            active += 1
            sums["steps"] += _number(item.get("steps"), "steps", at_most=2**53)
            sums["compute_s"] += _number(item.get("compute_s"), "compute_s", at_most=2**40)
            for cause, seconds in zip(c.CAUSES, _by_cause(item, "stall_s"), strict=True):
                sums[f"stall_{cause}"] += seconds
        for item in gpus:
            name = _name(item, "gpus")
            if self.ours(name):
                gpu = int(_number(item.get("gpu"), "gpu", at_most=2**31))
                if spanned and (name, gpu) not in self.gpus:
                    if len(self.gpus) >= MAX_NAMES:
                        raise ValueError(f"more than {MAX_NAMES:,} GPUs")
                    self.gpus.add((name, gpu))
                for cause, seconds in zip(c.CAUSES, _by_cause(item, "idle_s"), strict=True):
                    sums[f"idle_{cause}"] += seconds
        for item in jobs:
            name = _name(item, "jobs")
            self._named(name)
            if not self.ours(name):
                continue
            active += 1
            reads = _number(item.get("reads"), "reads", at_most=2**53)  # those that crossed a spoke
            sums["reads"] += reads
            sums["hits"] += reads * _number(item.get("hit_ratio"), "hit_ratio", at_most=1, none=True)
            sums["hub_bytes"] += _number(item.get("hub_bytes"), "hub_bytes", at_most=2**63)
            if "failed_reads" in item:
                sums["failed_reads"] += _number(item["failed_reads"], "failed_reads", at_most=2**53)
                self.failures_counted = True
            self._phase(index, name, item, start if spanned else None, end if spanned else None)
            self.job_started = start if self.job_started is None else min(self.job_started, start)
        for key, value in sums.items():
            self.sums[key][index] += value
        self.active[index] += active
        if "gpu_devices" in row:
            devices = int(_number(row["gpu_devices"], "gpu_devices", at_most=2**16))
            if spanned:
                self.gpu_devices = max(devices, self.gpu_devices or 0)
        self._whatif(start, row, spanned)

    def _window(self, key: float, start: float, end: float) -> int:
        index = self.at.get(key)
        if index is None:
            index = self.at[key] = len(self.starts)
            self.starts.append(start)
            self.ends.append(end)
            self.active.append(0.0)
            for column in self.sums.values():
                column.append(0.0)
        return index

    def _named(self, name: str) -> None:
        if name not in self.jobs:
            if len(self.jobs) >= MAX_NAMES:
                raise ValueError(f"more than {MAX_NAMES:,} jobs")
            self.jobs.add(name)

    def _phase(self, index: int, name: str, item: dict[str, Any], spanned_start: float | None,
               spanned_end: float | None) -> None:
        phase = item.get("phase")
        if phase not in c.PHASES:
            raise ValueError(f"phase is {json.dumps(phase)[:40]}, not one of {', '.join(c.PHASES)}")
        windows, phases = self.phases.setdefault(name, (array("q"), array("b")))
        windows.append(index)
        phases.append(c.PHASES.index(phase))
        epoch = item.get("epoch_steps")
        if epoch is not None and spanned_end is not None:
            self.epoch_steps[name] = int(_number(epoch, "epoch_steps", at_most=2**40))
        forecast = item.get("forecast_time_to_steady_s")
        if forecast is not None and spanned_end is not None:
            told = math.inf if forecast == "never" else _number(forecast, "forecast_time_to_steady_s", at_most=2**40)
            self.forecasts.setdefault(name, []).append((spanned_end, told))
        steady = item.get("time_to_steady_s")
        idle = _number(item.get("warmup_idle_gpu_s"), "warmup_idle_gpu_s", none=True)
        hub = _number(item.get("warmup_hub_bytes"), "warmup_hub_bytes", none=True)
        if steady is not None:
            figures = (_number(steady, "time_to_steady_s", at_most=2**40), idle, hub)
            had = self.steady.get(name)
            if spanned_start is not None and (had is None or spanned_start >= had[0]):
                self.steady[name] = (spanned_start, *figures)

    def _whatif(self, start: float, row: dict[str, Any], spanned: bool) -> None:
        curve, keys = row["whatif_hit_ratio"], row.get("whatif_keys")
        if curve is not None and not isinstance(curve, dict):
            raise ValueError("whatif_hit_ratio is not an object of hit ratios by capacity")
        ratios = {str(k): _number(v, f"whatif_hit_ratio[{k}]", at_most=1) for k, v in (curve or {}).items()}
        tracked = _number(keys, "whatif_keys", none=True)
        if spanned and ratios and (self.whatif is None or start >= self.whatif[0]):
            self.whatif = (start, ratios)
        if spanned and tracked and (self.whatif_keys is None or start >= self.whatif_keys[0]):
            self.whatif_keys = (start, tracked)


def _read(path: Path, job: str | None, since: float | None, until: float | None) -> _Windows:
    windows = _Windows(job, since, until)
    for number, row in _lines(path):
        try:
            windows.add(row)
        except ValueError as error:
            raise WindowFileError(f"{path}:{number}: not a window row ({error})") from None
    return windows


def run_from_windows(path: Path, job: str | None = None, start: float | None = None,
                     end: float | None = None) -> Run:
    """A run from `--correlator.record-windows` lines (times in unix seconds): the job's rows only if given,
    the windows that overlap [start, end] if given. Each figure is the sum of the windows' rows of the metric
    it is published as; a window holds its values over its own span, and where no window holds a rank of the
    run (between jobs, before and after), nothing is drawn."""
    windows = _read(path, job, start, end)
    if not windows.starts:
        raise WindowFileError(f"{path}: no windows recorded")
    starts, ends = np.frombuffer(windows.starts), np.frombuffer(windows.ends)
    order = np.argsort(starts, kind="stable")
    kept = order[((start is None) | (ends[order] > (start or 0))) & ((end is None) | (starts[order] < (end or 0)))]
    if not kept.size:
        raise WindowFileError(f"{path}: no window between --start and --end (the file covers "
                              f"{starts.min():.0f} to {ends.max():.0f} s)")
    jobs = sorted(name for name, (indices, _) in windows.phases.items() if np.isin(indices, kept).any())
    if job is not None and job not in jobs:
        named = sorted(windows.jobs)
        raise WindowFileError(f"{path}: no windows of job {job!r} (jobs: {', '.join(named[:20]) or 'none'}"
                              f"{', ...' if len(named) > 20 else ''})")

    def total(key: str) -> FloatArray:
        return np.frombuffer(windows.sums[key])[kept]

    run = Run(start=float(starts[kept[0]]), end=float(ends[kept[-1]]), job=job)
    starts, ends = starts[kept], ends[kept]
    length = ends - starts
    # A window with no row of the run's jobs tells nothing about them (as a job's series stop in Prometheus).
    active = np.frombuffer(windows.active)[kept] > 0

    def series(values: FloatArray, known: Any = active) -> Series:
        return Series(starts, np.where(known, values, np.nan), ends)

    run.ranks = len(windows.ranks)
    run.compute_seconds = float(total("compute_s").sum())
    run.steps_per_second = series(total("steps") / length)
    for cause in c.CAUSES:
        stalled = total(f"stall_{cause}")
        run.stall_seconds[cause] = float(stalled.sum())
        run.stall_by_cause[cause] = series(stalled / length / max(run.ranks, 1))
        run.gpu_stall_idle_seconds[cause] = float(total(f"idle_{cause}").sum())
    run.remote_fetch_gpu_idle = series(total(f"idle_{c.REMOTE_FETCH.name}") / length)
    run.gpu_devices = windows.gpu_devices
    run.job_gpus = len(windows.gpus) or None
    reads, hits = total("reads"), total("hits")
    run.spoke_reads = float(reads.sum())
    run.hit_ratio = series(np.divide(hits, reads, out=np.zeros_like(hits), where=reads > 0), reads > 0)
    run.hub_bytes_per_second = series(total("hub_bytes") / length)
    run.failed_reads = float(total("failed_reads").sum()) if windows.failures_counted else None
    if job is None and len(jobs) > 1:
        run.several_jobs = tuple(jobs)  # one job's phases after another's would read as one run's
    elif jobs:
        _warmup(run, windows, order, kept, jobs[0])
        run.job_started = windows.job_started
    if windows.whatif is not None:
        run.whatif = windows.whatif[1]
    if windows.whatif_keys is not None:
        run.whatif_keys = windows.whatif_keys[1]
    return run


def _warmup(run: Run, windows: _Windows, order: np.ndarray, kept: np.ndarray, name: str) -> None:
    """The job's phases, each from the window that recognised it, and its warm-up figures as last published."""
    indices, codes = windows.phases[name]
    place = np.empty(order.size, dtype=np.int64)
    place[order] = np.arange(order.size)  # each window's place in time order
    at = place[np.frombuffer(indices, dtype=np.int64)]
    spanned = np.isin(np.frombuffer(indices, dtype=np.int64), kept)
    by_time = np.argsort(at[spanned], kind="stable")  # a window's lines in the order they were written
    starts, ends = np.frombuffer(windows.starts), np.frombuffer(windows.ends)
    for index, code in zip(np.frombuffer(indices, dtype=np.int64)[spanned][by_time],
                           np.frombuffer(codes, dtype=np.int8)[spanned][by_time], strict=True):
        phase = c.PHASES[code]
        if run.phases and run.phases[-1][2] == phase:
            run.phases[-1] = (run.phases[-1][0], float(ends[index]), phase)
        else:
            run.phases.append((float(starts[index]), float(ends[index]), phase))
    if name in windows.steady:
        _, run.time_to_steady_seconds, run.warmup_idle_gpu_seconds, run.warmup_hub_bytes = windows.steady[name]
    run.epoch_steps = windows.epoch_steps.get(name)
    if told := sorted(windows.forecasts.get(name, [])):
        run.forecast_time_to_steady = Series(np.array([t for t, _ in told]), np.array([v for _, v in told]))
