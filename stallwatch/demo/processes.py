"""Starting and stopping the real servers the demo (and the tests) run on loopback."""

from __future__ import annotations

import signal
import socket
import subprocess
from typing import Any


def free_port() -> int:
    """A port nothing listens on now, for servers that cannot report a port they picked themselves."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def stop_process(process: subprocess.Popen[Any], how: signal.Signals = signal.SIGTERM, timeout: float = 15) -> None:
    """Ask a process to stop, and kill it if it has not within `timeout` seconds."""
    if process.poll() is None:
        process.send_signal(how)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
