"""The socket server of the `events` collector: receives training clients' datagrams, hands them on.

The socket is drained by a relay process (`receive_relay`), which matters where the kernel queues
only ten datagrams (`net.unix.max_dgram_qlen`): it does not share the agent's GIL. Two threads take
it from there: the receive thread reads the relay's frames from a pipe and queues raw batches,
bounded by `queue_limit` events queued or being processed (past it a whole batch is dropped and
reported to `on_refused` as `queue_full`, as is a datagram longer than the receive buffer, as
`truncated`: never a cut batch that might pass); the processing thread hands everything queued to
`handle` in one call, which decodes and counts it. If the relay cannot start, the receive thread
reads the socket itself.

Permissions: the socket is the only way in (no network listener); it is created with mode 0660 and,
with a socket group, owned by that group, so only the agent's user and that group's training
processes can send. A missing directory is created 0750 with the same group: group members can
reach the socket, nobody else can, and only the agent can create files there.

One socket, one agent: a socket file that still answers belongs to a running agent and is left alone
(this agent reports `stallwatch_receiver_up` 0); only a stale one, which refuses connections, is
replaced. `bound` also turns false when the path stops naming this agent's socket.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from stallwatch.client import wire
from stallwatch.exporters.events_decode import peek_events
from stallwatch.exporters.receive_relay import FRAME, RECEIVE_BUFFER

log = logging.getLogger(__name__)

SOCKET_RCVBUF = 4 << 20
POLL_SECONDS = 0.25


class EventReceiver:
    """Binds `path` and starts both threads; if it cannot bind, logs why and `bound` is False."""

    def __init__(
        self,
        path: str,
        queue_limit: int,
        handle: Callable[[list[bytes]], None],
        on_refused: Callable[[str, int], None],
        socket_group: int | None = None,
    ) -> None:
        self._path = path
        self._queue_limit = queue_limit
        self._handle, self._on_refused = handle, on_refused
        self._group = socket_group
        self._queue: deque[bytes] = deque()
        self._queued_events = 0
        self._ready = threading.Condition()
        self._stop = threading.Event()
        self._socket = self._bind()
        self._relay: subprocess.Popen[bytes] | None = None
        self._frames = self._start_relay() if self._socket is not None else None
        receive = self._receive_forever if self._frames is None else self._read_frames_forever
        self._threads = [
            threading.Thread(target=receive, name="stallwatch-events-receive", daemon=True),
            threading.Thread(target=self._process_forever, name="stallwatch-events-process", daemon=True),
        ]
        if self._socket is not None:
            for thread in self._threads:
                thread.start()

    @property
    def bound(self) -> bool:
        """Bound, and the path still names this agent's socket (it may have been deleted or taken)."""
        if self._socket is None:
            return False
        try:
            info = os.stat(self._path)
        except OSError:
            return False
        return stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == self._identity

    def _bind(self) -> socket.socket | None:
        path = Path(self._path)
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True)
                self._restrict(path.parent, 0o750)
            if path.is_socket():
                if _answers(path):
                    log.error("events: %s belongs to another running agent; not taking it over", self._path)
                    return None
                path.unlink()  # left by an agent that did not exit cleanly
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_RCVBUF)
            sock.bind(str(path))
            self._restrict(path, 0o660)
        except OSError as error:
            log.error("events: cannot bind %s: %s; training clients will count their events as dropped",
                      self._path, error)
            return None
        sock.settimeout(POLL_SECONDS)
        info = os.stat(path)
        self._identity = (info.st_dev, info.st_ino)
        log.info("events: receiving on %s", self._path)
        return sock

    def _restrict(self, path: Path, mode: int) -> None:
        # chmod, not mkdir's mode: the umask would narrow or (at 0) widen it.
        if self._group is not None:
            os.chown(path, -1, self._group)
        os.chmod(path, mode)

    def _start_relay(self) -> int | None:
        """Start the relay on the bound socket; the read end of its pipe, or None to receive in-process."""
        assert self._socket is not None
        read_fd, write_fd = os.pipe()
        try:
            self._relay = subprocess.Popen(
                [sys.executable, "-m", "stallwatch.exporters.receive_relay", str(self._socket.fileno()),
                 str(write_fd), str(os.getpid())], pass_fds=(self._socket.fileno(), write_fd))
        except OSError as error:
            log.error("events: cannot start the receive relay (%s); receiving in the agent", error)
            os.close(read_fd)
            return None
        finally:
            os.close(write_fd)
        return read_fd

    def _read_frames_forever(self) -> None:
        assert self._frames is not None
        with os.fdopen(self._frames, "rb", buffering=1 << 20) as frames:
            while (header := frames.read(FRAME.size)) and len(header) == FRAME.size:
                size, kept = FRAME.unpack(header)
                data = frames.read(kept)
                if len(data) < kept:
                    break
                if size > kept:
                    self._on_refused("truncated", peek_events(data[:wire.HEADER.size], size))
                else:
                    self.enqueue(data)
        if not self._stop.is_set():
            log.error("events: the receive relay exited; training clients will count their events as dropped")

    def _receive_forever(self) -> None:
        assert self._socket is not None
        buffer = bytearray(RECEIVE_BUFFER)
        while not self._stop.is_set():
            try:
                size = self._socket.recv_into(buffer, 0, socket.MSG_TRUNC)  # MSG_TRUNC: the real length
            except TimeoutError:
                continue
            except OSError as error:
                if not self._stop.is_set():
                    log.error("events: receive failed: %s", error)
                    self._stop.wait(POLL_SECONDS)
                continue
            if size > len(buffer):
                self._on_refused("truncated", peek_events(bytes(buffer[:wire.HEADER.size]) , size))
                continue
            self.enqueue(bytes(buffer[:size]))

    def enqueue(self, data: bytes) -> None:
        """Queue one datagram for the processing thread: the receive thread's work; tests call it."""
        events = peek_events(data)
        with self._ready:
            if self._queue and self._queued_events + events > self._queue_limit:
                self._on_refused("queue_full", events)
                return
            self._queue.append(data)
            self._queued_events += events
            self._ready.notify()

    def _process_forever(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue or self._stop.is_set(), timeout=POLL_SECONDS)
                pending = list(self._queue)
                self._queue.clear()
                taken = self._queued_events
            if pending:
                try:
                    self._handle(pending)
                except Exception:  # a bug there must not stop the receiver
                    log.exception("events: processing failed")
                # Counted until handled: freed from the queue, the batches are still held while decoded.
                with self._ready:
                    self._queued_events -= taken
            elif self._stop.is_set():
                return

    def close(self) -> None:
        self._stop.set()
        if self._relay is not None:  # its exit closes the pipe: the receive thread reads the end and returns
            self._relay.terminate()
            self._relay.wait(timeout=5)
        with self._ready:
            self._ready.notify_all()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=2)
        if self._socket is not None:
            self._socket.close()
            with contextlib.suppress(OSError):  # remove the path only if it is still our socket
                info = os.stat(self._path)
                if stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == self._identity:
                    os.unlink(self._path)


def _answers(path: Path) -> bool:
    """Whether a process is bound to the socket file at `path` (a stale file refuses connections)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            return False
        except OSError:  # not ours to connect to (permissions): not ours to replace either
            return True
    return True
