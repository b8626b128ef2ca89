"""The `spoke_nginx` collector: an nginx `proxy_cache` spoke, from its access log.

Open-source nginx keeps no cache counters; the access log is the only place that says, per request,
whether the cache served it (`$upstream_cache_status`) and how long the hub took
(`$upstream_response_time`). The log must use the `stallwatch` format of docs/nginx-spoke.conf: LTSV
(`name:value` fields separated by tabs, in any order, unknown fields ignored), which nginx's default
escaping keeps unambiguous.

The log is tailed by a background thread every `--spoke_nginx.interval` seconds, so the correlator
receives `spoke_request` batches while nobody scrapes; each scrape also reads what was appended since
the last poll, so /metrics is never behind the log. Rotation, partial lines and a log that does not
exist yet are handled by `LogTailer`; every line is counted once, and every line that cannot be used
(malformed, over `--spoke_nginx.max-line-bytes`, cut off or lost by a rotation) is counted in
`stallwatch_spoke_collector_errors_total`.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.client.keys import range_start, read_key
from stallwatch.client.reads import verdict_from_cache_status
from stallwatch.correlator.wallclock import wall_offset_ns
from stallwatch.eventbatch import EventBatch, EventSink, Verdict, discard
from stallwatch.exporters.collector import CollectorContext, SourceUnavailableError, register_collector
from stallwatch.exporters.histogram import DurationHistogram
from stallwatch.exporters.logtail import DEFAULT_MAX_LINE_BYTES, LogTailer
from stallwatch.exporters.spokes import collector_errors
from stallwatch.flags import non_negative_float, positive_int

log = logging.getLogger(__name__)

# $upstream_cache_status -> the `result` label. "-" means the request did not go through a cache. Where
# the body came from (the verdict) is the client's reading of the same value, `verdict_from_cache_status`.
RESULTS = {
    "HIT": "hit", "MISS": "miss", "EXPIRED": "expired", "STALE": "stale", "UPDATING": "updating",
    "REVALIDATED": "revalidated", "BYPASS": "bypass", "-": "none",
}
REQUIRED_FIELDS = ("msec", "request_time", "status", "bytes", "cache", "upstream_time", "uri")
# The recommended log format (docs/nginx-spoke.conf carries the same directive; a test keeps them equal).
LOG_FORMAT = (
    "log_format stallwatch escape=default\n"
    "        'msec:$msec\\trequest_time:$request_time\\tstatus:$status\\tbytes:$body_bytes_sent\\t'\n"
    "        'cache:$upstream_cache_status\\tupstream_time:$upstream_response_time\\t'\n"
    "        'upstream_status:$upstream_status\\tslice:$slice_range\\trange:$http_range\\turi:$request_uri';"
)


class MalformedLineError(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class LogEntry:
    result: str
    verdict: Verdict
    status: int
    body_bytes: int
    end_wall_ns: int
    duration_ns: int
    upstream_ns: int  # -1 when the hub was not contacted
    upstream_errors: int
    key: int


def seconds_text_to_ns(text: str) -> int:
    """`1700000000.123` -> ns, exactly: nginx writes fixed decimals, floats would round."""
    whole, _, fraction = text.partition(".")
    if not whole.isdigit() or (fraction and not fraction.isdigit()):
        raise ValueError(f"not a time in seconds: {text!r}")
    return int(whole) * 1_000_000_000 + int((fraction + "000000000")[:9])


def upstream_seconds_ns(text: str) -> int:
    """Total hub time of `$upstream_response_time`: "0.010, 0.020" (two servers tried), "0.1 : 0.2"
    (an internal redirect), "-" (not contacted) -> ns, or -1 when no server answered at all."""
    total, seen = 0, False
    for raw in text.replace(":", ",").split(","):
        item = raw.strip()
        if item and item != "-":
            total += seconds_text_to_ns(item)
            seen = True
    return total if seen else -1


def upstream_error_count(text: str) -> int:
    """Servers that failed in `$upstream_status` ("502, 200" is one failure, then a success)."""
    return sum(1 for item in text.replace(":", ",").split(",") if item.strip().isdigit() and int(item) >= 500)


def parse_entry(line: str) -> LogEntry:
    fields = dict(item.split(":", 1) for item in line.split("\t") if ":" in item)
    missing = [name for name in REQUIRED_FIELDS if name not in fields]
    if missing:
        raise MalformedLineError("malformed_line", f"missing fields {', '.join(missing)}")
    result = RESULTS.get(fields["cache"])
    if result is None:
        raise MalformedLineError("unknown_cache_status", f"unknown cache status {fields['cache']!r}")
    try:
        upstream_ns = upstream_seconds_ns(fields["upstream_time"])
        end_wall_ns = seconds_text_to_ns(fields["msec"])
        duration_ns = seconds_text_to_ns(fields["request_time"])
        status, body_bytes = int(fields["status"]), int(fields["bytes"])
    except ValueError as error:
        raise MalformedLineError("malformed_line", str(error)) from error
    if not all(0 <= value < 2**63 for value in (end_wall_ns, duration_ns, upstream_ns + 1, body_bytes)):
        raise MalformedLineError("malformed_line", "a time or size out of range")  # the batch columns are int64
    verdict = Verdict(verdict_from_cache_status(fields["cache"]))
    if verdict is Verdict.UNKNOWN and upstream_ns >= 0:
        verdict = Verdict.MISS  # not cached, fetched from the hub; else answered by nginx itself
    upstream_status = fields.get("upstream_status", "-")
    errors = upstream_error_count(upstream_status) if "upstream_status" in fields else int(
        upstream_ns >= 0 and status >= 500
    )
    offset_text = fields.get("slice", "-")
    if offset_text in ("", "-"):
        offset_text = fields.get("range", "-")
    uri = fields["uri"].split("?", 1)[0]
    return LogEntry(result, verdict, status, body_bytes, end_wall_ns, duration_ns, upstream_ns, errors,
                    read_key(uri, range_start(offset_text)))


class NginxSpokeCollector:
    def __init__(
        self,
        path: str,
        spoke: str = "nginx",
        *,
        spoke_id: int = 0,
        sink: EventSink = discard,
        from_start: bool = False,
        rotate_wait: float = 5.0,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        interval: float = 1.0,
        wall_ns: Callable[[], int] = time.time_ns,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` times the rotation wait (the tailer's); `wall_ns` and `monotonic_ns` map `$msec` onto
        the events' clock."""
        self._spoke, self._spoke_id, self._sink = spoke, spoke_id, sink
        self._wall_ns, self._monotonic_ns = wall_ns, monotonic_ns
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter({result: 0 for result in RESULTS.values()})
        self._bytes = {"cache": 0, "hub": 0}
        self._hub_fetch = DurationHistogram(catalogue.SPOKE_HUB_FETCH_DURATION.buckets)
        self._hub_errors = 0
        self._errors: Counter[str] = Counter()
        self._tailer = LogTailer(path, from_start=from_start, rotate_wait=rotate_wait, max_line_bytes=max_line_bytes,
                                 on_problem=self._problem, clock=clock)
        self._unreadable = ""  # why the log could not be read at the last poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval > 0:
            self._thread = threading.Thread(target=self._run, args=(interval,), name="spoke-nginx", daemon=True)
            self._thread.start()

    def poll(self) -> int:
        """Read and account every line appended since the last poll; returns how many were used."""
        with self._lock:
            try:
                lines = self._tailer.read_lines()
            except OSError as error:
                self._problem("read_error")
                if str(error) != self._unreadable:  # once, not at every poll
                    log.warning("spoke %s: cannot read %s: %s", self._spoke, self._tailer.path, error)
                self._unreadable = str(error)
                return 0
            self._unreadable = ""
            entries: list[LogEntry] = []
            for raw in lines:
                try:
                    entries.append(parse_entry(raw.decode("utf-8", "replace")))
                except MalformedLineError as error:
                    self._problem(error.reason)
                    log.debug("spoke %s: skipped line: %s", self._spoke, error)
            for entry in entries:
                self._account(entry)
            self._hub_fetch.add(np.array([e.upstream_ns for e in entries if e.upstream_ns >= 0], dtype=np.int64))
            if entries:
                self._sink(self._batch(entries))
            return len(entries)

    def collect(self) -> Iterator[Metric]:
        self.poll()
        c, labels = catalogue, [self._spoke]
        requests, volume = c.SPOKE_REQUESTS.family(), c.SPOKE_BYTES.family()
        hub_fetch, hub_errors = c.SPOKE_HUB_FETCH_DURATION.family(), c.SPOKE_HUB_ERRORS.family()
        with self._lock:
            for result, count in sorted(self._requests.items()):
                requests.add_metric([*labels, result], count)
            for source, count in self._bytes.items():
                volume.add_metric([*labels, source], count)
            self._hub_fetch.add_to(hub_fetch, labels)
            hub_errors.add_metric(labels, self._hub_errors)
            errors = collector_errors(self._spoke, self._errors)
        yield from (requests, volume, hub_fetch, hub_errors, errors)
        if self._unreadable:
            raise SourceUnavailableError(self._unreadable)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._tailer.close()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.poll()
            except Exception:  # one bad poll must not end the thread; the next one retries
                log.exception("spoke %s: poll failed", self._spoke)

    def _problem(self, reason: str) -> None:
        if not self._errors[reason]:
            log.warning("spoke %s: %s in %s (counted from now on)", self._spoke, reason, self._tailer.path)
        self._errors[reason] += 1

    def _account(self, entry: LogEntry) -> None:
        self._requests[entry.result] += 1
        if entry.verdict is Verdict.HIT:
            self._bytes["cache"] += entry.body_bytes
        elif entry.verdict is Verdict.MISS:
            self._bytes["hub"] += entry.body_bytes
        self._hub_errors += entry.upstream_errors

    def _batch(self, entries: list[LogEntry]) -> EventBatch:
        # $msec is wall time; the stream runs on the node's monotonic clock. Sample the offset once
        # per batch so a wall-clock step moves later batches, not the order within one.
        offset = wall_offset_ns(wall_ns=self._wall_ns, monotonic_ns=self._monotonic_ns)
        return EventBatch.of("spoke_request", {
            "spoke": [self._spoke_id] * len(entries),
            "key": [e.key for e in entries],
            "bytes": [e.body_bytes for e in entries],
            "end_ns": [e.end_wall_ns - offset for e in entries],
            "duration_ns": [e.duration_ns for e in entries],
            "upstream_ns": [e.upstream_ns for e in entries],
            "verdict": [e.verdict for e in entries],
        })


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--spoke_nginx.log", dest="spoke_nginx_log", default="/var/log/nginx/stallwatch.log",
                       metavar="PATH", help="access log in the stallwatch format of docs/nginx-spoke.conf "
                       "(default: %(default)s)")
    group.add_argument("--spoke_nginx.name", dest="spoke_nginx_name", default="nginx", metavar="NAME",
                       help="the spoke label of its metrics (default: %(default)s)")
    group.add_argument("--spoke_nginx.interval", dest="spoke_nginx_interval", type=non_negative_float, default=1.0,
                       metavar="SECONDS", help="how often the log is read between scrapes (default: %(default)s)")
    group.add_argument("--spoke_nginx.rotate-wait", dest="spoke_nginx_rotate_wait", type=non_negative_float,
                       default=5.0, metavar="SECONDS", help="how long a renamed log is still read after its successor "
                       "appears (default: %(default)s)")
    group.add_argument("--spoke_nginx.max-line-bytes", dest="spoke_nginx_max_line_bytes", type=positive_int,
                       default=DEFAULT_MAX_LINE_BYTES, metavar="BYTES", help="a longer line is skipped and counted "
                       "as oversize_line; bounds the memory of a line without its end (default: %(default)s)")
    group.add_argument("--spoke_nginx.from-start", dest="spoke_nginx_from_start", default=False,
                       action=argparse.BooleanOptionalAction,
                       help="count the lines already in the log at startup (default: start at its end)")


def _from_context(context: CollectorContext) -> NginxSpokeCollector:
    options = context.options
    return NginxSpokeCollector(
        options.spoke_nginx_log,
        options.spoke_nginx_name,
        spoke_id=context.spokes.intern(options.spoke_nginx_name),
        sink=context.sink,
        from_start=options.spoke_nginx_from_start,
        rotate_wait=options.spoke_nginx_rotate_wait,
        max_line_bytes=options.spoke_nginx_max_line_bytes,
        interval=options.spoke_nginx_interval,
    )


register_collector("spoke_nginx", False, "nginx proxy_cache spoke, from its access log", _from_context,
                   _add_arguments)
