"""One closed window in, its results out: verdicts, attribution, GPU idle, warm-up, what-if.

The learnt parts (latency split, warm-up state, miss-ratio curve) live here across windows; all the
per-event work is array work. The only Python loops run per job or per rank, never per event.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stallwatch.catalogue import CAUSES
from stallwatch.correlator.attribution import Attribution, Reads, Steps, attribute, gpu_idle_in_stalls
from stallwatch.correlator.intervals import I64, composite_key
from stallwatch.correlator.results import GpuRow, JobRow, RankRow, Spans, WhatIfCurve, WindowResult, stalled_seconds
from stallwatch.correlator.settings import CorrelatorSettings, seconds_to_ns
from stallwatch.correlator.verdicts import LatencySplit, join_spoke
from stallwatch.correlator.warmup import JobWindow, WarmupTracker
from stallwatch.correlator.whatif import MissRatioCurve
from stallwatch.correlator.windows import WindowInput
from stallwatch.eventbatch import Columns, Verdict

WHATIF_FACTORS = (0.5, 1.0, 2.0, 4.0)


def _group(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of the given integer columns, and each input row's group index."""
    if columns[0].size == 0:
        return np.zeros((0, len(columns)), dtype=np.int64), np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(composite_key(*columns), return_index=True, return_inverse=True)
    return np.stack([c[first].astype(np.int64) for c in columns], axis=1), inverse.reshape(-1)


def _steps(columns: Columns) -> Steps:
    return Steps(*(columns[name].astype(np.int64) for name in
                   ("job", "rank", "gpu", "batch", "wait_start_ns", "wait_end_ns", "compute_end_ns", "ready_ns")))


@dataclass(frozen=True)
class CutSteps:
    """A window's steps with each stall's wait cut at the window boundaries: first the steps themselves, with
    the part of their wait in this window (and their compute whole), then one piece per earlier window a stall
    reaches into (its wait there, no compute), with the window it lies in and the step it came from."""

    steps: Steps
    stalled: npt.NDArray[np.bool_]
    window_start: I64  # per piece
    owner: I64  # per piece: the row of its step


def cut_at_windows(steps: Steps, stalled: npt.NDArray[np.bool_], start: int, window_ns: int) -> CutSteps:
    """Cut the waits of `stalled` steps that began before `start` (windows lie on a grid of `window_ns`).

    Each piece is attributed on its own with the step's reads and ready time: attribution clips them to
    the piece, so a piece's causes sum to the piece, and the pieces to the stall."""
    here = np.where(stalled, np.maximum(steps.wait_start, np.minimum(start, steps.wait_end)), steps.wait_start)
    reaching = np.flatnonzero(here > steps.wait_start)
    first = (steps.wait_start[reaching] - start) // window_ns  # window indices relative to this one (< 0)
    count = (here[reaching] - 1 - start) // window_ns - first + 1
    owner = np.repeat(reaching, count)
    offset = np.arange(owner.size) - np.repeat(np.cumsum(count) - count, count)
    window_start = start + (np.repeat(first, count) + offset) * window_ns
    by_window = np.argsort(window_start, kind="stable")  # each window's pieces together, for attribute_cut
    owner, window_start = owner[by_window], window_start[by_window]
    wait_start = np.maximum(steps.wait_start[owner], window_start)
    wait_end = np.minimum(here[owner], window_start + window_ns)

    def rows(column: I64, pieces: I64) -> I64:
        return np.concatenate((column, pieces))

    cut = Steps(rows(steps.job, steps.job[owner]), rows(steps.rank, steps.rank[owner]),
                rows(steps.gpu, steps.gpu[owner]), rows(steps.batch, steps.batch[owner]),
                rows(here, wait_start), rows(steps.wait_end, wait_end), rows(steps.compute_end, wait_end),
                rows(steps.ready, steps.ready[owner]))
    return CutSteps(cut, np.concatenate((stalled, np.ones(owner.size, dtype=bool))), window_start, owner)


