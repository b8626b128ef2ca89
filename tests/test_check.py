"""`stallwatch check` against real agents: a good setup with a small job sending through the real client, a
wrong socket path, no agent, a stale socket, another agent's socket, names no one can find, and spokes."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from stallwatch import check
from stallwatch.client.identity import JOB_SOURCES
from stallwatch.harness import AgentProcess, free_port, scrape, total
from tests.conftest import ROOT

# A small job: every file is one step's sample, read through the client in the step.
JOB = """import sys, time
from stallwatch.client import monitor, open_recorded
for path in monitor(sys.argv[1:]):
    with open_recorded(path) as handle:
        handle.read()
    time.sleep(0.01)
"""
STEPS = 6

Agent = tuple[AgentProcess, str]


@pytest.fixture
def agent(agent_factory: Callable[..., AgentProcess]) -> Callable[..., Agent]:
    """An agent and its events socket (a short path: sun_path holds 108 bytes)."""
    def start(*args: str) -> Agent:
        path = os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")
        return agent_factory("--no-collector.host", "--events.socket", path, *args), path
    return start


def run_check(url: str, env: Mapping[str, str], **flags: object) -> tuple[int, str]:
    """The check's status and what it printed, run here with `env` as the job's environment."""
    lines: list[str] = []
    options = argparse.Namespace(**{"agent_url": url, "socket": None, "job": None, "timeout": 5.0, **flags})
    status = check.run(options, env, lines.append)
    return status, "\n".join(lines)


def run_job(tmp_path: Path, env: Mapping[str, str]) -> None:
    files = []
    for n in range(STEPS):
        files.append(tmp_path / f"sample-{n}.bin")
        files[-1].write_bytes(os.urandom(4096))
    subprocess.run([sys.executable, "-c", JOB, *map(str, files)], env={**os.environ, **env}, cwd=ROOT, check=True,
                   timeout=120)


def test_each_job_source_is_named_after_the_variable_it_reads() -> None:
    assert len(check.JOB_SOURCE_NAMES) == len(JOB_SOURCES)
    for name, source in zip(check.JOB_SOURCE_NAMES, JOB_SOURCES, strict=True):
        assert source({name: "a-job"}) == "a-job"
        assert check.job_origin({name: "a-job"}) == name
    assert check.job_origin({}) is None


def test_a_small_job_through_the_real_client_checks_out(agent: Callable[..., Agent], tmp_path: Path) -> None:
    running, path = agent()
    env = {"STALLWATCH_SOCKET": path, "STALLWATCH_JOB": "resnet", "RANK": "1"}
    run_job(tmp_path, env)
    result = subprocess.run([sys.executable, "-m", "stallwatch", "check", "--agent.url", running.url],
                            env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "training_job='resnet' (from STALLWATCH_JOB), rank 1" in out
    assert "the agent at" in out and "already counts the job's events under training_job='resnet' rank 1" in out
    assert f"counts {STEPS} steps and" in out and "problem" not in out
    assert "no spoke collector is on" in out and out.endswith("all is well.\n")
    # The probe changed none of the job's figures: the agent still counts the job's own steps.
    assert total(scrape(running.url), "stallwatch_loader_wait_seconds_count", training_job="resnet") == STEPS


def test_failed_reads_are_counted_and_pointed_at(agent: Callable[..., Agent], tmp_path: Path) -> None:
    running, path = agent()
    env = {"STALLWATCH_SOCKET": path, "STALLWATCH_JOB": "resnet"}
    run_job(tmp_path, env)
    status, out = run_check(running.url, env)
    assert status == 0 and "got no bytes" not in out, out
    # Three fetches that got nothing (the client records a read that raised with the bytes it got: none).
    failing = ("import time\nfrom stallwatch.client import monitor, record_read\n"
               "for n in monitor(range(3)):\n    now = time.monotonic_ns()\n"
               "    record_read('http://hub/x', n, 0, now - 2_000_000, now)\n")
    subprocess.run([sys.executable, "-c", failing], env={**os.environ, **env}, cwd=ROOT, check=True, timeout=120)
    status, out = run_check(running.url, env)
    assert status == 0 and "3 of those reads got no bytes" in out and "Failed reads" in out, out


def test_reads_that_all_cross_no_spoke_on_a_node_with_one_point_at_the_spokes_address(
        agent: Callable[..., Agent], tmp_path: Path) -> None:
    """On a node whose agent watches a spoke, a job whose every read crossed no spoke by its client's account
    (captured reads of URLs or paths the client was not told are the spoke's) has its read stalls booked
    direct_read: the check says so, and how to tell the client where the spoke is."""
    spoke_log = tmp_path / "spoke.log"
    spoke_log.touch()
    running, path = agent("--collector.spoke_nginx", "--spoke_nginx.log", str(spoke_log))
    env = {"STALLWATCH_SOCKET": path, "STALLWATCH_JOB": "resnet"}
    direct = ("import time\nfrom stallwatch.client import monitor, record_read, wire\n"
              "for n in monitor(range(4)):\n    now = time.monotonic_ns()\n"
              "    record_read('http://spoke/x', n, 4096, now - 2_000_000, now, wire.VERDICT_DIRECT)\n")
    subprocess.run([sys.executable, "-c", direct], env={**os.environ, **env}, cwd=ROOT, check=True, timeout=120)
    status, out = run_check(running.url, env)
    assert status == 0 and "every read of job 'resnet' so far (4) crossed no spoke" in out, out
    assert "stallwatch run --spoke-url URL" in out and "STALLWATCH_SPOKE_URLS" in out
    run_job(tmp_path, env)  # reads left to the agent (verdict unknown): they may have crossed it
    status, out = run_check(running.url, env)
    assert status == 0 and "crossed no spoke" not in out, out


def test_a_wrong_socket_path_records_nothing_and_the_check_says_so(
    agent: Callable[..., Agent], tmp_path: Path
) -> None:
    running, path = agent()
    wrong = str(Path(path).with_name("event.sock"))
    env = {"STALLWATCH_SOCKET": wrong, "STALLWATCH_JOB": "resnet"}
    run_job(tmp_path, env)
    assert total(scrape(running.url), "stallwatch_loader_wait_seconds_count", training_job="resnet") == 0
    status, out = run_check(running.url, env)
    assert status == 1
    assert f"problem: the agent's socket, {wrong} (STALLWATCH_SOCKET), does not exist" in out
    assert "fix: start the agent" in out and "set STALLWATCH_SOCKET" in out
    assert "no step or read of job 'resnet'" in out
    status, out = run_check(running.url, env, socket=path)  # the right path: the probe gets there
    assert status == 0 and f"counted a probe sent to {path} (--socket) under training_job='resnet'" in out, out


def test_no_agent_and_a_stale_socket(tmp_path: Path) -> None:
    absent = f"http://127.0.0.1:{free_port()}/metrics"
    status, out = run_check(absent, {"STALLWATCH_SOCKET": str(tmp_path / "none.sock"), "STALLWATCH_JOB": "j"})
    assert status == 1
    assert "does not exist" in out and f"no agent answers at {absent}" in out and "fix: pass --agent.url" in out
    stale = os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as left:
        left.bind(stale)  # closed without removing the file, as an agent that was killed leaves it
    status, out = run_check(absent, {"STALLWATCH_SOCKET": stale, "STALLWATCH_JOB": "j"})
    assert status == 1 and "is a socket no agent is bound to" in out


def test_a_socket_of_another_agent_than_the_one_asked(agent: Callable[..., Agent]) -> None:
    (first, first_path), (second, _) = agent(), agent()
    status, out = run_check(second.url, {"STALLWATCH_SOCKET": first_path, "STALLWATCH_JOB": "j"}, timeout=2.0)
    assert status == 1 and f"did not reach the agent at {second.url}" in out
    assert total(scrape(first.url), "stallwatch_receiver_batches_total", result="accepted") == 1  # the probe


@pytest.mark.parametrize(("env", "words"), [
    ({}, ["the job has no name", "fix: export STALLWATCH_JOB=<name>"]),
    ({"TORCHELASTIC_RUN_ID": str(uuid.uuid4())}, ["a random one per launch", "--rdzv-id=<name>"]),
])
def test_a_job_no_one_can_find_by_name_is_a_problem(agent: Callable[..., Agent], env: dict[str, str],
                                                    words: list[str]) -> None:
    running, path = agent()
    status, out = run_check(running.url, {"STALLWATCH_SOCKET": path, **env})
    assert status == 1 and all(word in out for word in words), out
    assert "the job's events reach it" in out  # delivery itself is fine
    named = {"STALLWATCH_SOCKET": path, "TORCHELASTIC_RUN_ID": "nightly-resnet"}  # --rdzv-id=nightly-resnet
    assert run_check(running.url, named)[0] == 0


def test_steps_without_reads_and_a_failing_spoke_collector(agent: Callable[..., Agent], tmp_path: Path) -> None:
    running, path = agent("--collector.spoke_varnish", "--spoke_varnish.varnishstat", str(tmp_path / "none"))
    env = {"STALLWATCH_SOCKET": path, "STALLWATCH_JOB": "steps-only"}
    subprocess.run([sys.executable, "-c", "from stallwatch.client import monitor\nfor _ in monitor(range(5)): pass"],
                   env={**os.environ, **env}, cwd=ROOT, check=True, timeout=120)
    status, out = run_check(running.url, env)
    assert status == 1
    assert "counts 5 steps of job 'steps-only' but no read" in out and "stallwatch run" in out
    assert "spoke collectors on: spoke_varnish" in out and "the spoke_varnish collector fails" in out


def test_the_job_gpu_against_the_gpus_the_agent_measures(agent: Callable[..., Agent]) -> None:
    running, path = agent("--gpu.fake-devices", "2")
    env = {"STALLWATCH_SOCKET": path, "STALLWATCH_JOB": "j"}
    status, out = run_check(running.url, {**env, "LOCAL_RANK": "1"})
    assert status == 0 and "the job's GPU, index 1, is the node's GPU 1" in out, out
    status, out = run_check(running.url, {**env, "CUDA_VISIBLE_DEVICES": f"GPU-{uuid.uuid4()}"})
    assert status == 1 and "is none of the 2 GPUs the agent measures" in out
