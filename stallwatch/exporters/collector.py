"""The collector framework, after node_exporter: one failing collector never breaks a scrape.

A collector module calls `register_collector()` at import with its name, whether it is on by default,
its own flags and a factory. The agent turns that table into `--collector.NAME` / `--no-collector.NAME`
flags, builds the enabled collectors, and exposes them through one `ScrapeCollector` that times each
one and reports `stallwatch_scrape_collector_{duration_seconds,success}`. A collector that consumes
the others' event batches (the correlator) registers with `register_event_consumer()` instead: the
agent builds it before the rest and makes its `submit` the sink of every other collector's context.
"""

from __future__ import annotations

import argparse
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector as PromCollector

from stallwatch import catalogue
from stallwatch.eventbatch import EventBatch, EventSink, Interner, discard
from stallwatch.exporters.gpu_directory import GpuDirectory
from stallwatch.scraper import SCRAPER

log = logging.getLogger(__name__)


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...

    def close(self) -> None: ...


class EventConsumer(Collector, Protocol):
    @property
    def submit(self) -> EventSink:
        """Takes one batch from any collector's thread: never blocks, never raises."""


@dataclass(frozen=True)
class CollectorContext:
    """What the agent hands every collector factory: parsed options and the correlator's input.

    `jobs` and `spokes` turn training-job and spoke names into the small ids batches carry; the agent
    hands every collector the same two, so the correlator reads names back from what the receiver and
    the spoke collectors interned. `gpus` is what the gpu collector learns of the node's GPU UUIDs,
    for the receiver to map clients' GPUs to NVML indices.
    """

    options: argparse.Namespace
    sink: EventSink
    jobs: Interner = field(default_factory=Interner)
    spokes: Interner = field(default_factory=Interner)
    gpus: GpuDirectory = field(default_factory=GpuDirectory)


Factory = Callable[[CollectorContext], Collector]
ConsumerFactory = Callable[[CollectorContext], EventConsumer]
AddArguments = Callable[[argparse._ArgumentGroup], None]


@dataclass(frozen=True)
class CollectorSpec:
    name: str
    default_enabled: bool
    description: str
    factory: Factory
    add_arguments: AddArguments | None = None
    consumer: ConsumerFactory | None = None  # set for an event consumer (then the same as `factory`)


_REGISTRY: dict[str, CollectorSpec] = {}


def fan_out(sinks: Sequence[EventSink]) -> EventSink:
    """One sink handing each batch to all of `sinks` (none: batches are discarded)."""
    if not sinks:
        return discard
    if len(sinks) == 1:
        return sinks[0]
    every = tuple(sinks)

    def to_every(batch: EventBatch) -> None:
        for sink in every:
            sink(batch)

    return to_every


def register_collector(
    name: str,
    default_enabled: bool,
    description: str,
    factory: Factory,
    add_arguments: AddArguments | None = None,
) -> None:
    _register(CollectorSpec(name, default_enabled, description, factory, add_arguments))


def register_event_consumer(
    name: str,
    default_enabled: bool,
    description: str,
    factory: ConsumerFactory,
    add_arguments: AddArguments | None = None,
) -> None:
    """A collector fed the other collectors' event batches through its `submit`."""
    _register(CollectorSpec(name, default_enabled, description, factory, add_arguments, consumer=factory))


