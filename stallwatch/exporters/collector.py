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
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import Collector as PromCollector

from stallwatch import catalogue
from stallwatch.eventbatch import EventBatch, EventSink, Interner, discard
from stallwatch.exporters.gpu_directory import GpuDirectory

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


class ScrapeCollector(PromCollector):
    """Runs every enabled collector on each scrape, isolating failures, and reports on each one."""

    def __init__(self, collectors: Mapping[str, Collector], clock: Callable[[], float] = time.perf_counter):
        self._collectors = dict(collectors)
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        duration = catalogue.SCRAPE_COLLECTOR_DURATION.family()
        success = catalogue.SCRAPE_COLLECTOR_SUCCESS.family()
        for name, collector in self._collectors.items():
            start = self._clock()
            try:
                families = list(collector.collect())
            except Exception:
                log.exception("collector %s failed", name)
                families, ok = [], 0.0
            else:
                ok = 1.0
            duration.add_metric([name], self._clock() - start)
            success.add_metric([name], ok)
            yield from families
        yield duration
        yield success

    def close(self) -> None:
        for collector in self._collectors.values():
            try:
                collector.close()
            except Exception:
                log.exception("collector close failed")
