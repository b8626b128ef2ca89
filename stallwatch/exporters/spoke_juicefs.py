"""The `spoke_juicefs` collector: a JuiceFS mount whose local block cache is the spoke, its object store the hub.

Two of the mount's special files are the sources, so nothing needs configuring on the JuiceFS side:

- `MOUNT/.accesslog` streams one line per FUSE operation (its end time, pid and duration) to whoever holds
  it open, and drops lines when that reader falls 10240 lines behind. A background thread opens and
  reads it (a read returns within about a second, `#` when nothing happened), so neither startup nor a
  scrape waits on the mount. Each `read` of a file becomes one `spoke_request` row keyed like the
  client's captured read of the same file and offset: the path is rebuilt from the `lookup`, `create`,
  `mkdir` and `mknod` lines naming each inode under its parent (inode 1 is the mount point).
- `MOUNT/.stats` holds the mount's counters as `name value` lines; each scrape maps them with the
  built-in JuiceFS mapping of `spoke_openmetrics` (block cache hits and misses, their bytes, evictions,
  cache size, object request errors). `.stats` has no histogram buckets, so no hub fetch histogram.

JuiceFS does not say per read whether the block cache served it. A read that missed waited for a GET from
the object store, a round trip to the hub; a block cache read is local. So a read is a miss when it lasted
at least `miss_fraction` of the mean GET time of the last `.stats` interval that had GETs, and a hit
otherwise (before the mount's first GET no block can have come from the hub). The kernel's page cache
answers repeated reads of a file without any FUSE read: those client reads find no row and are split by
the correlator's latency split, where they fall among the hits.
"""

from __future__ import annotations

import argparse
import calendar
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric

from stallwatch.client.keys import read_key
from stallwatch.correlator.wallclock import wall_offset_ns
from stallwatch.eventbatch import EventBatch, EventSink, Verdict, discard
from stallwatch.exporters.collector import CollectorContext, SourceUnavailableError, register_collector
from stallwatch.exporters.openmetrics_mapping import SourceMapping, load_mapping, mapping_text
from stallwatch.exporters.openmetrics_scrape import ScrapeError
from stallwatch.exporters.spokes import collector_errors
from stallwatch.flags import positive_float

log = logging.getLogger(__name__)

ROOT_INODE = 1
INTERNAL_INODES = 0x7FFFFFFF00000000  # .accesslog, .stats, .config and the like: never dataset files
MAX_LINE_BYTES = 64 << 10
READ_BYTES = 256 << 10
GET_COUNT = "juicefs_object_request_durations_histogram_seconds_GET_total"
GET_SUM = "juicefs_object_request_durations_histogram_seconds_GET_sum"
ZONE_STEP_S = 900  # time zones are whole quarter hours from UTC
# Inodes whose names are kept, the least recently looked up forgotten first (about 250 bytes each): the kernel
# looks a path up again once its entry times out (JuiceFS's --entry-cache, 1 s), so a forgotten one comes back.
MAX_INODES = 200_000

_STAMP = r"(?P<stamp>\d{4}\.\d\d\.\d\d \d\d:\d\d:\d\d\.\d{6}) \[[^\]]*\] "
# read (inode,size,offset,fh): (bytes) - OK <seconds>
READ = re.compile(_STAMP + r"read \((?P<inode>\d+),\d+,(?P<offset>\d+),\d+\): \(?(?P<bytes>\d+)\)? - "
                  r"(?P<status>.*) <(?P<seconds>\d+\.\d+)>")
# lookup (parent,name): (inode,[attributes]) - OK; create, mkdir and mknod add the mode after the name.
ENTRY = re.compile(_STAMP + r"(?:lookup|create|mkdir|mknod) \((?P<parent>\d+),(?P<name>.*?)(?:,\S{10}:0\d+)?\): "
                   r"\((?P<inode>\d+),\[[^\]]*\]\)(?: \[fh:\d+\])? - OK <")


@dataclass(frozen=True)
class FuseRead:
    inode: int
    offset: int
    bytes: int
    local_ns: int  # the end, as wall time read in the mount's time zone
    duration_ns: int


def local_stamp_ns(stamp: str) -> int:
    """`2026.12.05 10:40:42.316346` (JuiceFS writes its own local time, no zone) -> ns as if it were UTC."""
    fields = (stamp[0:4], stamp[5:7], stamp[8:10], stamp[11:13], stamp[14:16], stamp[17:19])
    seconds = calendar.timegm(tuple(int(field) for field in fields))  # fixed widths: faster than strptime
    return seconds * 1_000_000_000 + int(stamp[20:26]) * 1000


