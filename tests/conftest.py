"""Shared fixtures: real binaries found or a clear failure, and a real agent process on a free port."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

from stallwatch.demo.processes import stop_process

# CI (which sets CI=true) runs the same examples every time, so a red build names a change, not a
# draw; local runs keep exploring new examples. Tests' own settings (example counts) build on this.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (https?://\S+?)(?:'|$)")


def require_binary(name: str, package: str) -> str:
    """Path of a real binary the tests need; `make test` installs it, so its absence is a failure."""
    found = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None
    )
    if found is None:
        pytest.fail(f"{name} not found: `make test` installs Debian's {package} (scripts/install-system-deps.sh)")
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool", "prometheus")


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


def start_agent(args: list[str], log: Path, timeout: float = 20.0) -> AgentProcess:
    if not any(a.startswith(("--events.socket", "--no-collector.events")) for a in args):
        # A socket of its own: never the node-wide default. Short path: sun_path holds 108 bytes.
        args = [*args, "--events.socket", os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "stallwatch", "agent", "--web.listen-address", "127.0.0.1:0", *args],
            stdout=sink, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
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
    raise AssertionError(f"agent did not start: {log.read_text()}")


def laughs(levels: int = 9) -> str:
    """The "billion laughs": 9 anchors of 9 references each, a 9**9-element value from ~400 bytes."""
    items = ["&l0 [" + ", ".join(["lol"] * 9) + "]"]
    items += [f"&l{n} [" + ", ".join([f"*l{n - 1}"] * 9) + "]" for n in range(1, levels)]
    return "[" + ", ".join(items) + "]"


@dataclass(frozen=True)
class Refusal:
    """How an agent that should refuse to start ended: its exit status, stderr and resource use."""

    returncode: int
    stderr: str
    cpu_seconds: float
    peak_rss_mib: float

    @property
    def one_line_error(self) -> bool:
        """Exit 2 with a short error line last (log lines of collectors already built may precede it)."""
        last = (self.stderr.strip().splitlines() or [""])[-1]
        return (self.returncode == 2 and last.startswith("stallwatch agent: error:") and len(last) < 500
                and "Traceback" not in self.stderr)


def refused_agent(args: list[str], timeout: float = 15.0) -> Refusal:
    """Run `stallwatch agent ARGS`, which should exit by itself (killed after `timeout`); measure its cost."""
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "stallwatch", "agent", "--web.listen-address",
                                    "127.0.0.1:0", *args], stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)  # wait4: the child's own rusage
            if pid:
                break
            if time.monotonic() > deadline:
                process.kill()
            time.sleep(0.05)
        process.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        text = stderr.read()
    return Refusal(process.returncode, text, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def stop_agent(agent: AgentProcess) -> None:
    stop_process(agent.process, timeout=10)


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def factory(*args: str) -> AgentProcess:
        agent = start_agent(list(args), tmp_path / f"agent-{len(started)}.log")
        started.append(agent)
        return agent

    yield factory
    for agent in started:
        stop_agent(agent)
