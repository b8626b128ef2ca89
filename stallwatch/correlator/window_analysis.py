"""One closed window in, its results out: verdicts, attribution, GPU idle, warm-up, what-if.

The learnt parts (latency split, warm-up state, miss-ratio curve) live here across windows; all the
per-event work is array work. The only Python loops run per job or per rank, never per event.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import numpy.typing as npt

from stallwatch.catalogue import CAUSES
from stallwatch.correlator.attribution import (
    Attribution,
    Reads,
    Steps,
    gpu_idle_in_stalls,
    is_stall,
    with_retry_backoff,
)
from stallwatch.correlator.cuts import CutSteps, EarlyBooking, attribute_cut, cut_at_windows
from stallwatch.correlator.inflight import InFlight, in_flight
from stallwatch.correlator.intervals import composite_key, distinct_ids, distinct_rows
from stallwatch.correlator.passes import FirstPasses
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
    first, group = distinct_rows(*columns)
    return np.stack([c[first].astype(np.int64) for c in columns], axis=1).reshape(-1, len(columns)), group


Rows = npt.NDArray[np.bool_] | slice
_NO_ROWS = slice(0, 0)


def _job_rows(jobs: npt.NDArray[np.integer]) -> Iterator[tuple[int, Rows]]:
    """Each job in a column of jobs, with its rows: a mask, or every row (a slice, no mask made) where the column
    holds one job, as a node's window usually does."""
    ids = distinct_ids(jobs)
    if len(ids) == 1:
        yield ids[0], slice(None)
        return
    for job in ids:
        yield job, jobs == job


def _steps(columns: Columns) -> Steps:
    return Steps(*(columns[name].astype(np.int64) for name in
                   ("job", "rank", "gpu", "batch", "wait_start_ns", "wait_end_ns", "compute_end_ns", "ready_ns")))


def _spans(steps: Steps, stalled: npt.NDArray[np.bool_]) -> dict[int, Spans]:
    """Per job, the intervals its stalled rows waited."""
    return {job: (steps.wait_start[mine], steps.wait_end[mine])
            for job in np.unique(steps.job[stalled]).tolist()
            for mine in [stalled & (steps.job == job)]}


def _read_lead(mine: npt.NDArray[np.bool_], steps: Steps, read_mine: Rows,
               read_batches: npt.NDArray[np.int64]) -> float | None:
    """How many batches a job's loaders have read ahead of its steps in a window (`mine`, `read_mine`): its latest
    read's batch less its latest step's (its ranks step together, each numbering its batches alike); None without
    both. Asked only while the forecast wants it: the masks cost a steady job nothing."""
    read = read_batches[read_mine]
    read = read[read >= 0]
    if not read.size or not mine.any():
        return None
    return float(max(int(read.max()) - int(steps.batch[mine].max()), 0))


def _stalled(steps: Steps, threshold_ns: int) -> npt.NDArray[np.bool_]:
    return is_stall(steps.wait_start, steps.wait_end, threshold_ns)