def attribute_cut(cut: CutSteps, n: int, reads: Reads, threshold_ns: int) -> Attribution:
    """The steps' rows, then each earlier window's pieces, attributed apart: the join on the awaited batch
    takes one row per (job, rank, batch), and a step has one piece per window."""
    edges = np.flatnonzero(np.diff(cut.window_start)) + 1
    bounds = [0, n, *(n + edges).tolist(), len(cut.steps)] if cut.window_start.size else [0, n]
    parts = [attribute(cut.steps.take(slice(a, b)), reads, threshold_ns, cut.stalled[a:b])
             for a, b in itertools.pairwise(bounds)]
    return Attribution(*(np.concatenate([getattr(part, f.name) for part in parts])
                         for f in dataclasses.fields(Attribution)))


def _spans(steps: Steps, stalled: npt.NDArray[np.bool_]) -> dict[int, Spans]:
    """Per job, the intervals its stalled rows waited."""
    return {job: (steps.wait_start[mine], steps.wait_end[mine])
            for job in np.unique(steps.job[stalled]).tolist()
            for mine in [stalled & (steps.job == job)]}


def _known_until(steps: Steps, later: Steps | None, threshold_ns: int) -> dict[tuple[int, int], int]:
    """Per (job, rank) with steps here or buffered for later windows: up to when its timeline is known.

    A rank's next wait starts after its latest compute end, so nothing of it before that is still to come,
    except the stalls of steps already buffered for later windows: their waits are booked when their own
    window closes, so the rank is known only up to the earliest of them."""
    both = steps if later is None else Steps(*(np.concatenate((a, b)) for a, b in
                                               zip(steps.columns(), later.columns(), strict=True)))
    keys, group = _group(both.job, both.rank)
    known = np.full(len(keys), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(known, group, both.compute_end)
    if later is not None:
        pending = np.full(len(keys), np.iinfo(np.int64).max, dtype=np.int64)
        later_rows = np.arange(len(steps), len(both))
        stall = later_rows[later.wait_end - later.wait_start > threshold_ns]
        np.minimum.at(pending, group[stall], both.wait_start[stall])
        known = np.minimum(known, pending)
    return {(int(k[0]), int(k[1])): int(t) for k, t in zip(keys, known, strict=True)}


class WindowAnalyser:
    """Called once per closed window; keeps what it learns (latency split, warm-up, what-if) across windows."""

    def __init__(self, settings: CorrelatorSettings | None = None) -> None:
        self.settings = settings or CorrelatorSettings()
        s = self.settings
        self.latency = LatencySplit()
        self.warmup = WarmupTracker(s.warmup)
        self.whatif = MissRatioCurve(sample_rate=s.whatif_sample_rate, max_keys=s.whatif_max_keys)
        self.cache_capacity_bytes = s.cache_capacity_bytes
        self._first_seen: dict[int, int] = {}

    def __call__(self, window: WindowInput) -> WindowResult:
        s = self.settings
        start, end = window.start_ns, window.end_ns
        raw = window.context["read"]
        verdict = self._verdicts(raw, window)
        in_window = (raw["end_ns"] >= start) & (raw["end_ns"] < end)
        miss = verdict == Verdict.MISS
        steps = _steps(window.steps)
        reads = Reads(raw["job"], raw["rank"], raw["batch"],
                      raw["start_ns"], raw["end_ns"], miss)
        threshold = seconds_to_ns(s.stall_threshold_s)
        stalled = np.maximum(steps.wait_end - steps.wait_start, 0) > threshold
        cut = cut_at_windows(steps, stalled, start, end - start)
        n = len(steps)
        attribution = attribute_cut(cut, n, reads, threshold)
        gpu = window.context["gpu_util"]
        idle = gpu_idle_in_stalls(cut.steps, attribution, gpu["ts_ns"], gpu["period_ns"],
                                  gpu["gpu"].astype(np.int64), gpu["util"])
        here = cut.steps.take(slice(0, n))
        ranks = self._ranks(here, attribution.wait_ns[:n], attribution.compute_ns[:n], attribution.cause_ns[:n])
        gpus = self._gpus(here, idle[:n])
        # Warm-up sees each step whole, as it always did: its stall's GPU idle time in all windows.
        whole_idle = idle[:n] + np.stack([np.bincount(cut.owner, weights=idle[n:, c], minlength=n)
                                          for c in range(len(CAUSES))], axis=1)
        spans = _spans(here, cut.stalled[:n])
        jobs = self._jobs(window, steps, stalled, reads, in_window, raw["bytes"], whole_idle, spans)
        order = np.argsort(raw["end_ns"][in_window], kind="stable")
        self.whatif.feed(raw["key"][in_window][order], raw["bytes"][in_window][order])
        whatif: dict[float, float] = {}
        if self.cache_capacity_bytes:
            for factor in WHATIF_FACTORS:
                ratio = self.whatif.hit_ratio(factor * self.cache_capacity_bytes)
                if ratio is not None:
                    whatif[factor] = ratio
        retired = tuple(self.warmup.expire(end))
        for job in retired:
            self._first_seen.pop(job, None)
        curve = WhatIfCurve(self.whatif.sample_rate, self.whatif.keys) if self.whatif.references else None
        earlier = tuple(self._earlier_piece(cut, attribution, idle, n, piece_start, end - start)
                        for piece_start in np.unique(cut.window_start).tolist())
        known = _known_until(steps, _steps(window.later_steps) if window.later_steps else None, threshold)
        return WindowResult(start, end, ranks, gpus, jobs, whatif, retired, curve, spans, earlier, known)

    def _earlier_piece(self, cut: CutSteps, attribution: Attribution, idle: np.ndarray, n: int, window_start: int,
                       window_ns: int) -> WindowResult:
        """The pieces of this window's stalls that lie in the earlier window at `window_start`."""
        rows = n + np.flatnonzero(cut.window_start == window_start)
        pieces = cut.steps.take(rows)
        ranks = self._ranks(pieces, attribution.wait_ns[rows], attribution.compute_ns[rows],
                            attribution.cause_ns[rows], counted=False)
        return WindowResult(window_start, window_start + window_ns, ranks, self._gpus(pieces, idle[rows]), (),
                            stall_spans=_spans(pieces, np.ones(rows.size, dtype=bool)))

    def _verdicts(self, reads: dict[str, np.ndarray], window: WindowInput) -> np.ndarray:
        """Each read's verdict: its own, else the spoke's, else the learnt latency split's."""
        verdict = reads["verdict"].astype(np.int8, copy=True)
        unknown = np.flatnonzero(verdict == Verdict.UNKNOWN)
        spoke = window.context["spoke_request"]
        if unknown.size and spoke["key"].size:
            tolerance = seconds_to_ns(self.settings.spoke_join_tolerance_s)
            verdict[unknown] = join_spoke(reads["key"][unknown], reads["end_ns"][unknown], spoke["key"],
                                          spoke["end_ns"], spoke["verdict"], tolerance)
        duration = reads["end_ns"] - reads["start_ns"]
        in_window = (reads["end_ns"] >= window.start_ns) & (reads["end_ns"] < window.end_ns)
        self.latency.learn(duration[in_window])
        unknown = np.flatnonzero(verdict == Verdict.UNKNOWN)
        verdict[unknown] = self.latency.classify(duration[unknown])
        return verdict

    @staticmethod
    def _ranks(steps: Steps, wait: np.ndarray, compute: np.ndarray, causes: np.ndarray,
               counted: bool = True) -> tuple[RankRow, ...]:
        """Per rank: its steps (none for pieces of earlier stalls), wait, compute and stall seconds."""
        keys, group = _group(steps.job, steps.rank)
        n = len(keys)
        waits = np.bincount(group, weights=wait, minlength=n) / 1e9
        computes = np.bincount(group, weights=compute, minlength=n) / 1e9
        counts = np.bincount(group, minlength=n) if counted else np.zeros(n, dtype=np.int64)
        stalls = np.stack([np.bincount(group, weights=causes[:, c], minlength=n) for c in range(len(CAUSES))],
                          axis=1) / 1e9
        return tuple(RankRow(int(k[0]), int(k[1]), int(c), float(w), float(p), tuple(map(float, s)))
                     for k, c, w, p, s in zip(keys, counts, waits, computes, stalls, strict=True))

    @staticmethod
    def _gpus(steps: Steps, idle: np.ndarray) -> tuple[GpuRow, ...]:
        has = np.flatnonzero((steps.gpu >= 0) & (idle.sum(axis=1) > 0))
        keys, group = _group(steps.job[has], steps.gpu[has])
        sums = np.stack([np.bincount(group, weights=idle[has, c], minlength=len(keys)) for c in range(len(CAUSES))],
                        axis=1) / 1e9
        return tuple(GpuRow(int(k[0]), int(k[1]), tuple(map(float, s))) for k, s in zip(keys, sums, strict=True))

    def _jobs(self, window: WindowInput, steps: Steps, stalled: np.ndarray, reads: Reads, in_window: np.ndarray,
              sizes: np.ndarray, idle: np.ndarray, spans: Mapping[int, Spans]) -> tuple[JobRow, ...]:
        read_jobs = reads.job[in_window]
        for job, first in self._earliest(steps, reads, in_window).items():
            self._first_seen[job] = min(self._first_seen.get(job, first), first)
        step_seconds = (steps.compute_end - steps.wait_start) / 1e9
        idle_per_step = idle.sum(axis=1) / 1e9
        rows = []
        for job in sorted(set(self._first_seen) | set(self.warmup.jobs)):
            mine = steps.job == job
            read_mine = read_jobs == job
            misses = reads.miss[in_window] & read_mine
            seen = JobWindow(
                steps=int(mine.sum()),
                ranks=int(np.unique(steps.rank[mine]).size) or self._known_ranks(job),
                step_seconds=step_seconds[mine],
                step_quarter=np.clip((steps.compute_end[mine] - window.start_ns) * 4
                                     // (window.end_ns - window.start_ns), 0, 3),
                reads=int(read_mine.sum()),
                hits=int((read_mine & ~misses).sum()),
                hub_bytes=int(sizes[in_window][misses].sum()),
                stall_idle_gpu_seconds=float(idle_per_step[mine].sum()),
                stall_start_ns=steps.wait_start[mine & stalled],
                stall_end_ns=steps.wait_end[mine & stalled],
            )
            state = self.warmup.update(job, window.start_ns, window.end_ns, seen, self._first_seen[job],
                                       complete=not window.final)
            rows.append(JobRow(job, state.phase, state.hit_ratio, seen.reads, seen.hub_bytes,
                               state.time_to_steady_s, state.idle_gpu_seconds, state.hub_bytes, state.regressions,
                               stalled_seconds(spans[job]) if job in spans else 0.0))
        return tuple(rows)

    def _known_ranks(self, job: int) -> int:
        state = self.warmup.jobs.get(job)
        return state.ranks if state is not None else 0

    @staticmethod
    def _earliest(steps: Steps, reads: Reads, in_window: np.ndarray) -> dict[int, int]:
        """Per job, the earliest wait or read start. A loop per job: no sort of the window's reads."""
        earliest: dict[int, int] = {}
        for jobs, times in ((steps.job, steps.wait_start), (reads.job[in_window], reads.start[in_window])):
            for job in np.unique(jobs).tolist():
                first = int(times[jobs == job].min())
                earliest[job] = min(earliest.get(job, first), first)
        return earliest
