"""The `hub_probe` collector: an active probe from the node to each spoke's hub, so the spoke dashboard
shows hub latency even while nothing misses (a cache that hits never asks the hub).

Each target is `SPOKE=URL` (http or https). Once per `--hub_probe.interval` a background thread probes
the targets side by side, one thread each, so a slow hub delays no other: each probe resolves the host
(not timed), opens a TCP connection (phase `connect`: the handshake, one network round trip) and sends
one small request on it (phase `http`: the TLS handshake if any, then request sent to response
headers): `HEAD`, or with `--hub_probe.method range` a `GET` of the first byte (`Range: bytes=0-0`) for
hubs that refuse HEAD. `--hub_probe.timeout` is one deadline over the whole probe, so a hub that
trickles its answer fails by then (`timeout`). Any HTTP answer measures the latency; one that is not
2xx also counts as a failure (`status`): a redirect is not followed, and the hub did not answer.

Scrapes read the last results and never wait on the network. The rate is bounded: the interval is at
least 1 s, one probe per hub is in flight at a time, a round that overruns the interval delays the next
one instead of overlapping it, and at most 64 bytes of a body are read.
"""

from __future__ import annotations

import argparse
import http.client
import logging
import ssl
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client.core import Metric

from stallwatch import catalogue, outbound
from stallwatch.exporters.collector import CollectorContext, register_collector
from stallwatch.exporters.config import ConfigError
from stallwatch.flags import positive_float

log = logging.getLogger(__name__)

MIN_INTERVAL_SECONDS = 1.0
MAX_BODY_BYTES = 64
USER_AGENT = "stallwatch-hub-probe"


@dataclass(frozen=True)
class Target:
    spoke: str
    url: str

    @property
    def parts(self) -> urllib.parse.SplitResult:
        return urllib.parse.urlsplit(self.url)


def parse_target(text: str) -> Target:
    """Flag type: `SPOKE=URL` with an http or https URL."""
    spoke, sep, url = text.partition("=")
    parts = urllib.parse.urlsplit(url)
    if not sep or not spoke or parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected SPOKE=http(s)://HUB[:PORT]/PATH, got {text!r}")
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from error
    return Target(spoke, url)


def probe_interval(text: str) -> float:
    value = float(text)
    if value < MIN_INTERVAL_SECONDS:
        raise argparse.ArgumentTypeError(f"must be >= {MIN_INTERVAL_SECONDS:g} s (probes are rate-bounded), got {text}")
    return value


class ProbeError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class ProbeResult:
    durations: dict[str, float]  # phase -> seconds, for the phases that completed
    failure: ProbeError | None = None


def probe(target: Target, method: str, timeout: float, tls: ssl.SSLContext,
          clock: Callable[[], float] = time.perf_counter) -> ProbeResult:
    """One probe of one hub, within one deadline of `timeout`: the connect and http phases' durations, and what
    failed, if anything."""
    parts = target.parts
    deadline = outbound.Deadline(timeout)
    durations: dict[str, float] = {}
    try:
        sock, durations["connect"] = outbound.connect(parts.hostname or "",
                                                      parts.port or (443 if parts.scheme == "https" else 80),
                                                      deadline, clock)
        start = clock()
        headers = {"User-Agent": USER_AGENT} | ({"Range": "bytes=0-0"} if method == "range" else {})
        with outbound.send(sock, parts, "GET" if method == "range" else "HEAD", headers, deadline, tls) as response:
            durations["http"] = clock() - start
            response.read(MAX_BODY_BYTES)
    except TimeoutError:
        return ProbeResult(durations, ProbeError("timeout", f"no complete answer within {timeout:g} s"))
    except ssl.SSLError as error:  # before OSError: an unverified certificate, a failed handshake
        return ProbeResult(durations, ProbeError("tls", f"TLS failed: {error}"))
    except http.client.HTTPException as error:
        return ProbeResult(durations, ProbeError("protocol", f"not an HTTP answer: {error!r}"))
    except OSError as error:  # no such host, refused or unreachable; after connecting, the hub broke off
        reason = "protocol" if "connect" in durations else "connect"
        return ProbeResult(durations, ProbeError(reason, f"{reason} failed: {error}"))
    if not 200 <= response.status < 300:  # a redirect too: it is not followed, the hub did not answer the probe
        return ProbeResult(durations, ProbeError("status", f"HTTP {response.status} {response.reason}"))
    return ProbeResult(durations)


