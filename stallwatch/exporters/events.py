"""The `events` collector: loader waits, steps and dataset reads sent by training clients.

The socket and its threads are `receiver.EventReceiver`'s; the collector gets every group of
datagrams it drained, decodes and validates them (`events_decode`), aggregates the histograms and
counters with NumPy one batch at a time, and hands the records to the correlator as `step`, `read`
and `open` event batches (`stallwatch.eventbatch`; open records, what a client had in flight, feed
only the correlator). A full receive queue (`--events.queue-limit` events) drops whole batches,
counted here.

Cardinality: clients choose job names and ranks, so both are capped per node, and the caps count
live jobs: a job or (job, rank) that sent nothing for `--events.expire-after` seconds is finished,
its series go and its place is free for a new one. Job names past `--events.job-limit` live ones fold
into `__other__`; (job, rank) series past `--events.rank-limit` live ones fold into the rank
`__other__` of their job, so the loader series stay under (rank limit + job limit + 1) label pairs
whatever clients send; `stallwatch_receiver_folded_label_values_total{label}` counts the folds. The
correlator gets every record with its real rank, and applies the same caps to its own series.
"""

from __future__ import annotations

import argparse
import grp
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.client import wire
from stallwatch.correlator.wallclock import wall_offset_ns
from stallwatch.eventbatch import (
    DEFAULT_EXPIRE_AFTER_S,
    SCHEMAS,
    EventBatch,
    EventSink,
    Interner,
    SeriesCap,
    discard,
)
from stallwatch.exporters.collector import CollectorContext, register_collector
from stallwatch.exporters.events_decode import Decoded, Records, RejectedBatchError, decode, peek_events
from stallwatch.exporters.gpu_directory import GpuDirectory
from stallwatch.exporters.histogram import DurationHistogram
from stallwatch.exporters.receiver import EventReceiver
from stallwatch.flags import positive_float, positive_int

log = logging.getLogger(__name__)

# By wire number, from VERDICT_UNKNOWN (-1) up: a read's verdict + 1 is its place in a series' counts.
VERDICT_LABELS = {wire.VERDICT_UNKNOWN: "unknown", wire.VERDICT_HIT: "hit", wire.VERDICT_MISS: "miss",
                  wire.VERDICT_DIRECT: "direct"}


@dataclass
class _Series:
    """Everything exposed per (job, rank)."""

    wait: DurationHistogram = field(default_factory=lambda: DurationHistogram(catalogue.LOADER_WAIT.buckets))
    compute: DurationHistogram = field(default_factory=lambda: DurationHistogram(catalogue.STEP_COMPUTE.buckets))
    read_duration: DurationHistogram = field(
        default_factory=lambda: DurationHistogram(catalogue.DATASET_READ_DURATION.buckets))
    reads: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(len(VERDICT_LABELS), np.int64))
    read_bytes: int = 0
    failed_reads: int = 0
    client_dropped: int = 0