def stats_values(text: str) -> dict[str, float]:
    """`.stats` as {name: value}; lines that are not `name number` are skipped."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


class JuiceFSSpokeCollector:
    def __init__(
        self,
        mount: str,
        spoke: str = "juicefs",
        *,
        spoke_id: int = 0,
        sink: EventSink = discard,
        miss_fraction: float = 0.5,
        retry_s: float = 1.0,
        wall_ns: Callable[[], int] = time.time_ns,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._mount = os.path.abspath(mount)
        self._spoke, self._spoke_id, self._sink = spoke, spoke_id, sink
        self._miss_fraction, self._retry_s = miss_fraction, retry_s
        self._wall_ns, self._monotonic_ns = wall_ns, monotonic_ns
        text, origin = mapping_text("juicefs")
        self._mapping = SourceMapping(load_mapping(text, origin))
        self._lock = threading.Lock()  # the error counts, shared with scrapes; the rest is the follower thread's
        self._errors: Counter[str] = Counter()
        self._entries: dict[int, tuple[int, str]] = {}  # inode -> (parent inode, name)
        self._gets: tuple[float, float] | None = None  # GET count and seconds at the last look
        self._get_mean_ns: float | None = None
        self._pending = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spoke-juicefs", daemon=True)
        self._thread.start()

    def collect(self) -> Iterator[Metric]:
        try:
            mapped = self._mapping.families(self._read_special(".stats"), self._spoke)
        except (OSError, ScrapeError) as error:
            self._problem(error.reason if isinstance(error, ScrapeError) else "stats_error", str(error))
            yield self._error_family()
            raise SourceUnavailableError(self._spoke) from error
        yield from mapped
        yield self._error_family()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3 * max(self._retry_s, 1.0))  # a read of the log returns within about a second

    def accept(self, chunk: bytes) -> int:
        """Account what the log gave (called by the one thread that follows it); returns how many reads became
        rows."""
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > MAX_LINE_BYTES:
            self._problem("oversize_line", f"a line over {MAX_LINE_BYTES} bytes")
            self._pending = b""
        reads = [read for line in lines if (read := self._parse(line.decode("utf-8", "replace")))]
        if not reads:
            return 0
        self._learn_get_time()
        rows = [(read, path) for read in reads if (path := self._path(read.inode)) is not None]
        if len(rows) < len(reads):
            self._problem("unknown_inode", "reads of files whose lookup was not seen", len(reads) - len(rows))
        if rows:
            self._sink(self._batch(rows))
        return len(rows)

    def _parse(self, line: str) -> FuseRead | None:
        """A read of a dataset file; entry lines are remembered; any other operation is passed over."""
        if " read (" in line:
            match = READ.fullmatch(line)
            if match is None:
                self._problem("malformed_line", line)
                return None
            inode, size, seconds = int(match["inode"]), int(match["bytes"]), float(match["seconds"])
            if inode >= INTERNAL_INODES or match["status"] != "OK":
                return None
            if not (size < 2**63 and seconds < 2**33):  # the batch's columns are int64 (ns)
                self._problem("malformed_line", line)
                return None
            return FuseRead(inode, int(match["offset"]), size, local_stamp_ns(match["stamp"]), round(seconds * 1e9))
        if (entry := ENTRY.match(line)) is not None:
            inode = int(entry["inode"])
            self._entries.pop(inode, None)  # to the end: the most recently looked up
            self._entries[inode] = (int(entry["parent"]), entry["name"])
            if len(self._entries) > MAX_INODES:
                del self._entries[next(iter(self._entries))]
        return None

    def _path(self, inode: int) -> str | None:
        parts: list[str] = []
        while inode != ROOT_INODE:
            entry = self._entries.get(inode)
            if entry is None or len(parts) > 255:  # never seen, or a loop left by a rename
                return None
            inode, name = entry
            parts.append(name)
        return os.path.join(self._mount, *reversed(parts))

    def _learn_get_time(self) -> None:
        """The mean duration of the object store GETs since the last look, kept while there were none. Read
        after the log lines arrive, so the GETs of the reads in them are counted."""
        try:
            stats = stats_values(self._read_special(".stats").decode("utf-8", "replace"))
        except OSError as error:
            self._problem("stats_error", str(error))
            return
        gets = stats.get(GET_COUNT, 0.0), stats.get(GET_SUM, 0.0)
        if self._gets is not None and gets[0] > self._gets[0]:
            self._get_mean_ns = (gets[1] - self._gets[1]) / (gets[0] - self._gets[0]) * 1e9
        elif self._gets is None and gets[0] > 0:
            self._get_mean_ns = gets[1] / gets[0] * 1e9
        self._gets = gets

    def _verdict(self, duration_ns: int) -> Verdict:
        if self._get_mean_ns is None or duration_ns < self._miss_fraction * self._get_mean_ns:
            return Verdict.HIT
        return Verdict.MISS

    def _batch(self, rows: list[tuple[FuseRead, str]]) -> EventBatch:
        # The log's times are the mount's local time: its zone is what they differ from now, in whole quarter
        # hours (lines arrive within about a second). Sampled once per batch, as spoke_nginx does its offset.
        now = self._wall_ns()
        step = ZONE_STEP_S * 1_000_000_000
        zone = round((rows[-1][0].local_ns - now) / step) * step
        offset = wall_offset_ns(wall_ns=self._wall_ns, monotonic_ns=self._monotonic_ns)
        return EventBatch.of("spoke_request", {
            "spoke": [self._spoke_id] * len(rows),
            "key": [read_key(path, read.offset) for read, path in rows],
            "bytes": [read.bytes for read, _ in rows],
            "end_ns": [read.local_ns - zone - offset for read, _ in rows],
            "duration_ns": [read.duration_ns for read, _ in rows],
            "upstream_ns": [-1] * len(rows),  # JuiceFS does not log its object requests
            "verdict": [self._verdict(read.duration_ns) for read, _ in rows],
        })

    def _read_special(self, name: str) -> bytes:
        return Path(self._mount, name).read_bytes()

    def _run(self) -> None:
        path = os.path.join(self._mount, ".accesslog")
        while not self._stop.is_set():
            try:
                descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as error:
                self._problem("accesslog_error", f"cannot open {path}: {error}")
                self._stop.wait(self._retry_s)
                continue
            try:
                self._follow(descriptor)
            finally:
                os.close(descriptor)

    def _follow(self, descriptor: int) -> None:
        """Read the open log until stopped or it fails (the mount went away): then it is opened again."""
        while not self._stop.is_set():
            try:
                chunk = os.read(descriptor, READ_BYTES)
            except OSError as error:
                self._problem("accesslog_error", f"cannot read the access log: {error}")
                self._stop.wait(self._retry_s)
                return
            if not chunk:
                self._stop.wait(self._retry_s)
                return
            try:
                self.accept(chunk)
            except Exception:  # one bad chunk must not end the thread
                log.exception("spoke %s: a chunk of the access log failed", self._spoke)

    def _problem(self, reason: str, detail: str, count: int = 1) -> None:
        with self._lock:
            first = not self._errors[reason]
            self._errors[reason] += count
        if first:
            log.warning("spoke %s: %s: %s (counted from now on)", self._spoke, reason, detail)

    def _error_family(self) -> Metric:
        with self._lock:
            return collector_errors(self._spoke, self._errors)


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--spoke_juicefs.mount", dest="spoke_juicefs_mount", default="/jfs", metavar="PATH",
                       help="the JuiceFS mount point, as the training jobs open its files (default: %(default)s)")
    group.add_argument("--spoke_juicefs.name", dest="spoke_juicefs_name", default="juicefs", metavar="NAME",
                       help="the spoke label of its metrics (default: %(default)s)")
    group.add_argument("--spoke_juicefs.miss-fraction", dest="spoke_juicefs_miss_fraction", type=positive_float,
                       default=0.5, metavar="FRACTION", help="a read lasting this share of the mean object store "
                       "GET or more waited on the hub (default: %(default)s)")


def _from_context(context: CollectorContext) -> JuiceFSSpokeCollector:
    options = context.options
    return JuiceFSSpokeCollector(
        options.spoke_juicefs_mount,
        options.spoke_juicefs_name,
        spoke_id=context.spokes.intern(options.spoke_juicefs_name),
        sink=context.sink,
        miss_fraction=options.spoke_juicefs_miss_fraction,
    )


register_collector("spoke_juicefs", False, "JuiceFS mount's block cache, from its .accesslog and .stats",
                   _from_context, _add_arguments)
