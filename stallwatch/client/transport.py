"""Delivery of events to the node agent: buffered per source, sent in batches, never blocking.

Why a datagram socket: the agent only has to receive, and a Unix datagram is a whole batch or
nothing, so there is no framing and no partial write to finish later. The socket is connected to
the agent's path, so `poll()` can say when the agent's queue has room again; after an error it is
dropped and connected anew, which reaches a restarted agent as soon as it has bound the path again.
The kernel queues at most `net.unix.max_dgram_qlen` datagrams per receiving socket (10 on some
machines), so a batch carries up to `wire.MAX_EVENTS` events.

A full queue (EAGAIN) is a moment, not a verdict: on a node whose cores are all busy the agent's
receive thread may wait a few milliseconds for a core while every loader worker flushes. The batch
is kept, encoded, in a per-process buffer of at most `MAX_PENDING_EVENTS` events, behind which
later batches queue in order, and the flush thread sends them as soon as `poll()` reports room.
Only a batch that waited `RETRY_BUDGET_NS` (well inside the correlator's lateness), one pushed out
of the full buffer (oldest first), one meeting a missing agent (ENOENT, ECONNREFUSED), or one that
fails to pack (a malformed row; the first such failure is logged as a warning) is dropped;
its events are counted and the count travels in the next batch that gets through, for
`stallwatch_client_dropped_events_total`: a header is packed when its batch leaves, so it carries the
count and clocks of that moment. While the agent is absent the client stops even packing for
`ABSENT_RETRY_NS`, so a node without an agent pays only the append of each event.

Never blocking: the socket is non-blocking and only the flush thread waits, in `poll()`, with the
lock released to training threads after each attempt. Recording appends (atomic under the GIL) a step's
tuple to a list, or a read's record, already packed, to a bytearray (a row that cannot be packed is dropped
and counted then). Flushing takes the first n entries and deletes them, both single operations, so
appends from other threads are never lost; one lock makes sure only one thread flushes at a time. The
flush thread also flushes every `FLUSH_INTERVAL_NS` so idle processes still deliver; the buffers are
also flushed when full, at the end of every loader epoch, and at exit (which waits at most
`EXIT_DRAIN_S` for room). After `fork()` (PyTorch loader workers) the child discards the parent's
buffered events, which the parent still owns, and starts its own thread.

What is in flight: every flush but a full buffer's (the training threads' own) asks the channel's
reporters, the trainer's running loop (`loop.timed_steps`) and the process's read context (`reads`),
what they have open, all as of one `as_of_ns`, and adds those open records to the channel's batch
when it sends one anyway, or sends them alone when a wait, a batch or a read has been open
`OPEN_AFTER_NS`: the agent learns of a stall while it lasts, and a steady job sends nothing more.
The reporters read state the recording paths keep anyway, in the flush thread, under the lock.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections import deque
from multiprocessing import util as mp_util
from typing import Protocol

from stallwatch.client import wire

log = logging.getLogger(__name__)

FLUSH_INTERVAL_NS = 200_000_000
ABSENT_RETRY_NS = 1_000_000_000
# A batch that met a full queue is retried for this long. A retry almost always succeeds within
# milliseconds; this bounds the rare long wait (a starved agent), near the correlator's lateness.
RETRY_BUDGET_NS = 400_000_000
MAX_PENDING_EVENTS = 32 * wire.MAX_EVENTS  # ~1.3 MB of encoded reads per process
RETRY_POLL_MS = 50
FULL = wire.MAX_EVENTS  # events a channel holds before it flushes
_PACK_READ = wire.READ.pack
_READ_SIZE = wire.READ.size
_FULL_READS = FULL * _READ_SIZE  # bytes of READ records a channel holds before it flushes
EXIT_DRAIN_S = 0.2
# A wait, a batch or a read open this long is worth a datagram of its own; shorter ones ride along with
# the events a flush sends anyway (a wait is not reported at all before this).
OPEN_AFTER_NS = 100_000_000
_LONG_OPEN_STATES = (wire.OPEN_WAIT, wire.OPEN_BATCH, wire.OPEN_READ)


class OpenReporter(Protocol):
    def open_records(self, channel: Channel, as_of_ns: int) -> list[wire.Open]:
        """What is open for `channel` now, started no later than `as_of_ns`; called by a flush, under its lock."""


class Channel:
    """The events of one source, waiting to be sent, and who reports what the source has in flight."""

    __slots__ = ("dropped_total", "dropped_unreported", "ended_ns", "handed_reported", "last_end_ns", "loop", "owner",
                 "reader", "reads", "source", "steps", "steps_packed")

    def __init__(self, owner: Sender, source: wire.Source) -> None:
        self.owner = owner
        self.source = source
        self.steps: list[wire.Step] = []
        self.steps_packed = 0  # steps taken from `steps` into batches, ever
        # READ records, packed back to back as they are recorded (the C recording packs its own in place): one
        # buffer, where a list of a bytes object a record cost an allocation, a free and a join each.
        self.reads = bytearray()
        self.dropped_unreported = 0
        self.dropped_total = 0
        self._forget_open()

    def _forget_open(self) -> None:
        self.loop: OpenReporter | None = None  # the training loop running on this channel
        self.reader: OpenReporter | None = None  # the process's read context, while it reads as this source
        self.ended_ns: int | None = None  # a loop ended then (its last step's end), not yet reported
        self.last_end_ns = -1  # the compute end of the last step packed
        self.handed_reported: tuple[int, int] | None = None  # the last handover sent: (batch, when)

    # The recording path, paid once per event: a module constant and no local alias measured ~12 ns
    # (15 %) faster than `wire.MAX_EVENTS` and a local, with the same exact bound.
    def step(self, row: wire.Step) -> None:
        self.steps.append(row)
        if len(self.steps) >= FULL:
            self.flush_full()

    def read(self, row: wire.Read) -> None:
        try:
            packed = _PACK_READ(*row)
        except struct.error:  # a malformed row: lost, and counted, as a batch that fails to pack
            self.drop(1)
            return
        self.reads += packed
        if len(self.reads) >= _FULL_READS:
            self.flush_full()

    def flush_full(self) -> None:
        """Send a full buffer now, unless another thread is sending (it takes these events too)."""
        self.owner.flush(self, wait=False)

    def flush(self) -> None:
        self.owner.flush(self, wait=True, as_of_ns=time.monotonic_ns())

    def end_loop(self, loop: OpenReporter, outer: OpenReporter | None, last_end_ns: int) -> None:
        """A loop ended at `last_end_ns`: the loop it ran inside (or none) runs again; the flush says so."""
        if self.loop is loop:
            self.loop = outer
        self.ended_ns = last_end_ns
        self.flush()

    def reads_waiting(self) -> int:
        """READ records waiting to be packed into a batch."""
        return len(self.reads) // _READ_SIZE

    def steps_recorded(self) -> int:
        """Steps recorded on the channel, ever (packed or waiting)."""
        return self.steps_packed + len(self.steps)

    def last_step_end(self) -> int:
        """The compute end of the last step recorded (-1 none); under the sender's lock, so no one packs."""
        steps = self.steps
        return steps[-1][3] if steps else self.last_end_ns

    def take_open(self, as_of_ns: int) -> list[wire.Open]:
        """The open records for a flush about to pack: none unless it sends events anyway, something has
        been open `OPEN_AFTER_NS`, a batch was handed over since the last report, or a loop ended (each reported
        at least once: a handover made just after the flush that sent its reads would otherwise never go)."""
        opens = [record for reporter in (self.loop, self.reader) if reporter is not None
                 for record in _open_records(reporter, self, as_of_ns) if record[3] <= as_of_ns]
        handed = next(((batch, since) for state, batch, _, since, _ in opens if state == wire.OPEN_HANDED), None)
        ended = self.ended_ns
        if ended is not None and ended <= as_of_ns:
            opens.append((wire.OPEN_ENDED, -1, 0, ended, as_of_ns))
            if self.ended_ns == ended:  # unless another loop ended meanwhile
                self.ended_ns = None
        elif not (self.steps or self.reads or handed != self.handed_reported or _long_open(opens)):
            return []
        self.handed_reported = handed
        return opens

    def drop(self, events: int) -> None:
        self.dropped_unreported += events
        self.dropped_total += events

    def _reset(self) -> None:
        self.steps.clear()
        self.reads.clear()
        self.dropped_unreported = self.dropped_total = 0
        self._forget_open()  # the parent's loops and reads: in a child their copies only seem to run


