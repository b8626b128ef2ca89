"""The correlator inside the agent: a thread-safe input, one pipeline thread, metrics, window and event files.

Collectors call `submit(batch)` from their own threads (GPU poll, event receiver, spoke tailers). It
only appends to a queue under a lock, so no collector ever waits on the correlator; past
`max_backlog_events` queued events a batch is dropped and counted (`backlog`), as is a batch the
window store sheds at its cap (`window_full`): with both caps, a flood costs bounded memory. One
thread drains the queue into the streamz pipeline every `tick_s` and then advances the watermark by
the agent's clock (the same monotonic clock the events carry), so windows close on time even when
the node falls silent. Closed windows go through the window hold (hold.py) to the metrics and the
window file, so both carry each job's windows once complete, at their event time.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from prometheus_client.core import Metric

from stallwatch.correlator.eventfile import EventFileWriter
from stallwatch.correlator.hold import WindowHold
from stallwatch.correlator.metrics import CorrelatorMetrics
from stallwatch.correlator.pipeline import CorrelatorPipeline, Watermark, event_count
from stallwatch.correlator.results import NameLookup
from stallwatch.correlator.settings import CorrelatorSettings, seconds_to_ns
from stallwatch.correlator.windowfile import WindowFileWriter
from stallwatch.eventbatch import DEFAULT_EXPIRE_AFTER_S, EventBatch, Interner
from stallwatch.prices import Prices

log = logging.getLogger(__name__)

DEFAULT_BACKLOG_EVENTS = 200_000  # 1 s at 4x the nominal 50k events/s; about 10 MB of columns


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to call
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _return_freed_memory() -> None:
    """After a window close, hand the heap's free pages back to the system.

    A close frees the closed window's steps, its context copy and its working arrays, allocated and
    freed on this thread while the receiver allocates batches on its own: without a trim, glibc keeps
    the freed pages (measured: about 14 MiB of RSS at nominal load).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class LiveCorrelator:
    """The pipeline fed live by the agent's collectors, on a thread of its own; a collector itself."""

    per_scraper = True  # each scraper gets every window (stallwatch.scraper): scrapes share no call

    def __init__(
        self,
        settings: CorrelatorSettings | None = None,
        *,
        job_names: NameLookup = str,
        spokes: Interner | None = None,
        windows_path: str | Path | None = None,
        events_path: str | Path | None = None,
        rank_limit: int = 64,
        expire_after_s: float | None = DEFAULT_EXPIRE_AFTER_S,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        tick_s: float = 0.1,
        max_backlog_events: int = DEFAULT_BACKLOG_EVENTS,
        start: bool = True,
        prices: Prices | None = None,
        gpu_names: Callable[[int], str] = lambda gpu: "",
    ) -> None:
        self.settings = settings or CorrelatorSettings()
        self.metrics = CorrelatorMetrics(job_names, spokes, rank_limit, expire_after_s, prices=prices,
                                         gpu_names=gpu_names, dataset_bytes=self.settings.dataset_bytes)
        self._window_file = WindowFileWriter(windows_path, job_names) if windows_path else None
        self._events = EventFileWriter(events_path) if events_path else None
        self.hold = WindowHold(self.settings.retention_s, [self.metrics.publish]
                               + ([self._window_file.write] if self._window_file else []))
        self.correlator = CorrelatorPipeline(self.settings, listeners=[self.hold.add, self.metrics.observe],
                                             event_time_watermark=False)
        self._clock_ns = clock_ns
        self._tick_s = tick_s
        self._max_backlog = max_backlog_events
        self._lock = threading.Lock()
        self._queue: list[EventBatch] = []
        self._queued_events = 0
        self._dropped: Counter[tuple[str, str]] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="stallwatch-correlator", daemon=True)
            self._thread.start()

    def submit(self, batch: EventBatch) -> None:
        """The agent's batch sink: never blocks beyond a list append, never raises."""
        rows = event_count(batch)
        with self._lock:
            if self._queued_events + rows > self._max_backlog:
                self._dropped[(batch.kind, "backlog")] += rows
                return
            self._queue.append(batch)
            self._queued_events += rows

    def drain(self) -> None:
        """Feed what is queued into the pipeline, then close the windows the clock has passed."""
        with self._lock:
            queue, self._queue, self._queued_events = self._queue, [], 0
        for batch in queue:
            if self._events is not None:
                self._events.write(batch)
            self.correlator.emit(batch)
        closed_until = self.correlator.windows.closed_until
        self.correlator.emit(Watermark(self._clock_ns() - seconds_to_ns(self.settings.lateness_s)))
        if self.correlator.windows.closed_until != closed_until:
            _return_freed_memory()
        dropped = self._dropped_snapshot()
        self.metrics.set_losses(self.correlator.windows.late, dropped, self._record_errors())

    def _dropped_snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            dropped = dict(self._dropped)
        for kind, events in self.correlator.malformed.items():
            dropped[(kind, "malformed")] = events
        for kind, events in self.correlator.windows.shed.items():
            dropped[(kind, "window_full")] = events
        return dropped

    def _record_errors(self) -> dict[tuple[str, str], int]:
        recorders = (("events", self._events), ("windows", self._window_file))
        return {(name, reason): count for name, recorder in recorders if recorder is not None and recorder.file
                for reason, count in recorder.file.errors.items()}

    def _run(self) -> None:
        while not self._stop.wait(self._tick_s):
            try:
                self.drain()
            except Exception:  # a bug here must not stop the thread: metrics would freeze
                log.exception("correlator: a drain failed")

    def collect(self) -> list[Metric]:
        return list(self.metrics.collect())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.hold.flush()  # what is held goes to the window file
        for closer in (self._window_file, self._events):
            if closer is not None:
                closer.close()
