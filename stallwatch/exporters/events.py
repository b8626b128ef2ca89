"""The `events` collector: the receiver for training clients' batches (`stallwatch.client`).

Two threads keep the socket drained, which matters where the kernel queues only ten datagrams
(`net.unix.max_dgram_qlen`): the receive thread only receives and queues raw batches (bounded by
`--events.queue-limit` events; past it whole batches are dropped and counted), the processing thread
decodes and validates them (`events_decode`), aggregates the histograms and counters with NumPy one
batch at a time, and hands the records to the correlator as `step` and `read` batches (columns in
`stallwatch.batch`).

Cardinality: clients choose job names and ranks, so both are capped per node. Job names past
`--events.job-limit` fold into `__other__`; (job, rank) series past `--events.rank-limit` fold into
the rank `__other__` of their job, so the loader series stay under (rank limit + job limit + 1) label
pairs whatever clients send; `stallwatch_receiver_folded_label_values_total{label}` counts the folds.
The correlator still gets every record with its real rank.

Permissions: the socket is the only way in (no network listener); it is created with mode 0660 and,
with `--events.socket-group`, owned by that group, so only the agent's user and that group's
training processes can send. A missing directory is created 0750 with the same group: group members
can reach the socket, nobody else can, and only the agent can create files there.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import logging
import os
import socket
import stat
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
from prometheus_client.core import HistogramMetricFamily, Metric

from stallwatch import catalogue
from stallwatch.batch import OVERFLOW, Batch, BatchSink, Interner, discard
from stallwatch.client import wire
from stallwatch.client.transport import DEFAULT_SOCKET
from stallwatch.exporters.collector import CollectorContext, register_collector
from stallwatch.exporters.config import positive_int
from stallwatch.exporters.events_decode import Decoded, RejectedBatchError, decode, peek_events

log = logging.getLogger(__name__)

RECEIVE_BUFFER = 1 << 18  # larger than any batch a client sends (wire.MAX_EVENTS records)
SOCKET_RCVBUF = 4 << 20
POLL_SECONDS = 0.25
VERDICT_LABELS = {wire.VERDICT_UNKNOWN: "unknown", wire.VERDICT_HIT: "hit", wire.VERDICT_MISS: "miss"}
_BOUNDS = catalogue.LATENCY_BUCKETS
_BOUNDS_NS = np.array([round(bound * 1e9) for bound in _BOUNDS], dtype=np.int64)


@dataclass
class _Histogram:
    counts: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(len(_BOUNDS) + 1, np.int64))
    sum_ns: int = 0

    def add(self, durations_ns: npt.NDArray[np.int64]) -> None:
        if len(durations_ns):
            # bucket i counts bounds[i-1] < d <= bounds[i], Prometheus's `le`; the last one is +Inf.
            self.counts += np.bincount(np.searchsorted(_BOUNDS_NS, durations_ns), minlength=len(_BOUNDS) + 1)
            self.sum_ns += int(durations_ns.sum())

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative = np.cumsum(self.counts)
        buckets = [(repr(bound), float(count)) for bound, count in zip(_BOUNDS, cumulative[:-1], strict=True)]
        buckets.append(("+Inf", float(cumulative[-1])))
        family.add_metric(labels, buckets, self.sum_ns / 1e9)


@dataclass
class _Series:
    """Everything exposed per (job, rank)."""

    wait: _Histogram = field(default_factory=_Histogram)
    compute: _Histogram = field(default_factory=_Histogram)
    read_duration: _Histogram = field(default_factory=_Histogram)
    reads: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(3, np.int64))  # by verdict + 1
    read_bytes: int = 0
    client_dropped: int = 0


class EventsCollector:
    def __init__(
        self,
        socket_path: str,
        queue_limit: int = 200_000,
        jobs: Interner | None = None,
        rank_limit: int = 64,
        sink: BatchSink = discard,
        socket_group: int | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._path = socket_path
        self._queue_limit = queue_limit
        self._jobs = jobs if jobs is not None else Interner()
        self._rank_limit = rank_limit
        self._ranks_folded = 0
        self._group = socket_group
        self._sink = sink
        self._clock_ns, self._wall_clock_ns = clock_ns, wall_clock_ns
        self._lock = threading.Lock()  # guards the aggregates below, read by collect()
        self._series: dict[tuple[int, str], _Series] = {}  # (job id, rank label)
        self._batches: Counter[str] = Counter()
        self._events: Counter[str] = Counter({"step": 0, "read": 0})
        self._dropped: Counter[str] = Counter()
        self._queue: deque[bytes] = deque()
        self._queued_events = 0
        self._ready = threading.Condition()
        self._stop = threading.Event()
        self._socket = self._bind()
        self._threads = [
            threading.Thread(target=self._receive_forever, name="stallwatch-events-receive", daemon=True),
            threading.Thread(target=self._process_forever, name="stallwatch-events-process", daemon=True),
        ]
        if self._socket is not None:
            for thread in self._threads:
                thread.start()

    # --- receiving --------------------------------------------------------------------------------
    def _bind(self) -> socket.socket | None:
        path = Path(self._path)
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True)
                self._restrict(path.parent, 0o750)
            if path.is_socket():  # left by an agent that did not exit cleanly
                path.unlink()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_RCVBUF)
            sock.bind(str(path))
            self._restrict(path, 0o660)
        except OSError as error:
            log.error("events: cannot bind %s: %s; training clients will count their events as dropped",
                      self._path, error)
            return None
        sock.settimeout(POLL_SECONDS)
        self._inode = os.stat(path).st_ino
        log.info("events: receiving on %s", self._path)
        return sock

    def _restrict(self, path: Path, mode: int) -> None:
        # chmod, not mkdir's mode: the umask would narrow or (at 0) widen it.
        if self._group is not None:
            os.chown(path, -1, self._group)
        os.chmod(path, mode)

    def _receive_forever(self) -> None:
        assert self._socket is not None
        buffer = bytearray(RECEIVE_BUFFER)
        while not self._stop.is_set():
            try:
                size = self._socket.recv_into(buffer)
            except TimeoutError:
                continue
            except OSError as error:
                if not self._stop.is_set():
                    log.error("events: receive failed: %s", error)
                    self._stop.wait(POLL_SECONDS)
                continue
            self._enqueue(bytes(buffer[:size]))

    def _enqueue(self, data: bytes) -> None:
        events = peek_events(data)
        with self._ready:
            if self._queue and self._queued_events + events > self._queue_limit:
                with self._lock:
                    self._batches["queue_full"] += 1
                    self._dropped["queue_full"] += events
                return
            self._queue.append(data)
            self._queued_events += events
            self._ready.notify()

    # --- processing -------------------------------------------------------------------------------
    def _process_forever(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue or self._stop.is_set(), timeout=POLL_SECONDS)
                pending = list(self._queue)
                self._queue.clear()
                self._queued_events = 0
            if pending:
                try:
                    self.process(pending)
                except Exception:  # a bug here must not stop the receiver
                    log.exception("events: processing failed")
            elif self._stop.is_set():
                return

    def process(self, datagrams: list[bytes]) -> None:
        """Decode, count and forward a group of batches. The processing thread's work; tests call it."""
        now, wall_now = self._clock_ns(), self._wall_clock_ns()
        accepted: list[tuple[int, Decoded]] = []
        for data in datagrams:
            try:
                decoded = decode(data, now, wall_now)
            except RejectedBatchError as rejected:
                with self._lock:
                    self._batches[rejected.reason] += 1
                    self._dropped["rejected"] += peek_events(data)
                log.debug("events: rejected a batch: %s", rejected)
                continue
            job = self._jobs.intern(decoded.source.job)
            self._aggregate(job, decoded)
            accepted.append((job, decoded))
        if accepted:
            self._forward(accepted)

    def _aggregate(self, job: int, decoded: Decoded) -> None:
        steps, reads = decoded.steps, decoded.reads
        wait = steps["wait_end_ns"] - steps["wait_start_ns"]
        compute = steps["compute_end_ns"] - steps["wait_end_ns"]
        duration = reads["end_ns"] - reads["start_ns"]
        by_verdict = np.bincount(reads["verdict"].astype(np.int64) + 1, minlength=3)
        read_bytes = int(reads["bytes"].sum())
        with self._lock:
            series = self._series_of(job, decoded.source.rank)
            series.wait.add(wait)
            series.compute.add(compute)
            series.read_duration.add(duration)
            series.reads += by_verdict
            series.read_bytes += read_bytes
            series.client_dropped += decoded.dropped
            self._batches["accepted"] += 1
            self._events["step"] += len(steps)
            self._events["read"] += len(reads)

    def _series_of(self, job: int, rank: int) -> _Series:
        """The series of (job, rank), or of (job, __other__) once the node holds `rank_limit` of them."""
        key = (job, str(rank))
        found = self._series.get(key)
        if found is None:
            if len(self._series) >= self._rank_limit:
                self._ranks_folded += 1
                key = (job, OVERFLOW)
            found = self._series.setdefault(key, _Series())
        return found

    def _forward(self, accepted: list[tuple[int, Decoded]]) -> None:
        def source_column(values: list[int], sizes: list[int], dtype: type[np.generic]) -> npt.NDArray[np.generic]:
            return np.repeat(np.array(values, dtype=dtype), sizes)

        jobs = [job for job, _ in accepted]
        ranks = [decoded.source.rank for _, decoded in accepted]
        step_sizes = [len(decoded.steps) for _, decoded in accepted]
        read_sizes = [len(decoded.reads) for _, decoded in accepted]
        steps = np.concatenate([decoded.steps for _, decoded in accepted])
        reads = np.concatenate([decoded.reads for _, decoded in accepted])
        batches = []
        if len(steps):
            batches.append(Batch("step", {
                "job": source_column(jobs, step_sizes, np.int32),
                "rank": source_column(ranks, step_sizes, np.int32),
                "gpu": source_column([d.source.gpu for _, d in accepted], step_sizes, np.int16),
                "batch": steps["batch"].copy(),
                "wait_start_ns": steps["wait_start_ns"].copy(),
                "wait_end_ns": steps["wait_end_ns"].copy(),
                "compute_end_ns": steps["compute_end_ns"].copy(),
            }))
        if len(reads):
            batches.append(Batch("read", {
                "job": source_column(jobs, read_sizes, np.int32),
                "rank": source_column(ranks, read_sizes, np.int32),
                "worker": source_column([d.source.worker for _, d in accepted], read_sizes, np.int16),
                "batch": reads["batch"].copy(),
                "key": reads["key"].copy(),
                "bytes": reads["bytes"].copy(),
                "start_ns": reads["start_ns"].copy(),
                "end_ns": reads["end_ns"].copy(),
                "verdict": reads["verdict"].copy(),
            }))
        for batch in batches:
            try:
                self._sink(batch)
            except Exception:
                log.exception("events: the correlator's sink failed on a %s batch", batch.kind)

    # --- exposition -------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        c = catalogue
        wait, compute, read_duration = c.LOADER_WAIT.family(), c.STEP_COMPUTE.family(), c.DATASET_READ_DURATION.family()
        reads, read_bytes, client_dropped = (
            c.DATASET_READS.family(), c.DATASET_READ_BYTES.family(), c.CLIENT_DROPPED_EVENTS.family()
        )
        batches, events = c.RECEIVER_BATCHES.family(), c.RECEIVER_EVENTS.family()
        dropped = c.RECEIVER_DROPPED_EVENTS.family()
        folded, up = c.RECEIVER_FOLDED_LABELS.family(), c.RECEIVER_UP.family()
        with self._lock:
            for (job, rank), series in sorted(self._series.items()):
                labels = [self._jobs.name(job), rank]
                series.wait.add_to(wait, labels)
                series.compute.add_to(compute, labels)
                series.read_duration.add_to(read_duration, labels)
                for verdict, label in VERDICT_LABELS.items():
                    reads.add_metric([*labels, label], float(series.reads[verdict + 1]))
                read_bytes.add_metric(labels, series.read_bytes)
                client_dropped.add_metric(labels, series.client_dropped)
            for result, count in sorted(self._batches.items()):
                batches.add_metric([result], count)
            for kind, count in sorted(self._events.items()):
                events.add_metric([kind], count)
            for reason, count in sorted(self._dropped.items()):
                dropped.add_metric([reason], count)
            folded.add_metric([catalogue.TRAINING_JOB], self._jobs.folded)
            folded.add_metric(["rank"], self._ranks_folded)
        up.add_metric([], 1.0 if self._socket is not None else 0.0)
        yield from (wait, compute, read_duration, reads, read_bytes, client_dropped, batches, events, dropped,
                    folded, up)

    def close(self) -> None:
        self._stop.set()
        with self._ready:
            self._ready.notify_all()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=2)
        if self._socket is not None:
            self._socket.close()
            with contextlib.suppress(OSError):  # remove the path only if it is still our socket
                info = os.stat(self._path)
                if stat.S_ISSOCK(info.st_mode) and info.st_ino == self._inode:
                    os.unlink(self._path)


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--events.socket", dest="events_socket", default=DEFAULT_SOCKET, metavar="PATH",
                       help="Unix datagram socket training clients send to (default: %(default)s)")
    group.add_argument("--events.queue-limit", dest="events_queue_limit", type=positive_int, default=200_000,
                       metavar="N", help="events waiting to be decoded before batches are dropped "
                       "(default: %(default)s)")
    group.add_argument("--events.job-limit", dest="events_job_limit", type=positive_int, default=64, metavar="N",
                       help="distinct job names kept as label values; more fold into __other__ "
                       "(default: %(default)s)")
    group.add_argument("--events.rank-limit", dest="events_rank_limit", type=positive_int, default=64, metavar="N",
                       help="distinct (job, rank) label pairs kept; ranks of more fold into __other__ "
                       "(default: %(default)s)")
    group.add_argument("--events.socket-group", dest="events_socket_group", type=_group_id, default=None,
                       metavar="GROUP", help="group (name or id) that owns the socket and, when the agent creates "
                       "it, its directory: training processes in it may send (default: the agent's own group)")


def _group_id(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise argparse.ArgumentTypeError(f"no group named {text!r}") from None


def _from_context(context: CollectorContext) -> EventsCollector:
    options = context.options
    context.jobs.limit = options.events_job_limit
    return EventsCollector(options.events_socket, options.events_queue_limit, context.jobs,
                           options.events_rank_limit, context.sink, options.events_socket_group)


register_collector("events", True, "loader waits, steps and dataset reads sent by training clients",
                   _from_context, _add_arguments)
