"""Long waits cut at window boundaries, so that a stall's seconds are booked in the windows it spans.

A step arrives when its wait is over, so a 30 s stall reaches the correlator with the window it ends in.
Its wait is cut on the window grid: the piece in the step's own window stays with the step (and its
compute), the pieces in earlier windows go out tagged with their window (`WindowResult.earlier`). Each
piece is attributed on its own with the step's reads and ready time; attribution clips them to the piece,
so a piece's causes sum to the piece, and the pieces to the stall.

A step already buffered for a later window whose stall began before the closing window's end is booked
early (`EarlyBooking`): its wait up to that end goes into the closing window (and the earlier ones it
reaches) at once, so that window need not wait for the next to close; the step's own window later books
only the rest. Only a step whose batch was handed over (its ready time, else its wait's end) by the
watermark is booked early: every read of the batch ended by then, so every one is at hand. A read at hand
says nothing of the others: a batch of several items whose last read hangs in a hub outage has its first
reads in long before, and booking on them would call the outage preprocessing. A step not booked early
waits for its own window, as without early booking.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stallwatch.correlator.attribution import Attribution, Reads, Steps, attribute
from stallwatch.correlator.inflight import InFlight
from stallwatch.correlator.intervals import I64, distinct_rows, equal_join_columns


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
    """Cut the waits of `stalled` steps that began before `start` (windows lie on a grid of `window_ns`)."""
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


StepKey = tuple[int, int, int]  # job, rank, wait start: one wait of one rank


@dataclass
class _Stepped:
    """The newest a rank's steps have said: up to when its timeline is known, its latest batch, its GPU."""

    until_ns: int
    batch: int
    gpu: int


