"""The socket server of the `events` collector: receives training clients' datagrams, hands them on.

The socket is drained by a relay process (`receive_relay`), which matters where the kernel queues
only ten datagrams (`net.unix.max_dgram_qlen`): it does not share the agent's GIL. Two threads take
it from there: the receive thread reads the relay's frames from a pipe and queues raw batches,
bounded by `queue_limit` events queued or being processed (past it a whole batch is dropped and
reported to `on_refused` as `queue_full`, as is a datagram longer than the receive buffer, as
`truncated`: never a cut batch that might pass); the processing thread hands everything queued to
`handle` in one call, which decodes and counts it.

The receive thread supervises the relay. One that dies (its pipe ends) is reaped, the datagrams it
had taken from the socket and not written are counted (`relay_lost`), and another starts on the same
socket, whose queue kept what clients sent meanwhile: at once after a relay that ran
`RELAY_SETTLED_S`, else after a backoff, up to `MAX_RESTART_DELAY_S`, during which the receive thread
reads the socket itself, as it does while a relay cannot start. A relay that lives but has not run for
`RELAY_STALL_S` (stopped) is left alone, since it holds what it took, but `up` is False and `problems`
says why until it runs again.

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
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from stallwatch.client import wire
from stallwatch.exporters.events_decode import peek_events
from stallwatch.exporters.receive_relay import CHECK_PARENT_MS, FRAME, RECEIVE_BUFFER, STATUS, STOP_SIGNALS

log = logging.getLogger(__name__)

SOCKET_RCVBUF = 4 << 20
POLL_SECONDS = 0.25
RELAY_STALL_S = 5 * CHECK_PARENT_MS / 1000  # five of the relay's idle wakes missed: it is stopped, not busy
RELAY_SETTLED_S = 60.0
FIRST_RESTART_DELAY_S = 0.5
MAX_RESTART_DELAY_S = 30.0


class _Relay:
    """A running relay: its process, the read end of its pipe, the status it keeps (`receive_relay.STATUS`),
    and how many frames the agent has read from it."""

    def __init__(self, sock: socket.socket) -> None:
        read_fd, write_fd = os.pipe()
        try:
            status_fd = os.memfd_create("stallwatch-relay-status")
            try:
                os.ftruncate(status_fd, STATUS.size)
                self._status = mmap.mmap(status_fd, STATUS.size)
                self.started_ns = time.monotonic_ns()
                # Blocked from its first instruction (a signal mask survives exec): a stop signal sent to the
                # agent's whole group while the relay still starts waits for it to take it, never kills it.
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
                try:
                    self.process = subprocess.Popen(
                        [sys.executable, "-P", "-m", "stallwatch.exporters.receive_relay", str(sock.fileno()),
                         str(write_fd), str(status_fd), str(os.getpid())],
                        pass_fds=(sock.fileno(), write_fd, status_fd))
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            finally:
                os.close(status_fd)
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.pipe = read_fd
        self.frames_read = 0

    def silent_s(self) -> float:
        """Seconds since the relay last ran (since it started, before its first run)."""
        ran_ns = int(STATUS.unpack_from(self._status)[0])
        return (time.monotonic_ns() - max(ran_ns, self.started_ns)) / 1e9

    def lost(self) -> int:
        """Datagrams the relay took from the socket that never reached the agent: once it has exited."""
        return int(STATUS.unpack_from(self._status)[1]) - self.frames_read

    def reap(self) -> int:
        """Its exit status, once it has exited (its pipe ended): never left a zombie."""
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it closed the pipe yet lives on: it is no relay of ours any more
            self.process.kill()
            return self.process.wait()


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
        self._relay: _Relay | None = None  # the relay running now; None while the agent receives itself
        self._relay_lock = threading.Lock()  # no relay starts once close() has begun
        self._relays_started = 0
        self.relay_lost = 0  # batches a relay took from the socket and died holding
        if self._socket is not None:  # before anything else of the agent's: ready as early as it can be
            self._start_relay()
        self._threads = [
            threading.Thread(target=self._receive_forever, name="stallwatch-events-receive", daemon=True),
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

    @property
    def relay_restarts(self) -> int:
        """Relays started after the first."""
        return max(self._relays_started - 1, 0)

    @property
    def up(self) -> bool:
        """Bound, and receiving: through a relay that runs, or in the agent."""
        return self.bound and not self.problems()

    def problems(self) -> list[str]:
        """Why nothing receives although the socket is bound: a relay that lives but does not run."""
        relay = self._relay
        if relay is not None and (silent_s := relay.silent_s()) >= RELAY_STALL_S:
            return [f"the receive relay (pid {relay.process.pid}) has not run for {silent_s:.0f} s; clients' "
                    "batches wait in the socket's queue, then are dropped and counted"]
        return []

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

    def _start_relay(self) -> _Relay | None:
        """A relay on the socket, as `_relay`; None if it cannot start (logged) or close() has begun."""
        assert self._socket is not None
        with self._relay_lock:
            if self._stop.is_set():
                return None
            try:
                self._relay = _Relay(self._socket)
            except OSError as error:
                log.error("events: cannot start the receive relay (%s); receiving in the agent", error)
                return None
            self._relays_started += 1
            return self._relay

    def _receive_forever(self) -> None:
        """Through relay after relay (see the module's docstring), until close()."""
        delay_s = 0.0
        relay = self._relay
        while not self._stop.is_set():
            if relay is None:
                delay_s = _backoff(delay_s)
            else:
                self._read_frames(relay)
                status = relay.reap()
                with self._relay_lock:
                    self._relay = None
                if self._stop.is_set():
                    return
                lost = relay.lost()
                self.relay_lost += lost
                ran_s = (time.monotonic_ns() - relay.started_ns) / 1e9
                delay_s = 0.0 if ran_s >= RELAY_SETTLED_S else _backoff(delay_s)
                log.error("events: the receive relay exited: pid %d %s after %.1f s, losing %d batches it held; "
                          "another starts in %.1f s, the agent receiving meanwhile", relay.process.pid,
                          _exit(status), ran_s, lost, delay_s)
            self._receive_in_agent(time.monotonic() + delay_s)
            relay = self._start_relay()

    def _read_frames(self, relay: _Relay) -> None:
        """Frames until the relay's pipe ends, which it does when the relay exits."""
        with os.fdopen(relay.pipe, "rb", buffering=1 << 20) as frames:
            while (header := frames.read(FRAME.size)) and len(header) == FRAME.size:
                size, kept = FRAME.unpack(header)
                data = frames.read(kept)
                if len(data) < kept:
                    break
                relay.frames_read += 1
                if size > kept:
                    self._on_refused("truncated", peek_events(data[:wire.HEADER.size], size))
                else:
                    self.enqueue(data)

    def _receive_in_agent(self, until: float) -> None:
        """Read the socket in this thread until the monotonic time `until` or close()."""
        assert self._socket is not None
        buffer = bytearray(RECEIVE_BUFFER)
        while not self._stop.is_set() and time.monotonic() < until:
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
        with self._relay_lock:
            self._stop.set()
            relay = self._relay
        if relay is not None:  # its exit closes the pipe: the receive thread reads the end and returns
            relay.process.terminate()
            try:
                relay.process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # stopped (SIGSTOP), it takes no SIGTERM until it runs
                relay.process.kill()
                relay.process.wait()
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


def _backoff(delay_s: float) -> float:
    """The wait before the next relay, after one that died soon or could not start."""
    return min(max(2 * delay_s, FIRST_RESTART_DELAY_S), MAX_RESTART_DELAY_S)


def _exit(status: int) -> str:
    """A relay's exit status, in words."""
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


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
