"""The events receive relay attacked while clients send: killed, stopped, or started from a directory where a
`stallwatch` package was planted. Each against a real agent, its real relay and the real client."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stallwatch.client import monitor, transport, wire
from stallwatch.harness import LISTENING, AgentProcess, Samples, scrape, stop_agent, total, wait_for

AGENT_ARGS = ("--no-collector.gpu", "--no-collector.host")


@pytest.fixture
def socket_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The path of the agent's socket, which this process's client sends to."""
    path = str(tmp_path / "events.sock")
    monkeypatch.setenv(wire.SOCKET_ENV, path)  # `configure` sets it too: undone after the test
    transport.configure(path)
    yield path
    transport.sender().close()


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, by pid: their state (`Z`: a zombie, never reaped)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found[int(stat.parent.name)] = fields[0]
    return found


def live_relay(agent: AgentProcess) -> int:
    """The pid of the agent's one running relay (its only child that is not a zombie)."""
    (pid,) = [child for child, state in children(agent.process.pid).items() if state != "Z"]
    return pid


def steps(job: str, count: int, pause_s: float = 0.0) -> None:
    for _ in monitor(range(count), job=job, rank=0):
        time.sleep(pause_s)


def counted(samples: Samples) -> float:
    """Steps the agent knows of: those it accepted, and those clients said they dropped."""
    return total(samples, "stallwatch_receiver_events_total", kind="step") + total(
        samples, "stallwatch_client_dropped_events_total")


def healthy(agent: AgentProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{agent.base}/-/healthy", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_killed_relay_is_reaped_and_restarted_and_every_step_after_it_is_counted(
    agent_factory: Callable[..., AgentProcess], socket_path: str,
) -> None:
    agent = agent_factory(*AGENT_ARGS, "--events.socket", socket_path)
    steps("killed", 100)
    wait_for("100 steps", lambda: counted(scrape(agent.url)) == 100, 10)
    first = live_relay(agent)
    trainer = threading.Thread(target=steps, args=("killed", 2_000, 0.0005))  # a second of steps, several batches
    os.kill(first, signal.SIGKILL)
    killed = time.monotonic()
    trainer.start()
    wait_for("another relay", lambda: total(scrape(agent.url), "stallwatch_receiver_relay_restarts_total") == 1, 10)
    restarted = time.monotonic() - killed
    trainer.join()
    second = live_relay(agent)
    steps("killed", 10)  # a batch that gets through carries what the client dropped before it
    wait_for("every step counted", lambda: counted(scrape(agent.url)) == 2_110, 10)
    samples = scrape(agent.url)
    dropped = total(samples, "stallwatch_client_dropped_events_total")
    print(f"relay {first} killed; {second} relaying {restarted:.2f} s later; of 2,110 steps "
          f"{2_110 - dropped:.0f} accepted, {dropped:.0f} dropped by the client and reported")
    assert second != first and first not in children(agent.process.pid)  # reaped: no zombie left behind
    assert total(samples, "stallwatch_receiver_up") == 1
    assert healthy(agent)[0] == 200
    assert f"the receive relay exited: pid {first} was killed by SIGKILL" in agent.stderr()


