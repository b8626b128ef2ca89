"""The same stall attribution written the plain way: one Python call per event through streamz.

It is the baseline `correlator_throughput.py` measures the vectorised pipeline against (and checks its
attribution equal to); nothing in the product uses it. Its input is the same as the real pipeline's, batches, which it
explodes into single events (`flatten`): each then takes its own trip through streamz. Batches must
come in event-time order (a read before the step that waited on it); reads carry their verdicts.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator

import numpy as np
from streamz import Stream

from stallwatch.catalogue import CAUSES
from stallwatch.correlator.attribution import CACHE, DELIVERY, OTHER, PREPROCESS, REMOTE
from stallwatch.eventbatch import EventBatch, Verdict

Interval = tuple[int, int]


def _union(intervals: list[Interval]) -> int:
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered


class NaiveAttributor:
    def __init__(self, threshold_ns: int, lookback_ns: int) -> None:
        self.threshold_ns = threshold_ns
        self.lookback_ns = lookback_ns
        self.by_batch: dict[tuple[int, int, int], list[tuple[int, int, bool]]] = defaultdict(list)
        self.by_rank: dict[tuple[int, int], deque[tuple[int, int, bool]]] = defaultdict(deque)
        self.stall_ns: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0] * len(CAUSES))
        self.source = Stream()
        self._sink = self.source.map(rows).flatten().sink(self.on_event)

    def on_event(self, event: tuple[str, dict[str, int]]) -> None:
        kind, row = event
        if kind == "read":
            read = (row["start_ns"], row["end_ns"], row["verdict"] == Verdict.MISS)
            if row["batch"] >= 0:
                self.by_batch[(row["job"], row["rank"], row["batch"])].append(read)
            self.by_rank[(row["job"], row["rank"])].append(read)
        elif kind == "step":
            self.on_step(row)

    def on_step(self, row: dict[str, int]) -> None:
        job, rank, ws, waited = row["job"], row["rank"], row["wait_start_ns"], row["wait_end_ns"]
        if waited - ws <= self.threshold_ns:
            return
        split = self.stall_ns[(job, rank)]
        we = min(max(row["ready_ns"], ws), waited) if row["ready_ns"] >= 0 else waited  # then delivery
        mine = self.by_batch.pop((job, rank, row["batch"]), None) if row["batch"] >= 0 else None
        recent = self.by_rank[(job, rank)]
        while recent and recent[0][1] < ws - self.lookback_ns:
            recent.popleft()
        reads = mine if mine else [r for r in recent if r[0] < we and r[1] > ws]
        clipped = [(min(max(s, ws), we), min(max(e, ws), we), miss) for s, e, miss in reads]
        cover = _union([(s, e) for s, e, _ in clipped])
        missed = _union([(s, e) for s, e, miss in clipped if miss])
        busy = we - min(max(min(s for s, _, _ in mine), ws), we) if mine else 0
        split[REMOTE] += missed
        split[CACHE] += cover - missed
        preprocess = max(busy - cover, 0) if mine else 0
        split[PREPROCESS] += preprocess
        split[DELIVERY] += waited - we
        split[OTHER] += (we - ws) - cover - preprocess


def rows(batch: EventBatch) -> Iterator[tuple[str, dict[str, int]]]:
    """A batch's rows as single events (the per-event pipeline's elements)."""
    names = list(batch.columns)
    columns = [np.asarray(batch.columns[name]).tolist() for name in names]
    for values in zip(*columns, strict=True):
        yield batch.kind, dict(zip(names, values, strict=True))
