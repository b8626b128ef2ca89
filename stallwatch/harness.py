"""Running real processes on loopback: the one place the demo, the tests and the benchmarks share.

Find a binary, pick a free port, start a `stallwatch agent` and wait until it says where it listens,
wait for a condition, stop a process, and scrape a /metrics page into samples.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

LISTENING = re.compile(r"listening on (https?://[^\s\"'\\]+)")

# {(sample name, sorted (label, value) pairs): value}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def find_binary(name: str) -> str | None:
    """A binary on PATH, or in /usr/sbin or /usr/bin (Debian puts servers there, often off a user's PATH)."""
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None
    )


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


def wait_for(what: str, check: Callable[[], bool], timeout: float, process: subprocess.Popen[Any] | None = None,
             log: Path | None = None) -> None:
    """Poll `check` until it holds; fail with the process's log when it does not in time or the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        if process is not None and process.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}" + (f":\n{log.read_text()[-3000:]}" if log else ""))


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as reply:
        return bool(reply.status == 200)


def parse_samples(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, timeout: float = 10) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return parse_samples(reply.read().decode())


def timed_scrape(url: str, timeout: float = 30) -> tuple[float, Samples]:
    """Seconds the page took to arrive (parsing not counted), and its samples."""
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    return time.perf_counter() - started, parse_samples(text)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over the series whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, x) in ls for k, x in labels.items()))


@dataclass
class AgentProcess:
    process: subprocess.Popen[str]
    url: str
    log: Path

    @property
    def base(self) -> str:
        return self.url.rsplit("/", 1)[0]

    def stderr(self) -> str:
        return self.log.read_text()


def start_agent(args: Sequence[str], log: Path, timeout: float = 20.0) -> AgentProcess:
    """A `stallwatch agent` on an ephemeral loopback port, its output in `log`; returns once it listens."""
    args = list(args)
    if not any(a.startswith(("--events.socket", "--no-collector.events")) for a in args):
        # A socket of its own: never the node-wide default. Short path: sun_path holds 108 bytes.
        args = [*args, "--events.socket", os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "stallwatch", "agent", "--web.listen-address", "127.0.0.1:0", *args],
            stdout=sink, stderr=subprocess.STDOUT, text=True, env=env,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = LISTENING.search(log.read_text())
        if match:
            return AgentProcess(process, match.group(1), log)
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"the agent did not start:\n{log.read_text()[-3000:]}")


def stop_agent(agent: AgentProcess) -> None:
    stop_process(agent.process, timeout=10)