def _register(spec: CollectorSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"collector {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec


def registered() -> Mapping[str, CollectorSpec]:
    return dict(sorted(_REGISTRY.items()))


DEFAULT_TIMEOUT_S = 8.0  # under Prometheus's default scrape timeout of 10 s, with room to encode and send
WEDGED_DEADLINES = 3  # a call outstanding this many deadlines makes the agent unhealthy


class SourceUnavailableError(Exception):
    """Raised by a collector after yielding what it has (its error counts) when its source gave it nothing
    this time: reported as `scrape_collector_success 0` with those families served, as node_exporter tells a
    failed source from one with no data. The collector has logged why; no traceback follows."""


def collected(collector: Collector, name: str) -> tuple[list[Metric], bool]:
    """What one `collect()` gave, and whether it succeeded; a failure keeps the families yielded before it."""
    families: list[Metric] = []
    try:
        for family in collector.collect():
            families.append(family)
    except SourceUnavailableError:
        return families, False
    except Exception:
        log.exception("collector %s failed", name)
        return families, False
    return families, True


class _Call:
    """One run of a collector's `collect()`, on a daemon thread of its own (a wedged one never blocks exit)."""

    def __init__(self, name: str, collector: Collector, clock: Callable[[], float]) -> None:
        self.started = clock()
        self.finished: float | None = None
        self.families: list[Metric] = []
        self.failed = False
        self.overran = False  # a scrape gave up waiting on it (logged once)
        self._collector, self._clock = collector, clock
        self.done = threading.Event()
        # In the scrape's context: a collector may serve each scraper its own view (stallwatch.scraper).
        threading.Thread(target=contextvars.copy_context().run, args=(self._run, name), name=f"collect-{name}",
                         daemon=True).start()

    def _run(self, name: str) -> None:
        self.families, succeeded = collected(self._collector, name)
        self.failed = not succeeded
        self.finished = self._clock()
        self.done.set()


class ScrapeCollector(PromCollector):
    """Runs every enabled collector on each scrape, isolating failures, and reports on each one.

    The collectors run side by side, each on a thread of its own, under one deadline (`timeout_s`):
    one that overruns it is reported failed (`scrape_collector_success 0`) and the rest are served.
    A collector has at most one call at a time: a scrape that finds one still running (a concurrent
    scrape's, or one that overran) waits on it rather than start another, so a collector wedged on a
    hung file system holds one thread however many scrapes come. A call running for `WEDGED_DEADLINES`
    deadlines makes `wedged()` name the collector, for the health check.
    """

    def __init__(self, collectors: Mapping[str, Collector], clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self._collectors = dict(collectors)
        self._clock = clock
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, str], _Call] = {}  # each collector's latest call, by (name, scraper)

    def collect(self) -> Iterator[Metric]:
        duration = catalogue.SCRAPE_COLLECTOR_DURATION.family()
        success = catalogue.SCRAPE_COLLECTOR_SUCCESS.family()
        deadline = self._clock() + self._timeout_s
        calls = self._start_calls()
        for name, call in calls.items():
            on_time = call.done.wait(max(deadline - self._clock(), 0.0))
            if not on_time and not call.overran:
                call.overran = True
                log.warning("collector %s overran its deadline of %g s; reported failed until it answers",
                            name, self._timeout_s)
            ended = call.finished if on_time and call.finished is not None else self._clock()
            duration.add_metric([name], ended - call.started)
            success.add_metric([name], 0.0 if call.failed or not on_time else 1.0)
            if on_time:
                yield from call.families
        yield duration
        yield success

    def _start_calls(self) -> dict[str, _Call]:
        """Each collector's call: the one still running, else a new one. A collector that serves each scraper
        a view of its own (`per_scraper`) shares a running call only with the same scraper's scrapes."""
        scraper = SCRAPER.get()
        with self._lock:
            self._calls = {key: call for key, call in self._calls.items() if not key[1] or not call.done.is_set()}
            calls = {}
            for name, collector in self._collectors.items():
                key = (name, scraper if getattr(collector, "per_scraper", False) else "")
                running = self._calls.get(key)
                if running is None or running.done.is_set():
                    running = self._calls[key] = _Call(name, collector, self._clock)
                calls[name] = running
            return calls

    def wedged(self) -> list[str]:
        """Collectors whose call has been running for `WEDGED_DEADLINES` deadlines or more."""
        now = self._clock()
        with self._lock:
            return sorted({name for (name, _), call in self._calls.items()
                          if not call.done.is_set() and now - call.started >= WEDGED_DEADLINES * self._timeout_s})

    def close(self) -> None:
        """Close every collector, each given one deadline: a wedged one must not hold up the agent's exit."""
        for name, collector in self._collectors.items():
            closing = threading.Thread(target=_close, args=(name, collector), name=f"close-{name}", daemon=True)
            closing.start()
            closing.join(self._timeout_s)
            if closing.is_alive():
                log.warning("collector %s did not close within %g s; left behind", name, self._timeout_s)


def _close(name: str, collector: Collector) -> None:
    try:
        collector.close()
    except Exception:
        log.exception("collector %s: close failed", name)