class EarlyBooking:
    """Which waits are booked up to when, before their step's own window closes: an entry per wait booked
    early (its step buffered for a later window) or live (still open, from what is in flight), until its
    step's own window closes (at most one per rank and closing window: a rank's waits follow each other)."""

    def __init__(self, retention_ns: int) -> None:
        self._until: dict[StepKey, int] = {}
        self._stepped: dict[tuple[int, int], _Stepped] = {}
        self._retention_ns = retention_ns

    def unbooked_from(self, steps: Steps, stalled: npt.NDArray[np.bool_], *, release: bool) -> I64:
        """Per step, where the part of its wait not yet booked begins; with `release`, the steps' entries go
        (their own window is closing). One join of the booked waits with the stalled steps."""
        begin = steps.wait_start.copy()
        if not self._until or not len(steps):
            return begin
        keys = list(self._until)
        booked = np.array(keys, dtype=np.int64).reshape(-1, 3)
        rows = np.flatnonzero(stalled)
        booked_of, row_of = equal_join_columns(  # the wait start first: it leaves out most steps at once
            (booked[:, 2], booked[:, 0], booked[:, 1]), (steps.wait_start[rows], steps.job[rows], steps.rank[rows]))
        begin[rows[row_of]] = np.array([self._until[keys[i]] for i in booked_of.tolist()], dtype=np.int64)
        if release:
            for i in np.unique(booked_of).tolist():
                del self._until[keys[i]]
        return begin

    def book(self, later: Steps, stalled: npt.NDArray[np.bool_], end_ns: int, watermark_ns: int) -> Steps:
        """The later steps' stall parts before `end_ns` not booked yet, as rows with no compute, now booked:
        those whose batch was handed over by the watermark."""
        begin = self.unbooked_from(later, stalled, release=False)
        handed_over = np.where(later.ready >= 0, later.ready, later.wait_end)
        rows = np.flatnonzero(stalled & (begin < end_ns) & (handed_over <= watermark_ns))
        until = np.minimum(later.wait_end[rows], end_ns)
        for row, booked in zip(rows.tolist(), until.tolist(), strict=True):
            self._until[(int(later.job[row]), int(later.rank[row]), int(later.wait_start[row]))] = booked
        piece = later.take(rows)
        return dataclasses.replace(piece, wait_start=begin[rows], wait_end=until, compute_end=until)

    def note(self, steps: Steps, *, own: bool) -> None:
        """Steps received: this window's (`own`: booked whole now, so their waits are over and known, and the batch
        taken last) or those buffered for later windows (they say only the rank's GPU). A loop per rank."""
        if not len(steps):
            return
        first, group = distinct_rows(steps.job, steps.rank)
        until = np.full(first.size, -1, dtype=np.int64)
        batch = np.full(first.size, -1, dtype=np.int64)
        np.maximum.at(until, group, steps.compute_end)
        np.maximum.at(batch, group, steps.batch)
        for job, rank, gpu, newest, taken in zip(steps.job[first].tolist(), steps.rank[first].tolist(),
                                                 steps.gpu[first].tolist(), until.tolist(), batch.tolist(),
                                                 strict=True):
            had = self._stepped.get((job, rank)) or _Stepped(-1, -1, gpu)
            self._stepped[(job, rank)] = (_Stepped(max(had.until_ns, newest), max(had.batch, taken), gpu) if own
                                          else _Stepped(had.until_ns, had.batch, gpu))

    def book_open(self, flight: InFlight, end_ns: int, later: Steps | None) -> Steps:
        """The open waits' parts before `end_ns` not booked yet, up to when each was last seen open, as rows
        with no compute, now booked. A wait whose step's own window closed is over (its report is history); one
        whose step is buffered for a later window is booked so too, unless `book` booked it early, with the step's
        batch and handover. Otherwise each row's batch is the one in flight the rank waits for, with its handover
        when done."""
        received = {} if later is None else {
            (job, rank, start): (batch, ready) for job, rank, start, batch, ready in zip(
                later.job.tolist(), later.rank.tolist(), later.wait_start.tolist(), later.batch.tolist(),
                later.ready.tolist(), strict=True)}
        rows = []
        for (job, rank), wait in flight.waits.items():
            stepped = self._stepped.get((job, rank))
            if stepped is not None and wait.since_ns < stepped.until_ns:
                continue  # its step was booked in its own window
            key = (job, rank, wait.since_ns)
            begin = self._until.get(key, wait.since_ns)
            until = min(end_ns, wait.as_of_ns)
            if until <= begin:
                continue
            self._until[key] = until
            batch, ready = received.get(key) or flight.awaited((job, rank), _taken_before(
                stepped.batch if stepped else -1, later, job, rank, wait.since_ns))
            gpu = wait.gpu if wait.gpu >= 0 or stepped is None else stepped.gpu
            rows.append((job, rank, gpu, batch, begin, until, until, ready))
        columns = np.array(rows, dtype=np.int64).reshape(-1, 8)
        return Steps(*(columns[:, i] for i in range(8)))

    def known_ends(self, flight: InFlight) -> dict[tuple[int, int], int]:
        """Up to when each rank with an open wait or an ended loop is known: a wait as far as it is booked; a
        loop that ended, and has not stepped since, for good."""
        known = {}
        for (job, rank), wait in flight.waits.items():
            booked = self._until.get((job, rank, wait.since_ns))
            if booked is not None:
                known[(job, rank)] = booked
        for (job, rank), ended in flight.ended.items():
            stepped = self._stepped.get((job, rank))
            if stepped is None or ended >= stepped.until_ns:
                known[(job, rank)] = FOREVER
        return known

    def forget_before(self, ns: int) -> None:
        """Let go of waits booked longer than the retention before `ns` (a wait whose step never came: its process
        died) and of ranks that stepped last twice that long before and wait for nothing booked since (they left).
        A rank is kept while an open record older than its last step can still be at hand (the retention), so that
        record is never taken for a wait still open, and while its wait is still being booked: the batch it took
        last says which one it waits for (without it, the oldest batch its workers report, one handed over before
        the wait, would turn a long outage into delivery)."""
        self._until = {key: until for key, until in self._until.items() if until >= ns - self._retention_ns}
        waiting = {(job, rank) for job, rank, _ in self._until}
        self._stepped = {key: s for key, s in self._stepped.items()
                         if s.until_ns >= ns - 2 * self._retention_ns or s.until_ns < 0 or key in waiting}


FOREVER = np.iinfo(np.int64).max


def _taken_before(taken: int, later: Steps | None, job: int, rank: int, since_ns: int) -> int:
    """The last batch the rank took before its wait since `since_ns`: its steps buffered for later windows count
    when their waits came before (those after it may be in already, since events arrive out of order)."""
    if later is None:
        return taken
    before = later.batch[(later.job == job) & (later.rank == rank) & (later.wait_start < since_ns)]
    return max(taken, int(before.max())) if before.size else taken
