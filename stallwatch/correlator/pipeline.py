"""The correlator as a streamz pipeline whose elements are columnar batches.

    source ──map(window)──> flatten ──map(analyse)────> sinks (metrics, window file, ...)
      EventBatch | Watermark | Flush      WindowInput            WindowResult

streamz carries micro-batches, never single events: each element is a whole `EventBatch` (thousands of
events), a `Watermark` (the agent's clock says windows up to here may close) or `Flush` (end of an
offline file). Windows are event-time windows of our own (windows.py); streamz's `timed_window`
would window by arrival time. The pipeline is single-threaded: feed it from one thread
(live.py queues batches from the agent's many threads).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from streamz import Stream

from stallwatch.correlator.results import WindowResult
from stallwatch.correlator.settings import CorrelatorSettings, seconds_to_ns
from stallwatch.correlator.window_analysis import WindowAnalyser
from stallwatch.correlator.windows import EventTimeWindows, WindowInput
from stallwatch.eventbatch import EventBatch, MalformedEventBatchError, conform

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Watermark:
    ns: int


@dataclass(frozen=True)
class Flush:
    pass


Element = EventBatch | Watermark | Flush


def event_count(batch: EventBatch) -> int:
    """Events in a batch that may be malformed: its longest column, 0 if it has none."""
    return max((getattr(column, "size", 0) for column in batch.columns.values()), default=0)


class CorrelatorPipeline:
    """Feed `EventBatch`es (and `Watermark`s or a final `Flush`); every closed window goes to `listeners`.

    With `event_time_watermark` (offline files) the newest event time, less the lateness, closes
    windows; without it (the agent) only `Watermark` elements from the agent's clock do, so one
    event stamped in the future cannot close windows early.
    """

    def __init__(self, settings: CorrelatorSettings | None = None, *,
                 listeners: Iterable[Callable[[WindowResult], None]] = (), event_time_watermark: bool = True) -> None:
        self.settings = settings or CorrelatorSettings()
        s = self.settings
        self.windows = EventTimeWindows(window_ns=seconds_to_ns(s.window_s), lateness_ns=seconds_to_ns(s.lateness_s),
                                        lookback_ns=seconds_to_ns(s.lookback_s),
                                        retention_ns=seconds_to_ns(s.retention_s),
                                        max_buffered_events=s.max_buffered_events,
                                        gpu_gap_ns=seconds_to_ns(s.gpu_gap_s))
        self.analyse = WindowAnalyser(self.settings)
        self.malformed: Counter[str] = Counter()  # events dropped with their batch, by kind
        self._event_time_watermark = event_time_watermark
        self.source = Stream()
        # streamz holds downstream nodes weakly: keep the chain alive even with no listener.
        self.results = self.source.map(self._close_windows).flatten().map(self.analyse)
        for listener in listeners:
            self.results.sink(listener)

    def emit(self, element: Element) -> None:
        self.source.emit(element)

    def _close_windows(self, element: Element) -> list[WindowInput]:
        if isinstance(element, Flush):
            return self.windows.flush()
        if isinstance(element, Watermark):
            return self.windows.advance(element.ns)
        try:
            columns = conform(element.kind, element.columns)
        except MalformedEventBatchError as error:
            self.malformed[element.kind] += event_count(element)
            log.warning("correlator: dropped a batch: %s", error)
            return []
        self.windows.add(element.kind, columns)
        newest = self.windows.newest_event_ns
        if self._event_time_watermark and newest is not None:
            return self.windows.advance(newest - seconds_to_ns(self.settings.lateness_s))
        return []

    def run(self, batches: Iterable[EventBatch]) -> None:
        """Offline: every batch, then a flush."""
        for batch in batches:
            self.emit(batch)
        self.emit(Flush())
