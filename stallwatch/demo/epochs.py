"""Each epoch's own figures, for the demo's epoch lines: what a query of the agent's series over the epoch's
span gives, not the last few seconds'.

- hit ratio: the increase of `stallwatch_spoke_requests_total{result="hit"}` over that of all the spoke's
  requests, between scrapes of the agent when the epoch began and when its last step began (its reads are
  all done then, the next epoch's not begun; the nginx collector reads the log up to the scrape);
- input-bound ratio: stall seconds over stall plus compute seconds, the increase of
  `stallwatch_stall_seconds_total` and `stallwatch_compute_seconds_total` over the epoch. The correlator
  books them window by window, stamped with the window's end, and publishes a window only after its
  lateness: they come from the agent's window file (`--correlator.record-windows`, each window's
  increments), the windows whose middle falls in the epoch (the run's last epoch: all from its start on),
  once the window after its end is out;
- the warm-up phases the correlator recognised in those windows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallwatch import catalogue as c
from stallwatch.harness import Samples, total


@dataclass(frozen=True)
class EpochFigures:
    epoch: int
    steps: int
    started: float  # unix seconds
    ended: float
    requests: float  # the spoke's, in the epoch
    hits: float
    stall_seconds: float  # booked by the correlator in the epoch's windows, every cause
    compute_seconds: float
    phases: tuple[str, ...]  # in the order recognised

    @property
    def hit_ratio(self) -> float | None:
        return self.hits / self.requests if self.requests else None

    @property
    def input_bound_ratio(self) -> float | None:
        booked = self.stall_seconds + self.compute_seconds
        return self.stall_seconds / booked if booked else None


def _percent(ratio: float | None) -> str:
    return "  - " if ratio is None else f"{ratio:4.0%}"


def epoch_line(figures: EpochFigures) -> str:
    """The epoch's line: its steps and length, its hit and input-bound ratios and the phases seen in it."""
    return (f"  epoch {figures.epoch:2d}  {figures.steps:3d} steps in {figures.ended - figures.started:5.1f} s  "
            f"hit {_percent(figures.hit_ratio)}  input-bound {_percent(figures.input_bound_ratio)}  "
            f"phase {' > '.join(figures.phases) or '-'}")


def spoke_requests(samples: Samples) -> tuple[float, float]:
    """The spoke's requests and hits so far, from a scrape of the agent."""
    return total(samples, c.SPOKE_REQUESTS.name), total(samples, c.SPOKE_REQUESTS.name, result="hit")


class WindowFile:
    """The agent's window file, read as it grows (whole lines only)."""

    def __init__(self, path: Path, job: str) -> None:
        self.path = path
        self.job = job
        self._offset = 0
        self._rows: list[dict[str, Any]] = []

    def read(self) -> None:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        whole = data[:data.rfind(b"\n") + 1]
        self._offset += len(whole)
        self._rows += [json.loads(line) for line in whole.splitlines() if line.strip()]

    def forecast_after(self, seconds: float) -> float | None:
        """The job's forecast of its time to steady in its first window ending `seconds` or more after its first
        window began (inf: never); None if none was published then."""
        rows = [(row["start_s"], row["end_s"], job) for row in self._rows for job in row["jobs"]
                if job["job"] == self.job]
        if not rows:
            return None
        began = rows[0][0]
        told = next((job.get("forecast_time_to_steady_s") for _, end, job in rows if end >= began + seconds), None)
        return math.inf if told == "never" else told

    def phase_at(self, until: float) -> str | None:
        """The job's phase in the last window that ended by `until`; None if none has."""
        return next((job["phase"] for row in reversed(self._rows) if row["end_s"] <= until
                     for job in row["jobs"] if job["job"] == self.job), None)

    def covers(self, until: float) -> bool:
        """Whether the windows up to `until` are out: a window that starts there or later is."""
        return any(row["start_s"] >= until for row in reversed(self._rows[-8:]))

    def booked(self, start: float, end: float) -> tuple[float, float, tuple[str, ...]]:
        """The job's stall and compute seconds in the windows whose middle is in [start, end), and the phases
        recognised in them, in order."""
        stall = compute = 0.0
        phases: list[str] = []
        for row in self._rows:
            if not start <= (row["start_s"] + row["end_s"]) / 2 < end:
                continue
            for rank in row["ranks"]:
                if rank["job"] == self.job:
                    stall += sum(rank["stall_s"].values())
                    compute += rank["compute_s"]
            for job in row["jobs"]:
                if job["job"] == self.job and job["phase"] not in phases[-1:]:
                    phases.append(job["phase"])
        return stall, compute, tuple(phases)
