"""`stallwatch agent`: the node agent. Builds the enabled collectors and serves them to Prometheus."""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry

from stallwatch import __version__, catalogue
from stallwatch.build import revision
from stallwatch.eventbatch import EventSink, discard

# Importing a collector module registers it by name.
from stallwatch.exporters import (  # noqa: F401
    correlator_collector,
    events,
    gpu,
    host,
    hub_probe,
    pods,
    spoke_juicefs,
    spoke_nfs,
    spoke_nginx,
    spoke_openmetrics,
    spoke_qumulo,
    spoke_varnish,
)
from stallwatch.exporters.collector import (
    Collector,
    CollectorContext,
    CollectorSpec,
    ScrapeCollector,
    SourceUnavailableError,
    fan_out,
    registered,
)
from stallwatch.exporters.config import ConfigError, ignored_settings, log_level, parse, parse_listen_address
from stallwatch.exporters.logformat import configure as configure_logging
from stallwatch.exporters.web import MetricsServer
from stallwatch.exporters.web_config import WebConfig, load_web_config

log = logging.getLogger("stallwatch.agent")

GIL_SWITCH_INTERVAL_S = 0.0005
SETUP_DEADLINE_S = 3.0  # a collector's set-up reads its files and flags: well under this when none blocks


class _BuildInfo:
    def collect(self) -> Iterator[Metric]:
        family = catalogue.BUILD_INFO.family()
        family.add_metric([__version__, revision()], 1)
        yield family


class _SettingUp:
    """A collector whose set-up outlasted `SETUP_DEADLINE_S` (a file of its that blocks: a FIFO, a hung mount):
    reported failed, and named by the health check, until the set-up ends; the collector it made from then on.
    Start-up and the web server never wait on it."""

    def __init__(self, name: str, started: float) -> None:
        self.name, self._started = name, started
        self.made: list[Collector | Exception] = []  # appended by the set-up's thread when it ends
        self._said = False

    def _collector(self) -> Collector | None:
        made = self.made[0] if self.made else None
        if isinstance(made, Exception) and not self._said:
            log.error("collector %s: set-up failed: %s", self.name, made)
            self._said = True
        return made if made is not None and not isinstance(made, Exception) else None

    def collect(self) -> Iterator[Metric]:
        collector = self._collector()
        if collector is None:
            raise SourceUnavailableError(self.name)
        yield from collector.collect()

    def problems(self) -> list[str]:
        if self.made:
            return [] if self._collector() is not None else ["its set-up failed"]
        return [f"still setting up after {time.monotonic() - self._started:.0f} s"]

    def close(self) -> None:
        collector = self._collector()
        if collector is not None:
            collector.close()


def _made(spec: CollectorSpec, context: CollectorContext) -> Collector:
    """The spec's collector, or a `_SettingUp` one when it is not made within `SETUP_DEADLINE_S`."""
    waiting = _SettingUp(spec.name, time.monotonic())

    def make() -> None:
        try:
            waiting.made.append(spec.factory(context))
        except Exception as error:  # raised below, or logged by `_SettingUp`
            waiting.made.append(error)

    thread = threading.Thread(target=make, name=f"setup-{spec.name}", daemon=True)
    thread.start()
    thread.join(SETUP_DEADLINE_S)
    if not waiting.made:
        log.warning("collector %s: still setting up after %g s (a file of its that blocks?): reported failed "
                    "until it is done", spec.name, SETUP_DEADLINE_S)
        return waiting
    made = waiting.made[0]
    if isinstance(made, Exception):
        raise made
    return made


def _build(specs: Sequence[CollectorSpec], context: CollectorContext) -> dict[str, Collector]:
    """The collectors, event consumers first: their `submit` is every other collector's sink.

    A file named by a flag that is missing or malformed is a ConfigError, once what was built is closed.
    """
    collectors: dict[str, Collector] = {}
    sinks: list[EventSink] = []
    try:
        for spec in specs:
            if spec.consumer is not None:
                consumer = spec.consumer(context)
                collectors[spec.name] = consumer
                sinks.append(consumer.submit)
        context = dataclasses.replace(context, sink=fan_out(sinks))
        for spec in specs:
            if spec.consumer is None:
                collectors[spec.name] = _made(spec, context)
    except (ConfigError, OSError, ValueError) as error:
        ScrapeCollector(collectors).close()
        raise ConfigError(f"collector {spec.name}: {error}") from error
    return collectors


@runtime_checkable
class _ReportsProblems(Protocol):
    def problems(self) -> list[str]: ...


def _problems(scrape: ScrapeCollector, collectors: Mapping[str, Collector]) -> list[str]:
    """Why /-/healthy fails: collectors wedged past their deadlines, and what a collector says of its own
    source (`problems()`: the events receiver's relay that does not run)."""
    wedged = scrape.wedged()
    found = [f"wedged collectors: {', '.join(wedged)}"] if wedged else []
    for name, collector in collectors.items():
        if isinstance(collector, _ReportsProblems):
            found += [f"{name}: {problem}" for problem in collector.problems()]
    return found


def main(argv: Sequence[str]) -> int:
    specs = registered()
    try:
        options = parse(argv, specs)
        web_config = load_web_config(options.web_config_file) if options.web_config_file else WebConfig()
    except ConfigError as error:
        print(f"stallwatch agent: error: {error}", file=sys.stderr)
        return 2
    configure_logging(log_level(options.log_level), options.log_format)
    # The events receive thread must get the GIL within a fraction of a millisecond of a datagram: the
    # kernel may queue only ten (`net.unix.max_dgram_qlen`), and at the default 5 ms a scrape or a
    # window close holds it for longer than clients take to fill the queue (measured in docs/benchmarks.md).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # Our collectors name their metrics only when collected: `name[]` must still reach them.
    registry = CollectorRegistry(support_collectors_without_names=True)
    host_name, port = parse_listen_address(options.web_listen_address)
    try:  # bind first: a taken port fails before any collector starts a thread
        server = MetricsServer(registry, host_name, port, options.web_telemetry_path, web_config)
    except OSError as error:
        print(f"stallwatch agent: error: cannot listen on {options.web_listen_address}: {error.strerror}",
              file=sys.stderr)
        return 2
    enabled = [spec for name, spec in specs.items() if getattr(options, f"collector_{name}")]
    try:
        collectors = _build(enabled, CollectorContext(options=options, sink=discard))
    except ConfigError as error:
        print(f"stallwatch agent: error: {error}", file=sys.stderr)
        server.close()
        return 2
    log.info("collectors enabled: %s", ", ".join(collectors) or "none")
    for line in ignored_settings(options, specs):
        log.warning("%s", line)
    scrape = ScrapeCollector(collectors, timeout_s=options.collector_timeout)
    server.report_problems(lambda: _problems(scrape, collectors))
    registry.register(scrape)
    registry.register(_BuildInfo())
    server.start()
    log.info("listening on %s", server.url)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    server.close()
    scrape.close()
    return 0
