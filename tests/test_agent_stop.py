"""Stopping a real agent: a signal to its whole process group (systemctl stop, Ctrl-C) is a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from stallwatch.harness import LISTENING, wait_for


@dataclass
class Agent:
    process: subprocess.Popen[str]
    log: Path

    @property
    def relay(self) -> psutil.Process:
        (child,) = psutil.Process(self.process.pid).children()
        return child


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    """An agent leading a process group of its own, as under systemd or in a terminal."""
    log = tmp_path / "agent.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "stallwatch", "agent", "--web.listen-address", "127.0.0.1:0",
             "--events.socket", str(tmp_path / "events.sock"), "--no-collector.gpu", "--no-collector.host"],
            stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_for("the agent to listen", lambda: bool(LISTENING.search(log.read_text())), 20, process, log)
        wait_for("the receive relay", lambda: len(psutil.Process(process.pid).children()) == 1, 10, process, log)
        yield Agent(process, log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_group_stops_the_agent_and_its_relay_without_an_error(agent: Agent, signum: int) -> None:
    relay = agent.relay
    os.killpg(agent.process.pid, signum)
    assert agent.process.wait(timeout=15) == 0
    relay.wait(timeout=10)  # gone, not left behind
    log = agent.log.read_text()
    assert "shutting down" in log
    assert "level=error" not in log and "Traceback" not in log, log


def test_a_relay_that_dies_while_the_agent_runs_is_still_an_error(agent: Agent) -> None:
    agent.relay.kill()
    wait_for("the agent to notice its relay is gone", lambda: "the receive relay exited" in agent.log.read_text(),
             10, agent.process, agent.log)
    assert "level=error" in agent.log.read_text()
    os.killpg(agent.process.pid, signal.SIGTERM)
    assert agent.process.wait(timeout=15) == 0