def _long_open(opens: list[wire.Open]) -> bool:
    return any(state in _LONG_OPEN_STATES and as_of - since >= OPEN_AFTER_NS for state, _, _, since, as_of in opens)


def _open_records(reporter: OpenReporter, channel: Channel, as_of_ns: int) -> list[wire.Open]:
    try:
        return reporter.open_records(channel, as_of_ns)
    except Exception:  # a reporter's bug costs its records, not the channel's events
        log.debug("stallwatch: reporting open records failed", exc_info=True)
        return []


class _Pending:
    """An encoded batch waiting for room in the agent's queue."""

    __slots__ = ("body", "channel", "events", "n_open", "n_reads", "n_steps", "since_ns")

    def __init__(self, channel: Channel, n_steps: int, n_reads: int, n_open: int, body: bytes, since_ns: int) -> None:
        self.channel, self.n_steps, self.n_reads, self.n_open = channel, n_steps, n_reads, n_open
        self.body, self.since_ns = body, since_ns
        self.events = n_steps + n_reads  # open records are a moment's view, neither bounded nor counted as dropped


class Sender:
    """One per process: the socket, the channels, the batches waiting for room, and the flush thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._channels: dict[wire.Source, Channel] = {}
        self._reset_process_state()
        weak = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork(weak))
        atexit.register(_flush_at_exit, weak)

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._absent_until_ns = 0
        self._warned_unpackable = False
        self._pending: deque[_Pending] = deque()
        self._pending_events = 0
        self._flusher: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when a batch is left pending: the flush thread retries it

    def channel(self, source: wire.Source) -> Channel:
        found = self._channels.get(source)
        if found is None:
            found = self._channels.setdefault(source, Channel(self, source))
        self._ensure_flusher()
        return found

    def flush(self, channel: Channel, wait: bool, as_of_ns: int | None = None) -> None:
        """Send what the channel holds, with `as_of_ns` also what it has in flight then (`Channel.take_open`).
        Never raises; `wait=False` gives up if another thread flushes."""
        if not self._lock.acquire(timeout=0.05 if wait else 0):
            return
        try:
            self._pack(channel, [] if as_of_ns is None else channel.take_open(as_of_ns))
            self._send_pending()
        except Exception:  # a bug here must never reach training code
            log.debug("stallwatch: flush failed", exc_info=True)
        finally:
            self._lock.release()

    def flush_all(self) -> None:
        as_of_ns = time.monotonic_ns()  # one moment for every record of this flush
        for channel in list(self._channels.values()):
            self.flush(channel, wait=True, as_of_ns=as_of_ns)

    def flush_before_exit(self) -> None:
        """Flush everything and wait a moment (`EXIT_DRAIN_S` at most) for room for what is left pending."""
        self.flush_all()
        self._drain_pending(EXIT_DRAIN_S)

    @property
    def pending_events(self) -> int:
        """Events encoded and waiting for room in the agent's queue."""
        return self._pending_events

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._flusher is not None and self._flusher is not threading.current_thread():
            self._flusher.join(timeout=1)
        self.flush_before_exit()
        with self._lock:
            self._drop_pending(len(self._pending))
            if self._socket is not None:
                self._socket.close()
                self._socket = None

    def _pack(self, channel: Channel, opens: list[wire.Open]) -> None:
        """Move the channel's events, and `opens` with the last of them, into batches at the end of the
        pending queue."""
        now = time.monotonic_ns()
        while channel.steps or channel.reads or opens:
            n_steps = min(len(channel.steps), wire.MAX_EVENTS)
            n_reads = min(channel.reads_waiting(), wire.MAX_EVENTS - n_steps)
            steps, reads = channel.steps[:n_steps], channel.reads[:n_reads * _READ_SIZE]
            del channel.steps[:n_steps], channel.reads[:n_reads * _READ_SIZE]
            channel.steps_packed += n_steps
            batch_opens: list[wire.Open] = []
            if not (channel.steps or channel.reads):
                batch_opens, opens = opens, []
            events = n_steps + n_reads
            try:
                if steps:  # where the trainer's next wait starts (`Channel.last_step_end`)
                    channel.last_end_ns = steps[-1][3]
                body = None if now < self._absent_until_ns else wire.encode_body(channel.source, steps, reads,
                                                                                  batch_opens)
            except Exception:  # a malformed row (struct.error, mostly): the batch is lost, and counted
                channel.drop(events)
                self._report_unpackable()
                continue
            if body is None:
                channel.drop(events)
                continue
            while self._pending and self._pending_events + events > MAX_PENDING_EVENTS:
                self._drop_pending(1)  # the oldest goes first: it is the likeliest to be late
            self._pending.append(_Pending(channel, n_steps, n_reads, len(batch_opens), body, now))
            self._pending_events += events

    def _report_unpackable(self) -> None:
        """Say once per process, as a warning, that batches fail to pack (each is counted as dropped)."""
        if not self._warned_unpackable:
            self._warned_unpackable = True
            log.warning("stallwatch: a batch failed to pack; its events are dropped and counted", exc_info=True)

    def _drop_pending(self, count: int) -> None:
        for _ in range(count):
            batch = self._pending.popleft()
            self._pending_events -= batch.events
            batch.channel.drop(batch.events)

    def _send_pending(self) -> bool:
        """Send pending batches in order until the queue is full; whether none is left."""
        pending = self._pending
        while pending:
            batch = pending[0]
            now = time.monotonic_ns()
            if now - batch.since_ns > RETRY_BUDGET_NS:
                self._drop_pending(1)
                continue
            channel = batch.channel
            reported = channel.dropped_unreported
            header = wire.encode_header(channel.source, batch.n_steps, batch.n_reads, reported, now, time.time_ns(),
                                        batch.n_open)
            try:
                self._connected().sendmsg([header, batch.body])
            except BlockingIOError:  # the agent's queue is full: the flush thread retries when it has room
                self._wake.set()
                return False
            except OSError:  # no agent (ENOENT, ECONNREFUSED) or worse: stay quiet for a while
                self._absent_until_ns = now + ABSENT_RETRY_NS
                if self._socket is not None:
                    self._socket.close()
                    self._socket = None
                self._drop_pending(len(pending))
                return True
            pending.popleft()
            self._pending_events -= batch.events
            channel.dropped_unreported -= reported
        return True

    def _connected(self) -> socket.socket:
        if self._socket is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._socket = sock
        return self._socket

    def _wait_for_room(self, timeout_ms: int) -> None:
        """Block this (flush) thread until the agent's queue has room or `timeout_ms` passes."""
        sock = self._socket
        if sock is None:
            return
        poller = select.poll()
        with contextlib.suppress(OSError, ValueError):  # closed meanwhile: the next send reconnects
            poller.register(sock, select.POLLOUT)
            poller.poll(timeout_ms)

    def _retry_pending(self) -> bool:
        """One attempt from the flush thread; whether nothing is left pending."""
        if not self._lock.acquire(timeout=0.05):
            return False
        try:
            return self._send_pending()
        except Exception:
            log.debug("stallwatch: retry failed", exc_info=True)
            return True
        finally:
            self._lock.release()

    def _drain_pending(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self._pending and time.monotonic() < deadline and not self._retry_pending():
            self._wait_for_room(RETRY_POLL_MS)

    def _ensure_flusher(self) -> None:
        if self._flusher is not None and self._flusher.is_alive():
            return
        self._stop.clear()
        self._flusher = threading.Thread(target=self._flush_periodically, name="stallwatch-flush", daemon=True)
        self._flusher.start()
        if multiprocessing.current_process().name != "MainProcess":
            # multiprocessing children leave through os._exit(), which skips atexit handlers.
            mp_util.Finalize(self, self.flush_before_exit, exitpriority=100)

    def _flush_periodically(self) -> None:
        interval = FLUSH_INTERVAL_NS / 1e9
        next_flush = time.monotonic() + interval
        while not self._stop.is_set():
            if self._pending:
                self._wait_for_room(RETRY_POLL_MS)
                if not self._retry_pending():
                    self._stop.wait(0.001)  # the queue filled again at once: let the agent drain it
            else:
                self._wake.wait(max(0.0, next_flush - time.monotonic()))
                self._wake.clear()
            if time.monotonic() >= next_flush and not self._stop.is_set():
                self.flush_all()
                next_flush = time.monotonic() + interval


def _after_fork(weak: weakref.ref[Sender]) -> None:
    sender = weak()
    if sender is None:
        return
    sender._reset_process_state()
    for channel in sender._channels.values():
        channel._reset()


def _flush_at_exit(weak: weakref.ref[Sender]) -> None:
    sender = weak()
    if sender is not None and sender._pid == os.getpid():
        with contextlib.suppress(Exception):
            sender.flush_before_exit()


class _ProcessSender:
    """Holds this process's sender; forked children share it, reset by `_after_fork`. Slots: read capture's
    C `readinto` reads `sender` at its offset."""

    __slots__ = ("lock", "sender")

    def __init__(self) -> None:
        self.sender: Sender | None = None
        self.lock = threading.Lock()


_current = _ProcessSender()


def sender() -> Sender:
    """This process's sender, created on first use at `$STALLWATCH_SOCKET` (default `wire.DEFAULT_SOCKET`)."""
    found = _current.sender
    if found is None:
        with _current.lock:
            if _current.sender is None:
                _current.sender = Sender(os.environ.get(wire.SOCKET_ENV) or wire.DEFAULT_SOCKET)
            found = _current.sender
    return found


def configure(socket_path: str) -> Sender:
    """Point this process (and the loader workers it starts later) at another agent socket."""
    with _current.lock:
        if _current.sender is not None:
            _current.sender.close()
        _current.sender = Sender(socket_path)
        os.environ[wire.SOCKET_ENV] = socket_path  # spawned workers build their own sender from it
    return _current.sender