class HubProbeCollector:
    def __init__(self, targets: Sequence[Target], *, interval: float = 15.0, timeout: float = 5.0,
                 method: str = "head", tls: ssl.SSLContext | None = None, start: bool = True,
                 clock: Callable[[], float] = time.monotonic, pause: Callable[[float], bool] | None = None) -> None:
        """`clock` times the rounds; `pause(seconds)` waits between them and says whether to stop (by
        default until `close()`): a test drives the schedule with both."""
        self._targets = tuple(targets)
        self._pool = ThreadPoolExecutor(max(1, len(self._targets)), thread_name_prefix="hub-probe")
        self._interval, self._timeout, self._method = max(interval, MIN_INTERVAL_SECONDS), timeout, method
        self._tls = tls or ssl.create_default_context()
        self._lock = threading.Lock()
        self._durations: dict[tuple[str, str], float] = {}
        self._success: dict[str, float] = {}
        self._failures: Counter[tuple[str, str]] = Counter()
        self._stop = threading.Event()
        self._clock, self._pause = clock, pause or self._stop.wait
        self._thread = threading.Thread(target=self._run, name="hub-probe", daemon=True)
        if start:
            self._thread.start()

    def probe_all(self) -> None:
        """One round: every target once, side by side (a slow hub delays no other), until the last is done."""
        list(self._pool.map(self._probe, self._targets))

    def _probe(self, target: Target) -> None:
        result = probe(target, self._method, self._timeout, self._tls)
        failure = result.failure
        with self._lock:
            for phase, seconds in result.durations.items():
                self._durations[(target.spoke, phase)] = seconds
            self._success[target.spoke] = 0.0 if failure else 1.0
            first = failure is not None and not self._failures[(target.spoke, failure.reason)]
            if failure is not None:
                self._failures[(target.spoke, failure.reason)] += 1
        if first:
            log.warning("hub probe of spoke %s (%s): %s (counted from now on)", target.spoke, target.url, failure)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            self.probe_all()
            if self._pause(max(0.0, self._interval - (self._clock() - started))):
                return

    def collect(self) -> Iterator[Metric]:
        c = catalogue
        duration, success = c.SPOKE_HUB_PROBE_DURATION.family(), c.SPOKE_HUB_PROBE_SUCCESS.family()
        failures = c.SPOKE_HUB_PROBE_FAILURES.family()
        with self._lock:
            for (spoke, phase), seconds in sorted(self._durations.items()):
                duration.add_metric([spoke, phase], seconds)
            for spoke, value in sorted(self._success.items()):
                success.add_metric([spoke], value)
            for (spoke, reason), count in sorted(self._failures.items()):
                failures.add_metric([spoke, reason], count)
        yield from (duration, success, failures)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._timeout)
        self._pool.shutdown(wait=False)


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--hub_probe.target", dest="hub_probe_target", type=parse_target, action="append",
                       default=[], metavar="SPOKE=URL",
                       help="a spoke and a URL on its hub to probe, e.g. spoke-a=https://hub.example/healthz "
                            "(repeat for several)")
    group.add_argument("--hub_probe.interval", dest="hub_probe_interval", type=probe_interval, default=15.0,
                       metavar="SECONDS", help="time between probes of each hub, at least 1 (default: %(default)s)")
    group.add_argument("--hub_probe.timeout", dest="hub_probe_timeout", type=positive_float, default=5.0,
                       metavar="SECONDS", help="connect and answer timeout of a probe (default: %(default)s)")
    group.add_argument("--hub_probe.method", dest="hub_probe_method", choices=["head", "range"], default="head",
                       help="HEAD, or a GET of the first byte for hubs that refuse HEAD (default: %(default)s)")


def _from_context(context: CollectorContext) -> HubProbeCollector:
    options = context.options
    if not options.hub_probe_target:
        raise ConfigError("--hub_probe.target SPOKE=URL is required: the hub of each spoke to probe")
    spokes = [t.spoke for t in options.hub_probe_target]
    if len(set(spokes)) != len(spokes):
        raise ConfigError(f"--hub_probe.target: each spoke once, got {', '.join(spokes)}")
    return HubProbeCollector(options.hub_probe_target, interval=options.hub_probe_interval,
                             timeout=options.hub_probe_timeout, method=options.hub_probe_method)


register_collector("hub_probe", False, "active TCP and HTTP probes of each spoke's hub (latency while "
                   "nothing misses)", _from_context, _add_arguments)
