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


def _read_rows(path: Path, start: float | None, end: float | None) -> list[dict[str, Any]]:
    rows = _by_window(_parse(path))
    if not rows:
        raise ValueError(f"{path}: no windows recorded")
    kept = [row for row in rows
            if (start is None or row["end_s"] > start) and (end is None or row["start_s"] < end)]
    if not kept:
        raise ValueError(f"{path}: no window between --start and --end (the file covers "
                         f"{rows[0]['start_s']:.0f} to {rows[-1]['end_s']:.0f} s)")
    return kept


def run_from_windows(path: Path, job: str | None = None, start: float | None = None,
                     end: float | None = None) -> Run:
    """A run from `--correlator.record-windows` lines (times in unix seconds): the job's rows only if given,
    the windows that overlap [start, end] if given."""
    rows = _read_rows(path, start, end)
    jobs = sorted({item["job"] for row in rows for item in row["jobs"]})
    if job is not None and job not in jobs:
        raise ValueError(f"{path}: no windows of job {job!r} (jobs: {', '.join(jobs) or 'none'})")
    t = np.array([(row["start_s"] + row["end_s"]) / 2 for row in rows])
    length = np.array([row["end_s"] - row["start_s"] for row in rows])

    def ours(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [item for item in items if job is None or item["job"] == job]

    def total(key: str, pick: Any) -> FloatArray:
        return np.array([sum(pick(item) for item in ours(row[key])) for row in rows], dtype=np.float64)

    compute = total("ranks", lambda r: r["compute_s"])
    ranks = np.maximum(total("ranks", lambda r: 1), 1)
    # A job with no hit ratio yet (no read in its warm-up span) counts in neither.
    reads = total("jobs", lambda j: j["reads"] if j["hit_ratio"] is not None else 0)
    hits = total("jobs", lambda j: j["reads"] * j["hit_ratio"] if j["hit_ratio"] is not None else 0)
    run = Run(start=float(rows[0]["start_s"]), end=float(rows[-1]["end_s"]), job=job)
    run.gpu_utilization = Series(t, compute / length / ranks)  # the emulated GPU is busy while its rank computes
    run.steps_per_second = Series(t, total("ranks", lambda r: r["steps"]) / length)
    run.hit_ratio = Series(t, np.divide(hits, reads, out=np.full_like(hits, np.nan), where=reads > 0))
    run.hub_bytes_per_second = Series(t, total("jobs", lambda j: j["hub_bytes"]) / length)
    for cause in c.CAUSES:
        run.stall_by_cause[cause] = Series(t, total("ranks", lambda r, k=cause: r["stall_s"][k]) / length)
    if job is None and len(jobs) > 1:
        run.several_jobs = tuple(jobs)  # one job's phases after another's would read as one run's
    for row in rows:
        for item in [] if run.several_jobs else ours(row["jobs"]):
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
