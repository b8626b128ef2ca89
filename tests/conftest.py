"""Shared fixtures: real binaries found or a clear failure, and a real agent process on a free port.

Starting and stopping the processes is `stallwatch.harness`, which the demo and the benchmarks share.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from stallwatch.harness import AgentProcess, find_binary, start_agent, stop_agent

# CI (which sets CI=true) runs the same examples every time, so a red build names a change, not a
# draw; local runs keep exploring new examples. Tests' own settings (example counts) build on this.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parent.parent


def require_binary(name: str, package: str) -> str:
    """Path of a real binary the tests need; `make test` installs it, so its absence is a failure."""
    found = find_binary(name)
    if found is None:
        pytest.fail(f"{name} not found: `make test` installs Debian's {package} (scripts/install-system-deps.sh)")
    return found


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool", "prometheus")


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