class EventsCollector:
    def __init__(
        self,
        socket_path: str,
        queue_limit: int = 200_000,
        jobs: Interner | None = None,
        rank_limit: int = 64,
        expire_after_s: float | None = DEFAULT_EXPIRE_AFTER_S,
        sink: EventSink = discard,
        socket_group: int | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        gpus: GpuDirectory | None = None,
    ) -> None:
        self._jobs = jobs if jobs is not None else Interner()
        self._gpus = gpus if gpus is not None else GpuDirectory()
        self._ranks: SeriesCap[int] = SeriesCap(rank_limit, expire_after_s)
        self._sink = sink
        self._clock_ns, self._wall_clock_ns = clock_ns, wall_clock_ns
        self._lock = threading.Lock()  # guards the aggregates below, read by collect()
        self._series: dict[tuple[int, str], _Series] = {}  # (job id, rank label)
        self._batches: Counter[str] = Counter()
        self._events: Counter[str] = Counter({"step": 0, "read": 0})
        self._dropped: Counter[str] = Counter()
        self._receiver = EventReceiver(socket_path, queue_limit, self.process, self._refused, socket_group)

    def _refused(self, result: str, events: int) -> None:
        """A batch the receiver dropped before decoding: its queue was full, or the datagram was cut."""
        with self._lock:
            self._batches[result] += 1
            self._dropped["queue_full" if result == "queue_full" else "rejected"] += events

    # --- processing -------------------------------------------------------------------------------
    def process(self, datagrams: list[bytes]) -> None:
        """Decode, count and forward a group of batches. The processing thread's work; tests call it."""
        offset = wall_offset_ns(wall_ns=self._wall_clock_ns, monotonic_ns=self._clock_ns)
        now = self._clock_ns()
        wall_now = now + offset
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
            self._aggregate(job, decoded, now)
            accepted.append((job, decoded))
        if accepted:
            self._forward(accepted)

    def _aggregate(self, job: int, decoded: Decoded, now: int) -> None:
        steps, reads = decoded.steps, decoded.reads
        wait = steps["wait_end_ns"] - steps["wait_start_ns"]
        compute = steps["compute_end_ns"] - steps["wait_end_ns"]
        duration = reads["end_ns"] - reads["start_ns"]
        by_verdict = np.bincount(reads["verdict"].astype(np.int64) + 1, minlength=len(VERDICT_LABELS))
        read_bytes = int(reads["bytes"].sum())
        failed_reads = int(np.count_nonzero(reads["bytes"] == 0))
        with self._lock:
            self._expire(now)
            series = self._series.setdefault(self._ranks.admit(job, str(decoded.source.rank), now), _Series())
            series.wait.add(wait)
            series.compute.add(compute)
            series.read_duration.add(duration)
            series.reads += by_verdict
            series.read_bytes += read_bytes
            series.failed_reads += failed_reads
            series.client_dropped += decoded.dropped
            self._batches["accepted"] += 1
            self._events["step"] += len(steps)
            self._events["read"] += len(reads)

    def _expire(self, now: int) -> None:
        """Drop the series of (job, rank) pairs idle past the expiry; the caller holds the lock."""
        for key in self._ranks.expire(now):
            del self._series[key]

    def _forward(self, accepted: list[tuple[int, Decoded]]) -> None:
        sources = [{"job": job, "rank": d.source.rank, "gpu": self._gpus.index_of(d.source.gpu_uuid, d.source.gpu),
                    "worker": d.source.worker} for job, d in accepted]
        kinds = (("step", [d.steps for _, d in accepted]), ("read", [d.reads for _, d in accepted]),
                 ("open", [d.opens for _, d in accepted]))
        for kind, records in kinds:
            if not any(len(part) for part in records):
                continue
            batch = _event_batch(kind, sources, records)
            try:
                self._sink(batch)
            except Exception:
                log.exception("events: the correlator's sink failed on a %s batch", batch.kind)

    # --- exposition -------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        c = catalogue
        wait, compute, read_duration = c.LOADER_WAIT.family(), c.STEP_COMPUTE.family(), c.DATASET_READ_DURATION.family()
        reads, read_bytes, failed_reads, client_dropped = (
            c.DATASET_READS.family(), c.DATASET_READ_BYTES.family(), c.DATASET_FAILED_READS.family(),
            c.CLIENT_DROPPED_EVENTS.family()
        )
        batches, events = c.RECEIVER_BATCHES.family(), c.RECEIVER_EVENTS.family()
        dropped = c.RECEIVER_DROPPED_EVENTS.family()
        folded, up = c.RECEIVER_FOLDED_LABELS.family(), c.RECEIVER_UP.family()
        restarts = c.RECEIVER_RELAY_RESTARTS.family()
        with self._lock:
            self._expire(self._clock_ns())
            for (job, rank), series in sorted(self._series.items()):
                labels = [self._jobs.name(job), rank]
                series.wait.add_to(wait, labels)
                series.compute.add_to(compute, labels)
                series.read_duration.add_to(read_duration, labels)
                for verdict, label in VERDICT_LABELS.items():
                    reads.add_metric([*labels, label], float(series.reads[verdict + 1]))
                read_bytes.add_metric(labels, series.read_bytes)
                failed_reads.add_metric(labels, series.failed_reads)
                client_dropped.add_metric(labels, series.client_dropped)
            # Counter addition keeps only positive counts: relay_lost appears once a relay lost a batch.
            by_result = self._batches + Counter(relay_lost=self._receiver.relay_lost)
            for result, count in sorted(by_result.items()):
                batches.add_metric([result], count)
            for kind, count in sorted(self._events.items()):
                events.add_metric([kind], count)
            for reason, count in sorted(self._dropped.items()):
                dropped.add_metric([reason], count)
            folded.add_metric([catalogue.JOB_LABEL], self._jobs.folded)
            folded.add_metric(["rank"], self._ranks.folded)
        up.add_metric([], 1.0 if self._receiver.up else 0.0)
        restarts.add_metric([], self._receiver.relay_restarts)
        yield from (wait, compute, read_duration, reads, read_bytes, failed_reads, client_dropped, batches, events,
                    dropped, folded, up, restarts)

    def problems(self) -> list[str]:
        """What makes the agent unhealthy (/-/healthy): a receive relay that does not run."""
        return self._receiver.problems()

    def close(self) -> None:
        self._receiver.close()


def _event_batch(kind: str, sources: list[dict[str, int]], records: list[Records]) -> EventBatch:
    """The records of several client batches as one event batch: the wire record's fields, and for
    the columns a record lacks (who sent it) its batch's source value, repeated per record."""
    merged = np.concatenate(records)
    sizes = [len(part) for part in records]
    schema = SCHEMAS[kind].columns
    assert merged.dtype.names is not None
    return EventBatch.of(kind, {
        name: merged[name].copy() if name in merged.dtype.names
        else np.repeat(np.array([source[name] for source in sources], dtype=dtype), sizes)
        for name, dtype in schema.items()
    })


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--events.socket", dest="events_socket", default=wire.DEFAULT_SOCKET, metavar="PATH",
                       help="Unix datagram socket training clients send to (default: %(default)s)")
    group.add_argument("--events.queue-limit", dest="events_queue_limit", type=positive_int, default=200_000,
                       metavar="N", help="events waiting to be decoded before batches are dropped "
                       "(default: %(default)s)")
    group.add_argument("--events.job-limit", dest="events_job_limit", type=positive_int, default=64, metavar="N",
                       help="live job names kept as label values; more fold into __other__ "
                       "(default: %(default)s)")
    group.add_argument("--events.rank-limit", dest="events_rank_limit", type=positive_int, default=64, metavar="N",
                       help="live (job, rank) label pairs kept, in the loader and the correlator metrics; "
                       "ranks of more fold into __other__ (default: %(default)s)")
    group.add_argument("--events.expire-after", dest="events_expire_after", type=positive_float,
                       default=DEFAULT_EXPIRE_AFTER_S, metavar="SECONDS",
                       help="a job or (job, rank) that sent nothing for this long is finished: its loader and "
                       "correlator series go and it no longer counts against the limits (default: %(default)s)")
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
    context.jobs.limit, context.jobs.expire_after_s = options.events_job_limit, options.events_expire_after
    return EventsCollector(options.events_socket, options.events_queue_limit, context.jobs,
                           options.events_rank_limit, options.events_expire_after, context.sink,
                           options.events_socket_group, gpus=context.gpus)


register_collector("events", True, "loader waits, steps and dataset reads sent by training clients",
                   _from_context, _add_arguments)
