"""Per job, the windows not yet published: a job's window goes out once the job's timeline is complete there.

A step arrives only when its wait is over, so a long stall (a 30 s hub outage) reaches the correlator
with the window it ends in, its pieces in earlier windows alongside (window_analysis.py). A job's window
is therefore held until every live rank of the job is known past the window's end
(`WindowResult.known_ns`), and pieces merge into the held windows they lie in before those go out. A
rank known for less than `hold_s` behind the newest closed window is no longer waited for, so a window
waits at most `hold_s` after its end, and a job that ended delays only its own last windows. A piece
whose window went out already (a stall longer than the hold) is booked in the job's oldest held window:
a published time is never published again.

A job's windows go out in time order, as Prometheus takes a series' samples only in order; each
release is a `Publication`: the window's rows of the jobs released with it, and the wall-clock offset
read at that moment.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from stallwatch.correlator.results import WindowResult, combine
from stallwatch.correlator.settings import seconds_to_ns
from stallwatch.correlator.wallclock import wall_offset_ns


@dataclass(frozen=True)
class Publication:
    result: WindowResult  # one window, the rows of the jobs it is published for
    wall_offset_ns: int  # unix ns minus the events' monotonic ns, when published


class WindowHold:
    """Takes every closed window's result (`add`), hands each job's complete windows to `listeners`.

    `wall_offset` gives the monotonic-to-unix offset: read at each release by the agent, fixed to the
    recorded one by a replay. `flush` releases everything still held (end of input)."""

    def __init__(self, hold_s: float, listeners: Iterable[Callable[[Publication], None]] = (),
                 wall_offset: Callable[[], int] = wall_offset_ns) -> None:
        self._hold_ns = seconds_to_ns(hold_s)
        self._listeners = list(listeners)
        self._wall_offset = wall_offset
        self._held: dict[int, dict[int, WindowResult]] = {}  # job -> window start -> its rows so far
        self._known: dict[int, dict[int, int]] = {}  # job -> rank -> its timeline is complete up to (ns)
        self._published_until: dict[int, int] = {}  # job -> end of its last published window

    def held(self, job: int) -> list[int]:
        """The starts of the job's windows not yet published."""
        return sorted(self._held.get(job, {}))

    def add(self, result: WindowResult) -> None:
        now = result.end_ns
        if not result.job_ids():  # no job to wait for: the node-wide rows (the what-if) go out at once
            self._emit([result.of_jobs(set())])
        for (job, rank), until in result.known_ns.items():
            self._known.setdefault(job, {})[rank] = until
        for job in result.job_ids():
            self._hold(job, result.of_jobs({job}))
        for piece in result.earlier:
            for job in piece.job_ids():
                self._hold(job, piece.of_jobs({job}))
        retiring = set(result.retired_jobs)
        self._emit(self._release(lambda job, end: job in retiring or self._complete(job, end, now)))
        for job in retiring:
            self._known.pop(job, None)
            self._published_until.pop(job, None)
        for ranks in self._known.values():  # ranks silent past the hold are not waited for: let them go
            for rank in [rank for rank, until in ranks.items() if now - until >= self._hold_ns]:
                del ranks[rank]

    def flush(self) -> None:
        self._emit(self._release(lambda job, end: True))

    def _hold(self, job: int, part: WindowResult) -> None:
        held = self._held.setdefault(job, {})
        start = part.start_ns
        if start < self._published_until.get(job, start):
            # Its window is out: the job's oldest held window takes it (the step it came from is held).
            start = min(held)
        held[start] = combine([held[start], part]) if start in held else part

    def _complete(self, job: int, end_ns: int, now_ns: int) -> bool:
        """Every rank of the job is known up to `end_ns`, or silent for the hold."""
        return all(until >= end_ns or now_ns - until >= self._hold_ns for until in self._known.get(job, {}).values())

    def _release(self, ready: Callable[[int, int], bool]) -> list[WindowResult]:
        released: dict[int, list[WindowResult]] = defaultdict(list)
        for job, held in self._held.items():
            for start in sorted(held):
                if not ready(job, held[start].end_ns):
                    break  # in order: a later window of the job waits for this one
                self._published_until[job] = held[start].end_ns
                released[start].append(held.pop(start))
        self._held = {job: held for job, held in self._held.items() if held}
        return [combine(released[start]) for start in sorted(released)]

    def _emit(self, results: list[WindowResult]) -> None:
        if not results:
            return
        offset = self._wall_offset()
        for result in results:
            publication = Publication(result, offset)
            for listener in self._listeners:
                listener(publication)
