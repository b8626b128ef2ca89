"""What the training processes had in flight when they last looked: their `open` records, per rank.

A step is sent once its wait is over, so a wait still under way is known only from the open records
each source sends at its flushes (`wire.OPEN_*`): the trainer's open wait or the end of its loop, and
each loader worker's batch under construction, its open read and the batch it handed over last. A
source's latest report, the rows sharing its newest `as_of_ns`, says what it does now (its wait, its open
read): a source reports nothing it no longer has open, so an older record is history. Which batches the
workers have built or are building, and when they handed each over, every record at hand says.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stallwatch.client import wire
from stallwatch.correlator.intervals import composite_key, distinct_rows
from stallwatch.eventbatch import Columns

RankKey = tuple[int, int]  # job, rank


@dataclass(frozen=True)
class Wait:
    since_ns: int  # the wait_start of the step that will end it
    as_of_ns: int  # it was still open then
    gpu: int  # the rank's GPU, -1 unknown


@dataclass(frozen=True)
class OpenRead:
    """A loader worker's read still open in its latest report."""

    job: int
    rank: int
    batch: int
    key: int
    since_ns: int
    as_of_ns: int


@dataclass(frozen=True)
class InFlight:
    waits: dict[RankKey, Wait]  # trainers whose latest report is an open wait
    ended: dict[RankKey, int]  # trainers whose loop ended (when), as they last said
    reads: list[OpenRead]
    # Per rank, every batch its workers reported at hand (building, reading or handed over), and when it was handed
    # over (-1: not seen handed over). Not only the latest reports: a worker may be on its next batch already.
    batches: dict[RankKey, dict[int, int]]

    def awaited(self, rank: RankKey, after_batch: int) -> tuple[int, int]:
        """The batch the rank's wait is for, the oldest one reported past `after_batch` (-1 unknown), and when its
        worker handed it over (-1: not yet)."""
        batches = [b for b in self.batches.get(rank, {}) if b > after_batch]
        if not batches:
            return -1, -1
        batch = min(batches)
        return batch, self.batches[rank][batch]

    def open_reads(self) -> Columns:
        """The reads still open, as read rows ending when last seen open (`end_ns` = as of)."""
        columns = np.array([(r.job, r.rank, r.batch, r.since_ns, r.as_of_ns) for r in self.reads],
                           dtype=np.int64).reshape(-1, 5)
        return {"job": columns[:, 0], "rank": columns[:, 1], "batch": columns[:, 2],
                "key": np.array([r.key for r in self.reads], dtype=np.uint64), "start_ns": columns[:, 3],
                "end_ns": columns[:, 4]}


def _latest_reports(opens: Columns) -> Columns:
    """The rows of each source's (job, rank, worker) latest report."""
    if opens["as_of_ns"].size == 0:
        return opens
    source = composite_key(opens["job"], opens["rank"], opens["worker"])
    newest = np.full(int(source.max()) + 1, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(newest, source, opens["as_of_ns"].astype(np.int64))
    latest = opens["as_of_ns"] == newest[source]
    return {name: column[latest] for name, column in opens.items()}


def _batches(opens: Columns) -> dict[RankKey, dict[int, int]]:
    """Per rank, each batch its workers reported, with its handover time (-1 none). A loop per distinct batch."""
    worked = (opens["worker"] >= 0) & (opens["batch"] >= 0)
    handed = np.where(opens["state"] == wire.OPEN_HANDED, opens["since_ns"], -1)[worked]
    first, group = distinct_rows(opens["job"][worked], opens["rank"][worked], opens["batch"][worked])
    when = np.full(first.size, -1, dtype=np.int64)
    np.maximum.at(when, group, handed)
    out: dict[RankKey, dict[int, int]] = {}
    for job, rank, batch, at in zip(opens["job"][worked][first].tolist(), opens["rank"][worked][first].tolist(),
                                    opens["batch"][worked][first].tolist(), when.tolist(), strict=True):
        out.setdefault((job, rank), {})[batch] = at
    return out


def in_flight(opens: Columns) -> InFlight:
    """What each rank has in flight, from the open records at hand. A loop per record of the latest
    reports: a node's few trainers and workers, each a handful of records."""
    latest = _latest_reports(opens)
    waits: dict[RankKey, Wait] = {}
    ended: dict[RankKey, int] = {}
    reads: list[OpenRead] = []
    columns = [latest[name].tolist() for name in ("job", "rank", "gpu", "state", "batch", "key", "since_ns",
                                                  "as_of_ns")]
    for job, rank, gpu, state, batch, key, since, as_of in zip(*columns, strict=True):
        if state == wire.OPEN_WAIT:
            waits[(job, rank)] = Wait(since, as_of, gpu)
        elif state == wire.OPEN_ENDED:
            ended[(job, rank)] = since
        elif state == wire.OPEN_READ:
            reads.append(OpenRead(job, rank, batch, key, since, as_of))
    return InFlight(waits, ended, reads, _batches(opens))