def _known_until(steps: Steps, later: Steps | None, later_stalled: npt.NDArray[np.bool_],
                 booking: EarlyBooking) -> dict[tuple[int, int], int]:
    """Per (job, rank) with steps here or buffered for later windows: up to when its timeline is known.

    A rank's next wait starts after its latest compute end, so nothing of it before that is still to come,
    except the stall parts of steps buffered for later windows not booked yet: they are booked when their own
    window closes, so the rank is known only up to the earliest of them."""
    both = steps if later is None else Steps(*(np.concatenate((a, b)) for a, b in
                                               zip(steps.columns(), later.columns(), strict=True)))
    keys, group = _group(both.job, both.rank)
    known = np.full(len(keys), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(known, group, both.compute_end)
    if later is not None:
        begin = booking.unbooked_from(later, later_stalled, release=False)  # after this window's booking
        pending = later_stalled & (begin < later.wait_end)
        earliest = np.full(len(keys), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(earliest, group[len(steps):][pending], begin[pending])
        known = np.minimum(known, earliest)
    return {(job, rank): t for (job, rank), t in zip(keys.tolist(), known.tolist(), strict=True)}


class WindowAnalyser:
    """Called once per closed window; keeps what it learns (latency split, warm-up, what-if) across windows."""

    def __init__(self, settings: CorrelatorSettings | None = None) -> None:
        self.settings = settings or CorrelatorSettings()
        s = self.settings
        self.latency = LatencySplit()
        self.warmup = WarmupTracker(s.warmup, s.dataset_bytes, s.cache_capacity_bytes)
        self.passes = FirstPasses()
        self.whatif = MissRatioCurve(sample_rate=s.whatif_sample_rate, max_keys=s.whatif_max_keys)
        self.cache_capacity_bytes = s.cache_capacity_bytes
        self._first_seen: dict[int, int] = {}
        self._booking = EarlyBooking(seconds_to_ns(s.retention_s))

    def __call__(self, window: WindowInput) -> WindowResult:
        s = self.settings
        start, end = window.start_ns, window.end_ns
        raw = window.context["read"]
        # The window's own reads, once: the latency split, the jobs' counts, the what-if and the warm-up take only
        # these. By places: selected once, not a mask scanned again for each column.
        own_rows = np.flatnonzero((raw["end_ns"] >= start) & (raw["end_ns"] < end))
        own_reads = {name: raw[name][own_rows] for name in ("job", "start_ns", "end_ns", "key", "bytes")}
        verdict = self._verdicts(raw, window, raw["verdict"][own_rows], own_reads)
        own_reads["verdict"] = verdict[own_rows]
        steps = _steps(window.steps)
        flight = in_flight(window.context["open"])
        self.passes.update(window.context["open"])
        received = Reads(raw["job"], raw["rank"], raw["batch"], raw["start_ns"], raw["end_ns"], verdict)
        reads, open_keys = self._with_open_reads(received, flight, window)
        if not raw["bytes"].all():  # a failed fetch among them (outages only: a steady window pays this test)
            failed = np.flatnonzero((raw["bytes"] == 0) & (verdict != Verdict.DIRECT))
            if failed.size:
                reads = with_retry_backoff(reads, np.concatenate((raw["key"], open_keys)), failed,
                                           window.watermark_ns)
        threshold = seconds_to_ns(s.stall_threshold_s)
        stalled = _stalled(steps, threshold)
        later = _steps(window.later_steps) if window.later_steps else None
        later_stalled = _stalled(later, threshold) if later else np.zeros(0, dtype=bool)
        self._booking.note(steps, own=True)
        if later is not None:
            self._booking.note(later, own=False)
        # This window's steps (less what earlier windows booked of them), then the stall parts booked now: of
        # later steps, and of waits still open. Counted as waits here, not as steps.
        own = dataclasses.replace(steps, wait_start=self._booking.unbooked_from(steps, stalled, release=True))
        early = (self._booking.book(later, later_stalled, end, window.watermark_ns) if later
                 else own.take(slice(0, 0)))
        live = self._booking.book_open(flight, end, later)
        rows = Steps(*(np.concatenate(parts) for parts in zip(own.columns(), early.columns(), live.columns(),
                                                              strict=True)))
        n = len(rows)
        cut = cut_at_windows(rows, np.concatenate((stalled, np.ones(len(early) + len(live), dtype=bool))), start,
                             end - start)
        attribution = attribute_cut(cut, n, reads, threshold)
        gpu = window.context["gpu_util"]
        idle = gpu_idle_in_stalls(cut.steps, attribution, gpu["ts_ns"], gpu["period_ns"],
                                  gpu["gpu"].astype(np.int64), gpu["util"])
        here = cut.steps.take(slice(0, n))
        counted = np.arange(n) < len(steps)
        ranks = self._ranks(here, attribution.wait_ns[:n], attribution.compute_ns[:n], attribution.cause_ns[:n],
                            counted)
        gpus = self._gpus(here, idle[:n])
        spans = _spans(here, cut.stalled[:n])
        # Warm-up takes the GPU idle time of the stalls booked now, in whichever window they lie.
        idle_by_job = {job: float(idle[cut.steps.job == job].sum()) / 1e9 for job in np.unique(cut.steps.job).tolist()}
        read_batches = functools.cache(lambda: raw["batch"][own_rows])
        jobs = self._jobs(window, steps, stalled, own_reads, read_batches, idle_by_job, spans, set(live.job.tolist()))
        # The what-if replays the reads that crossed a spoke: a spoke's size changes nothing for the others.
        crossed = np.flatnonzero(own_reads["verdict"] != Verdict.DIRECT)
        replayed = own_reads if crossed.size == own_rows.size else {
            name: own_reads[name][crossed] for name in ("key", "bytes", "end_ns")}
        self.whatif.feed(replayed["key"], replayed["bytes"], replayed["end_ns"])
        whatif: dict[float, float] = {}
        if self.cache_capacity_bytes:
            for factor in WHATIF_FACTORS:
                ratio = self.whatif.hit_ratio(factor * self.cache_capacity_bytes)
                if ratio is not None:
                    whatif[factor] = ratio
        retired = tuple(self.warmup.expire(end))
        for job in retired:
            self._first_seen.pop(job, None)
        self.passes.forget(list(retired))
        curve = WhatIfCurve(self.whatif.sample_rate, self.whatif.keys) if self.whatif.references else None
        earlier = tuple(self._earlier_piece(cut, attribution, idle, n, piece_start, end - start)
                        for piece_start in np.unique(cut.window_start).tolist())
        known = _known_until(steps, later, later_stalled, self._booking)
        for rank, until in self._booking.known_ends(flight).items():
            known[rank] = max(known.get(rank, until), until)
        self._booking.forget_before(end)
        return WindowResult(start, end, ranks, gpus, jobs, whatif, retired, curve, spans, earlier, known)

    def _earlier_piece(self, cut: CutSteps, attribution: Attribution, idle: np.ndarray, n: int, window_start: int,
                       window_ns: int) -> WindowResult:
        """The pieces of this window's stalls that lie in the earlier window at `window_start`."""
        rows = n + np.flatnonzero(cut.window_start == window_start)
        pieces = cut.steps.take(rows)
        ranks = self._ranks(pieces, attribution.wait_ns[rows], attribution.compute_ns[rows],
                            attribution.cause_ns[rows], np.zeros(rows.size, dtype=bool))
        return WindowResult(window_start, window_start + window_ns, ranks, self._gpus(pieces, idle[rows]), (),
                            stall_spans=_spans(pieces, np.ones(rows.size, dtype=bool)))

    def _with_open_reads(self, reads: Reads, flight: InFlight, window: WindowInput) -> tuple[Reads, np.ndarray]:
        """The window's reads and, for the stalls booked while open, the reads still open as last seen: a miss
        when the spoke logged one for its key or it is already open longer than a hit takes (direct when reads
        cross no spoke). With the open ones' keys."""
        opened = flight.open_reads()
        if opened["key"].size == 0:
            return reads, opened["key"]
        done = composite_key(np.concatenate((opened["job"], reads.job)), np.concatenate((opened["rank"], reads.rank)),
                             np.concatenate((opened["start_ns"], reads.start)))
        still_open = ~np.isin(done[:opened["key"].size], done[opened["key"].size:])
        opened = {name: column[still_open] for name, column in opened.items()}
        verdict = self._resolved(np.full(opened["key"].size, Verdict.UNKNOWN, dtype=np.int8), opened["key"],
                                 opened["start_ns"], opened["end_ns"], window)
        return Reads(*(np.concatenate((mine, theirs)) for mine, theirs in (
            (reads.job, opened["job"]), (reads.rank, opened["rank"]), (reads.batch, opened["batch"]),
            (reads.start, opened["start_ns"]), (reads.end, opened["end_ns"]), (reads.verdict, verdict)))), opened["key"]

    def _verdicts(self, reads: dict[str, np.ndarray], window: WindowInput, own_verdict: np.ndarray,
                  own_reads: Columns) -> np.ndarray:
        """Each read's verdict: its own, else the spoke's, else the latency split's (learnt from the window's own
        reads, with the verdicts the client gave them, less those it saw cross no spoke: a local disk's latency
        is neither cluster's)."""
        duration = own_reads["end_ns"] - own_reads["start_ns"]
        crossed = own_verdict != Verdict.DIRECT
        self.latency.learn(duration if crossed.all() else duration[crossed])  # usually all: no copy then
        return self._resolved(reads["verdict"].astype(np.int8, copy=True), reads["key"], reads["start_ns"],
                              reads["end_ns"], window)

    def _resolved(self, verdict: np.ndarray, key: np.ndarray, start: np.ndarray, end: np.ndarray,
                  window: WindowInput) -> np.ndarray:
        """The unknown verdicts (in place) from the spoke's log for the read's key, else from the latency split, or
        `DIRECT` when the node has no spoke for reads to cross."""
        unknown = np.flatnonzero(verdict == Verdict.UNKNOWN)
        if unknown.size == 0:
            return verdict
        spoke = window.context["spoke_request"]
        if spoke["key"].size:
            tolerance = seconds_to_ns(self.settings.spoke_join_tolerance_s)
            verdict[unknown] = join_spoke(key[unknown], end[unknown], spoke["key"], spoke["end_ns"], spoke["verdict"],
                                          tolerance)
            unknown = unknown[verdict[unknown] == Verdict.UNKNOWN]  # the spoke's log left these
        verdict[unknown] = (self.latency.classify(end[unknown] - start[unknown]) if self.settings.spoke
                            else Verdict.DIRECT)
        return verdict

    @staticmethod
    def _ranks(steps: Steps, wait: np.ndarray, compute: np.ndarray, causes: np.ndarray,
               counted: npt.NDArray[np.bool_]) -> tuple[RankRow, ...]:
        """Per rank: its steps (the `counted` rows: not pieces of other windows' steps), wait, compute and stall
        seconds."""
        keys, group = _group(steps.job, steps.rank)
        n = len(keys)
        waits = np.bincount(group, weights=wait, minlength=n) / 1e9
        computes = np.bincount(group, weights=compute, minlength=n) / 1e9
        counts = np.bincount(group, weights=counted, minlength=n).astype(np.int64)
        stalls = np.stack([np.bincount(group, weights=causes[:, c], minlength=n) for c in range(len(CAUSES))],
                          axis=1) / 1e9
        return tuple(RankRow(job, rank, c, w, p, tuple(s)) for (job, rank), c, w, p, s in zip(
            keys.tolist(), counts.tolist(), waits.tolist(), computes.tolist(), stalls.tolist(), strict=True))

    @staticmethod
    def _gpus(steps: Steps, idle: np.ndarray) -> tuple[GpuRow, ...]:
        has = np.flatnonzero((steps.gpu >= 0) & (idle.sum(axis=1) > 0))
        keys, group = _group(steps.job[has], steps.gpu[has])
        sums = np.stack([np.bincount(group, weights=idle[has, c], minlength=len(keys)) for c in range(len(CAUSES))],
                        axis=1) / 1e9
        return tuple(GpuRow(job, gpu, tuple(s)) for (job, gpu), s in zip(keys.tolist(), sums.tolist(), strict=True))

    def _jobs(self, window: WindowInput, steps: Steps, stalled: np.ndarray, reads: Columns,
              read_batches: Callable[[], npt.NDArray[np.int64]], idle_by_job: Mapping[int, float],
              spans: Mapping[int, Spans], waiting: set[int]) -> tuple[JobRow, ...]:
        """Per job, the window's warm-up row; `reads` are the window's own, with their resolved `verdict`, and
        `read_batches` their batches, taken only for a forecast that wants them. Only the reads that crossed a spoke
        count towards its hit ratio, and of those only the ones that got bytes: a fetch that failed (the hub out,
        the spoke's miss ending in an error) says nothing of how warm the cache is, as the what-if leaves it out."""
        read_jobs = reads["job"]
        missed, hit, direct = (reads["verdict"] == verdict for verdict in (Verdict.MISS, Verdict.HIT, Verdict.DIRECT))
        failed = None  # usually none
        if not reads["bytes"].all():
            fetched = reads["bytes"] > 0
            missed, hit, failed = missed & fetched, hit & fetched, ~fetched
        read_rows = dict(_job_rows(read_jobs))
        for job, first in self._earliest(steps, reads, read_rows).items():
            self._first_seen[job] = min(self._first_seen.get(job, first), first)
        step_seconds = (steps.compute_end - steps.wait_start) / 1e9
        nbytes = reads["bytes"]
        rows = []
        for job in sorted(set(self._first_seen) | set(self.warmup.jobs)):
            mine = steps.job == job
            read_mine = read_rows.get(job, _NO_ROWS)
            misses, hits, fetched_bytes = missed[read_mine], hit[read_mine], nbytes[read_mine]
            hit_count = int(np.count_nonzero(hits))  # counted, not summed: a mask's sum casts every row
            cold = self._cold(job)  # the forecast's figures, wanted only until the job is steady
            passing = self.passes.of(job)
            first_pass = passing if cold else None
            lead = _read_lead(mine, steps, read_mine, read_batches()) if first_pass else None
            seen = JobWindow(
                steps=int(np.count_nonzero(mine)),
                ranks=int(np.unique(steps.rank[mine]).size) or self._known_ranks(job),
                step_seconds=step_seconds[mine],
                step_quarter=np.clip((steps.compute_end[mine] - window.start_ns) * 4
                                     // (window.end_ns - window.start_ns), 0, 3),
                reads=int(np.count_nonzero(misses)) + hit_count,
                hits=hit_count,
                hub_bytes=int(fetched_bytes[np.flatnonzero(misses)].sum()),
                read_bytes=int(fetched_bytes[misses | hits].sum()) if cold else 0,
                first_pass=first_pass,
                read_lead=lead,
                stall_idle_gpu_seconds=idle_by_job.get(job, 0.0),
                stall_start_ns=steps.wait_start[mine & stalled],
                stall_end_ns=steps.wait_end[mine & stalled],
                waiting=job in waiting,
                direct_reads=int(np.count_nonzero(direct[read_mine])),
            )
            state = self.warmup.update(job, window.start_ns, window.end_ns, seen, self._first_seen[job],
                                       complete=not window.final)
            rows.append(JobRow(job, state.phase, state.hit_ratio, seen.reads, seen.hub_bytes,
                               state.time_to_steady_s, state.idle_gpu_seconds, state.hub_bytes, state.regressions,
                               stalled_seconds(spans[job]) if job in spans else 0.0, state.forecast,
                               passing[1] if passing else None,
                               int(np.count_nonzero(failed[read_mine])) if failed is not None else 0))
        return tuple(rows)

    def _cold(self, job: int) -> bool:
        """Not steady yet: the forecast still wants the job's figures."""
        state = self.warmup.jobs.get(job)
        return state is None or state.time_to_steady_s is None

    def _known_ranks(self, job: int) -> int:
        state = self.warmup.jobs.get(job)
        return state.ranks if state is not None else 0

    @staticmethod
    def _earliest(steps: Steps, reads: Columns, read_rows: Mapping[int, Rows]) -> dict[int, int]:
        """Per job, the earliest wait or read start (`read_rows`: each job's reads). A loop per job: no sort of the
        window's reads."""
        earliest: dict[int, int] = {}
        for by_job, times in ((_job_rows(steps.job), steps.wait_start), (read_rows.items(), reads["start_ns"])):
            for job, rows in by_job:
                first = int(times[rows].min())
                earliest[job] = min(earliest.get(job, first), first)
        return earliest