def test_a_stopped_relay_marks_the_receiver_down_and_the_agent_unhealthy_and_the_drops_reach_the_agent(
    agent_factory: Callable[..., AgentProcess], socket_path: str,
) -> None:
    agent = agent_factory(*AGENT_ARGS, "--events.socket", socket_path)
    steps("stopped", 10)
    wait_for("10 steps", lambda: counted(scrape(agent.url)) == 10, 10)
    relay = live_relay(agent)
    sending = threading.Event()
    sent = [0]

    def train() -> None:  # steps at 1 kHz while the relay is stopped: the kernel's queue fills, the client drops
        while sending.is_set():
            steps("stopped", 100, pause_s=0.001)
            sent[0] += 100

    sending.set()
    trainer = threading.Thread(target=train)
    os.kill(relay, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        trainer.start()
        wait_for("receiver_up 0", lambda: total(scrape(agent.url), "stallwatch_receiver_up") == 0, 12)
        noticed = time.monotonic() - stopped
        status, answer = healthy(agent)
    finally:
        os.kill(relay, signal.SIGCONT)
        sending.clear()
        trainer.join()
    steps("stopped", 10)
    expected = 10 + sent[0] + 10
    wait_for("every step counted", lambda: counted(scrape(agent.url)) == expected, 10)
    samples = scrape(agent.url)
    dropped = total(samples, "stallwatch_client_dropped_events_total")
    print(f"relay stopped: receiver_up 0 after {noticed:.1f} s, /-/healthy {status} {answer.strip()!r}; "
          f"of {expected} steps {expected - dropped:.0f} accepted, {dropped:.0f} dropped by the client and reported")
    assert status == 503 and "receive relay" in answer
    assert dropped > 0  # the stall cost steps, and the agent heard of them once the relay ran again
    assert total(samples, "stallwatch_receiver_up") == 1 and healthy(agent)[0] == 200
    assert total(samples, "stallwatch_receiver_relay_restarts_total") == 0  # it lost nothing: left to run
    assert live_relay(agent) == relay


def test_the_batches_a_killed_relay_held_are_counted_lost(
    agent_factory: Callable[..., AgentProcess], socket_path: str,
) -> None:
    agent = agent_factory(*AGENT_ARGS, "--events.socket", socket_path)
    relay = live_relay(agent)
    now, wall = time.monotonic_ns(), time.time_ns()
    reads = [(0, 1, 4096, now - 2, now - 1, wire.VERDICT_HIT)] * wire.MAX_EVENTS
    batch = wire.encode(wire.Source("held", 0), [], reads, 0, len(reads), 0, now, wall)
    sent = 60  # 2.5 MB: more than the pipe holds while the agent reads nothing, the rest in the relay
    agent.process.send_signal(signal.SIGSTOP)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.settimeout(5)
            for _ in range(sent):
                sender.sendto(batch, socket_path)
        time.sleep(0.5)  # for the relay to take the last of them
        os.kill(relay, signal.SIGKILL)
    finally:
        agent.process.send_signal(signal.SIGCONT)
    wait_for("a relay again", lambda: total(scrape(agent.url), "stallwatch_receiver_relay_restarts_total") == 1, 10)
    samples = scrape(agent.url)
    accepted = total(samples, "stallwatch_receiver_batches_total", result="accepted")
    lost = total(samples, "stallwatch_receiver_batches_total", result="relay_lost")
    print(f"{sent} batches sent; {accepted:.0f} reached the agent, {lost:.0f} counted lost with the relay")
    assert lost > 0 and accepted + lost == sent


def test_the_relay_runs_no_stallwatch_package_from_the_working_directory(
    socket_path: str, tmp_path: Path,
) -> None:
    planted = tmp_path / "world-writable"
    (planted / "stallwatch" / "exporters").mkdir(parents=True)
    planted.chmod(0o1777)
    marker = tmp_path / "ran"
    (planted / "stallwatch" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (planted / "stallwatch" / "exporters" / "__init__.py").write_text("")
    (planted / "stallwatch" / "exporters" / "receive_relay.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n")
    log = tmp_path / "agent.log"
    # As installed: the `stallwatch` entry point, whose own path holds no package, started in that directory.
    entry_point = str(Path(sys.executable).parent / "stallwatch")
    with log.open("w") as sink:
        process = subprocess.Popen(
            [entry_point, "agent", "--web.listen-address", "127.0.0.1:0", *AGENT_ARGS, "--events.socket", socket_path],
            cwd=planted, stdout=sink, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_for("the agent listening", lambda: LISTENING.search(log.read_text()) is not None, 20, process, log)
        match = LISTENING.search(log.read_text())
        assert match is not None
        agent = AgentProcess(process, match.group(1), log)
        steps("planted", 10)
        wait_for("10 steps, or the planted code run", lambda: marker.exists() or counted(scrape(agent.url)) == 10,
                 10, process, log)
        assert not marker.exists(), "the relay ran the planted package"
    finally:
        stop_agent(AgentProcess(process, "", log))
