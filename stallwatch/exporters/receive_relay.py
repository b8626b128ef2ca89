"""The events socket's relay: a small process that only drains the socket into a pipe to the agent.

Why a process: the agent's threads share one GIL, and on a node whose cores are all busy the thread
holding it can be preempted for tens of milliseconds; a receive thread in the agent waits with it
while clients fill the kernel's queue of ten datagrams (`net.unix.max_dgram_qlen`). The relay has an
interpreter of its own and nothing else to do, so it is back in `recv` as soon as the scheduler lets
it run (measured in docs/benchmarks.md).

It inherits the bound socket and the write end of a pipe, and writes each datagram to the pipe as a
frame: `FRAME` (its length and the bytes kept: a datagram longer than the receive buffer is cut,
and the agent refuses it as `truncated`), then those bytes. While the agent reads slowly it holds up to
`MAX_BUFFERED_BYTES` itself; past that it stops reading the socket, so the kernel's queue fills and
clients keep, and at worst drop and count, their batches: nothing is lost without a count. It exits
when the agent closes the pipe or when its parent process is gone.

Its status is a page of memory it shares with the agent (`STATUS`, in a memfd): when it last ran, for
the agent to see a relay that stopped (SIGSTOP, a debugger) while it still lives, and how many
datagrams it has taken from the socket, for the agent to count those a relay that died (SIGKILL, the
OOM killer) held and never wrote. A store to memory, not a write: it costs the relay no system call,
and outlives it.

SIGTERM and SIGINT stop it when the agent sends them. Sent to the agent's whole process group
(`systemctl stop`, Ctrl-C), they reach the relay as well as the agent: the relay goes on relaying and
leaves the agent to stop it, so the agent stops cleanly instead of finding its relay gone first (and
saying so as an error). It stops by itself `STOP_GRACE_S` after such a signal if the agent has not
(the agent may have taken that signal as its own request: a signal sent twice before it is taken is one).

    python -P -m stallwatch.exporters.receive_relay SOCKET_FD PIPE_FD STATUS_FD PARENT_PID

`-P`: the agent's working directory stays off `sys.path`, so a `stallwatch` package planted there is
never what the relay imports.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque

FRAME = struct.Struct("<II")  # the datagram's length, then how many of its bytes follow (fewer if cut)
# When the relay last ran (CLOCK_MONOTONIC, the agent's clock too), and the datagrams it has taken.
STATUS = struct.Struct("<qQ")
RECEIVE_BUFFER = 1 << 18  # larger than any batch a client sends
MAX_BUFFERED_BYTES = 16 << 20
PIPE_BYTES = 1 << 20  # the pipe's own buffer, as large as an unprivileged process may ask (fs.pipe-max-size)
DRAIN_PER_WAKE = 64
CHECK_PARENT_MS = 1000
F_SETPIPE_SZ = 1031
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
STOP_GRACE_S = 3.0  # below the 5 s the agent waits for its relay to stop


def _wait_for_stop(parent_pid: int, stop: threading.Event, wake_fd: int) -> None:
    """Set `stop` (and wake the relay's poll) on a stop signal from the agent, or `STOP_GRACE_S` after one from
    elsewhere. Takes the signals synchronously (`sigwaitinfo`): their sender is known only that way."""
    deadline: float | None = None
    info: signal.struct_siginfo | None
    while True:
        if deadline is None:
            info = signal.sigwaitinfo(STOP_SIGNALS)
        else:
            info = signal.sigtimedwait(STOP_SIGNALS, max(0.0, deadline - time.monotonic()))
        if info is None or info.si_pid == parent_pid:
            break
        deadline = deadline or time.monotonic() + STOP_GRACE_S
    stop.set()
    os.write(wake_fd, b"x")


def _stop_on_signal(parent_pid: int) -> tuple[threading.Event, int]:
    """Block the stop signals and take them in a thread of their own; the event it sets, and the fd it wakes."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # before the thread starts: it inherits the mask
    stop = threading.Event()
    wake_read, wake_write = os.pipe()
    threading.Thread(target=_wait_for_stop, args=(parent_pid, stop, wake_write), name="stop-signals",
                     daemon=True).start()
    return stop, wake_read


def relay(sock: socket.socket, pipe_fd: int, status: mmap.mmap, parent_pid: int) -> None:
    os.set_blocking(pipe_fd, False)
    with contextlib.suppress(OSError):
        fcntl.fcntl(pipe_fd, F_SETPIPE_SZ, PIPE_BYTES)
    out: deque[memoryview] = deque()
    buffered = 0
    buffer = bytearray(RECEIVE_BUFFER)
    poller = select.poll()
    sock_fd = sock.fileno()
    stop, wake_fd = _stop_on_signal(parent_pid)
    poller.register(wake_fd, select.POLLIN)
    taken = 0
    while os.getppid() == parent_pid and not stop.is_set():
        STATUS.pack_into(status, 0, time.monotonic_ns(), taken)  # at least every CHECK_PARENT_MS
        poller.register(sock_fd, select.POLLIN if buffered < MAX_BUFFERED_BYTES else 0)
        poller.register(pipe_fd, select.POLLOUT if out else 0)
        for fd, event in poller.poll(CHECK_PARENT_MS):
            if fd == pipe_fd and event & (select.POLLERR | select.POLLHUP):
                return  # the agent closed its end
            if fd == sock_fd and event & select.POLLIN:
                for _ in range(DRAIN_PER_WAKE):
                    try:
                        size = sock.recv_into(buffer, 0, socket.MSG_DONTWAIT | socket.MSG_TRUNC)
                    except (BlockingIOError, InterruptedError):
                        break
                    taken += 1
                    STATUS.pack_into(status, 0, time.monotonic_ns(), taken)  # before it can be lost with us
                    kept = min(size, len(buffer))
                    out.append(memoryview(FRAME.pack(size, kept) + buffer[:kept]))
                    buffered += FRAME.size + kept
        while out:
            try:
                written = os.writev(pipe_fd, list(out)[:64])
            except BlockingIOError:
                break
            except BrokenPipeError:
                return
            buffered -= written
            while written and written >= len(out[0]):
                written -= len(out.popleft())
            if written:
                out[0] = out[0][written:]


def main(argv: list[str]) -> None:
    sock_fd, pipe_fd, status_fd, parent_pid = (int(value) for value in argv)
    relay(socket.socket(fileno=sock_fd), pipe_fd, mmap.mmap(status_fd, STATUS.size), parent_pid)


if __name__ == "__main__":
    main(sys.argv[1:])
