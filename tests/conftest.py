"""Shared fixtures: real binaries found or a clear failure, and a real agent process on a free port.

Starting and stopping the processes is `stallwatch.harness`, which the demo and the benchmarks share.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from stallwatch.harness import AgentProcess, find_binary, start_agent, stop_agent

# CI (which sets CI=true) runs the same examples every time, so a red build names a change, not a
# draw; local runs keep exploring new examples. Tests' own settings (example counts) build on this.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/ from this run (tests/test_golden.py) instead of comparing")
    parser.addoption("--no-processes", action="store_true",
                     help="the quick tier (`make check`): every test that starts no real process; one that "
                     "does (the agent, Prometheus, promtool, helm, a job) is skipped when it tries")


@pytest.fixture(autouse=True, scope="session")
def _no_processes_in_the_quick_tier(request: pytest.FixtureRequest) -> Iterator[None]:
    if not request.config.getoption("--no-processes"):
        yield
        return
    started = subprocess.Popen.__init__

    def skip(self: subprocess.Popen[Any], args: Any, *rest: Any, **options: Any) -> None:
        pytest.skip(f"starts a real process ({str(args)[:60]}): `make test` runs it")

    subprocess.Popen.__init__ = skip  # type: ignore[method-assign]
    yield
    subprocess.Popen.__init__ = started  # type: ignore[method-assign]


def require_binary(name: str, package: str) -> str:
    """Path of a real binary the tests need; `make test` installs it, so its absence is a failure."""
    found = find_binary(name)
    if found is None:
        pytest.fail(f"{name} not found: `make test` installs Debian's {package} (scripts/install-system-deps.sh)")
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool", "prometheus")


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


# Forked from a fresh interpreter, not from pytest: a child's peak RSS starts from its parent's (the
# memory the fork copied counts until exec), and pytest's grows to hundreds of MiB over the suite.
_MEASURE = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
_, status, usage = os.wait4(pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime, usage.ru_maxrss)
"""


def refused_agent(args: list[str], timeout: float = 15.0) -> Refusal:
    """Run `stallwatch agent ARGS`, which should exit by itself (killed after `timeout`); measure its cost."""
    command = [sys.executable, "-c", _MEASURE, "-m", "stallwatch", "agent", "--web.listen-address", "127.0.0.1:0",
               *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
    if not out.strip():  # killed at the timeout: no figures, and a cost no test accepts
        return Refusal(-signal.SIGKILL, err, float("inf"), float("inf"))
    returncode, cpu_seconds, max_rss_kib = out.split()
    return Refusal(int(returncode), err, float(cpu_seconds), int(max_rss_kib) / 1024)


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
