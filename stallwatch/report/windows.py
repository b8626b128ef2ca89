"""A run read from the correlator's recorded windows (`--correlator.record-windows FILE`, JSON lines).

A window file is one node's record and does not name its node, so it takes a job filter only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from stallwatch import catalogue as c
from stallwatch.report.run import FloatArray, Run, Series

WINDOW_KEYS = {"start_s", "end_s", "ranks", "gpus", "jobs", "whatif_hit_ratio"}


def _parse(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}:{number}: not a window row (not JSON)") from None
        if not isinstance(row, dict) or not row.keys() >= WINDOW_KEYS:
            raise ValueError(f"{path}:{number}: not a window row (a row has {', '.join(sorted(WINDOW_KEYS))})")
        rows.append(row)
    return rows


def _by_window(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per window, in time order: a job held for a stall is published in a line of its own."""
    merged: dict[float, dict[str, Any]] = {}
    for line in lines:
        # The wall-clock offset is read at each publication: one window's lines may differ by microseconds.
        row = merged.setdefault(round(line["start_s"], 3), {**line, "ranks": [], "gpus": [], "jobs": []})
        for key in ("ranks", "gpus", "jobs"):
            row[key] += line[key]
        row["whatif_hit_ratio"] = line["whatif_hit_ratio"] or row["whatif_hit_ratio"]
    return [merged[start] for start in sorted(merged)]


def _within(rows: list[dict[str, Any]], path: Path, start: float | None, end: float | None) -> list[dict[str, Any]]:
    kept = [row for row in rows
            if (start is None or row["end_s"] > start) and (end is None or row["start_s"] < end)]
    if not kept:
        raise ValueError(f"{path}: no window between --start and --end (the file covers "
                         f"{rows[0]['start_s']:.0f} to {rows[-1]['end_s']:.0f} s)")
    return kept


def run_from_windows(path: Path, job: str | None = None, start: float | None = None,
                     end: float | None = None) -> Run:
    """A run from `--correlator.record-windows` lines (times in unix seconds): the job's rows only if given,
    the windows that overlap [start, end] if given. Each figure is the sum of the windows' rows of the metric
    it is published as; a window holds its values over its own span, and where no window holds a rank of the
    run (between jobs, before and after), nothing is drawn."""
    recorded = _by_window(_parse(path))
    if not recorded:
        raise ValueError(f"{path}: no windows recorded")
    rows = _within(recorded, path, start, end)
    jobs = sorted({item["job"] for row in rows for item in row["jobs"]})
    if job is not None and job not in jobs:
        raise ValueError(f"{path}: no windows of job {job!r} (jobs: {', '.join(jobs) or 'none'})")

    def ours(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [item for item in items if job is None or item["job"] == job]

    def total(key: str, pick: Any) -> FloatArray:
        return np.array([sum(pick(item) for item in ours(row[key])) for row in rows], dtype=np.float64)

    run = Run(start=float(rows[0]["start_s"]), end=float(rows[-1]["end_s"]), job=job)
    starts = np.array([row["start_s"] for row in rows], dtype=np.float64)
    ends = np.array([row["end_s"] for row in rows], dtype=np.float64)
    length = ends - starts
    # A window with no row of the run's jobs tells nothing about them (as a job's series stop in Prometheus).
    active = total("ranks", lambda r: 1) + total("jobs", lambda j: 1) > 0

    def series(values: FloatArray, known: Any = active) -> Series:
        return Series(starts, np.where(known, values, np.nan), ends)

    run.ranks = len({(r["job"], r["rank"]) for row in rows for r in ours(row["ranks"])})
    run.compute_seconds = float(total("ranks", lambda r: r["compute_s"]).sum())
    run.steps_per_second = series(total("ranks", lambda r: r["steps"]) / length)
    for cause in c.CAUSES:
        stalled = total("ranks", lambda r, k=cause: r["stall_s"][k])
        run.stall_seconds[cause] = float(stalled.sum())
        run.stall_by_cause[cause] = series(stalled / length / max(run.ranks, 1))
        run.gpu_stall_idle_seconds[cause] = float(total("gpus", lambda g, k=cause: g["idle_s"][k]).sum())
    devices = [row["gpu_devices"] for row in rows if "gpu_devices" in row]
    run.gpu_devices = max(devices) if devices else None
    reads = total("jobs", lambda j: j["reads"])  # those that crossed a spoke: a job's hit ratio is theirs
    hits = total("jobs", lambda j: j["reads"] * (j["hit_ratio"] or 0.0))
    run.spoke_reads = float(reads.sum())
    run.hit_ratio = series(np.divide(hits, reads, out=np.zeros_like(hits), where=reads > 0), reads > 0)
    run.hub_bytes_per_second = series(total("jobs", lambda j: j["hub_bytes"]) / length)
    if job is None and len(jobs) > 1:
        run.several_jobs = tuple(jobs)  # one job's phases after another's would read as one run's
    else:
        _warmup(run, rows, ours)
        run.job_started = next(row["start_s"] for row in recorded if ours(row["jobs"]))
    for row in rows:
        if row["whatif_hit_ratio"]:
            run.whatif = {k: float(v) for k, v in row["whatif_hit_ratio"].items()}
        run.whatif_keys = row.get("whatif_keys") or run.whatif_keys
    return run


def _warmup(run: Run, rows: list[dict[str, Any]], ours: Any) -> None:
    """The job's phases, each from the window that recognised it, and its warm-up figures as last published."""
    for row in rows:
        for item in ours(row["jobs"]):
            if run.phases and run.phases[-1][2] == item["phase"]:
                run.phases[-1] = (run.phases[-1][0], row["end_s"], item["phase"])
            else:
                run.phases.append((row["start_s"], row["end_s"], item["phase"]))
            if item["time_to_steady_s"] is not None:
                run.time_to_steady_seconds = item["time_to_steady_s"]
                run.warmup_idle_gpu_seconds = item["warmup_idle_gpu_s"]
                run.warmup_hub_bytes = item["warmup_hub_bytes"]
