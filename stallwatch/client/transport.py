"""Delivery of events to the node agent: buffered per source, sent in batches, never blocking.

Why a datagram socket: the agent only has to receive, and a Unix datagram is a whole batch or
nothing, so there is no framing, no partial write to finish later and no connection to re-establish:
every batch is a `sendto()` to the socket's path, which reaches a restarted agent as soon as it has
bound the path again. The kernel queues at most `net.unix.max_dgram_qlen` datagrams per receiving
socket (10 on some machines), so a batch carries up to `wire.MAX_EVENTS` events: ten queued
datagrams hold thousands of events, and the agent's receive thread does nothing but drain them.

Never blocking: the socket is non-blocking. A full queue (EAGAIN), a missing agent (ENOENT,
ECONNREFUSED) or any other error drops the batch and counts its events; the count travels in the
next batch that gets through, for `stallwatch_client_dropped_events_total`. While the agent is
absent the client stops even packing for `ABSENT_RETRY_NS`, so a node without an agent pays only
the append of each event.

Threads and processes: recording appends a tuple to a list (atomic under the GIL). Flushing takes
the first n entries and deletes them, both single operations, so appends from other threads are
never lost; one lock makes sure only one thread flushes at a time. A background thread flushes
every `FLUSH_INTERVAL_NS` so idle processes still deliver; the buffers are also flushed when full,
at the end of every loader epoch, and at exit. After `fork()` (PyTorch loader workers) the child
discards the parent's buffered events, which the parent still owns, and starts its own thread.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import socket
import threading
import time
import weakref
from multiprocessing import util as mp_util

from stallwatch.client import wire

log = logging.getLogger(__name__)

FLUSH_INTERVAL_NS = 500_000_000
ABSENT_RETRY_NS = 1_000_000_000


class Channel:
    """The events of one source, waiting to be sent."""

    __slots__ = ("dropped_total", "dropped_unreported", "owner", "reads", "source", "steps")

    def __init__(self, owner: Sender, source: wire.Source) -> None:
        self.owner = owner
        self.source = source
        self.steps: list[wire.Step] = []
        self.reads: list[wire.Read] = []
        self.dropped_unreported = 0
        self.dropped_total = 0

    def step(self, row: wire.Step) -> None:
        steps = self.steps
        steps.append(row)
        if len(steps) >= wire.MAX_EVENTS:
            self.owner.flush(self, wait=False)

    def read(self, row: wire.Read) -> None:
        reads = self.reads
        reads.append(row)
        if len(reads) >= wire.MAX_EVENTS:
            self.owner.flush(self, wait=False)

    def flush(self) -> None:
        self.owner.flush(self, wait=True)

    def _reset(self) -> None:
        self.steps.clear()
        self.reads.clear()
        self.dropped_unreported = self.dropped_total = 0


class Sender:
    """One per process: the socket, the channels, and the thread that flushes them on time."""

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
        self._flusher: threading.Thread | None = None
        self._stop = threading.Event()

    def channel(self, source: wire.Source) -> Channel:
        found = self._channels.get(source)
        if found is None:
            found = self._channels.setdefault(source, Channel(self, source))
        self._ensure_flusher()
        return found

    def flush(self, channel: Channel, wait: bool) -> None:
        """Send what the channel holds. Never raises; `wait=False` gives up if another thread flushes."""
        if not self._lock.acquire(timeout=0.05 if wait else 0):
            return
        try:
            self._flush_locked(channel)
        except Exception:  # a bug here must never reach training code
            log.debug("stallwatch: flush failed", exc_info=True)
        finally:
            self._lock.release()

    def flush_all(self) -> None:
        for channel in list(self._channels.values()):
            self.flush(channel, wait=True)

    def close(self) -> None:
        self._stop.set()
        self.flush_all()
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _flush_locked(self, channel: Channel) -> None:
        while channel.steps or channel.reads:
            n_steps = min(len(channel.steps), wire.MAX_EVENTS)
            n_reads = min(len(channel.reads), wire.MAX_EVENTS - n_steps)
            steps, reads = channel.steps[:n_steps], channel.reads[:n_reads]
            del channel.steps[:n_steps], channel.reads[:n_reads]
            if not self._deliver(channel, steps, reads):
                channel.dropped_unreported += n_steps + n_reads
                channel.dropped_total += n_steps + n_reads

    def _deliver(self, channel: Channel, steps: list[wire.Step], reads: list[wire.Read]) -> bool:
        now = time.monotonic_ns()
        if now < self._absent_until_ns:
            return False
        reported = channel.dropped_unreported
        data = wire.encode(channel.source, steps, reads, len(steps), len(reads), reported, now, time.time_ns())
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.setblocking(False)
            self._socket.sendto(data, self.path)
        except BlockingIOError:  # the agent's queue is full: drop this batch, try the next one
            return False
        except OSError:  # no agent (ENOENT, ECONNREFUSED) or worse: stay quiet for a while
            self._absent_until_ns = now + ABSENT_RETRY_NS
            return False
        channel.dropped_unreported -= reported
        return True

    def _ensure_flusher(self) -> None:
        if self._flusher is not None and self._flusher.is_alive():
            return
        self._stop.clear()
        self._flusher = threading.Thread(target=self._flush_periodically, name="stallwatch-flush", daemon=True)
        self._flusher.start()
        if multiprocessing.current_process().name != "MainProcess":
            # multiprocessing children leave through os._exit(), which skips atexit handlers.
            mp_util.Finalize(self, self.flush_all, exitpriority=100)

    def _flush_periodically(self) -> None:
        while not self._stop.wait(FLUSH_INTERVAL_NS / 1e9):
            self.flush_all()


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
            sender.flush_all()


class _ProcessSender:
    """Holds this process's sender; forked children share it, reset by `_after_fork`."""

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
