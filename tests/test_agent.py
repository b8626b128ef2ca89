"""A real agent process: served over HTTP, linted by promtool, configured by flags and YAML."""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
from prometheus_client.core import Metric

from stallwatch import __version__, build, catalogue, harness
from stallwatch.eventbatch import EventBatch, discard
from stallwatch.exporters.agent import _build
from stallwatch.exporters.collector import Collector, CollectorContext, CollectorSpec
from stallwatch.exporters.config import ConfigError
from stallwatch.harness import AgentProcess
from tests.conftest import ROOT


def scrape(agent: AgentProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for (name, labels), value in harness.scrape(agent.url).items():
        out.setdefault(name, []).append((dict(labels), value))
    return out


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stallwatch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_serves_gpu_and_host_metrics_that_promtool_accepts(
    agent_factory: Callable[..., AgentProcess], promtool: str
) -> None:
    agent = agent_factory("--gpu.fake-devices", "2", "--gpu.interval", "0.1")
    harness.wait_for("both GPUs' utilization", lambda: len(scrape(agent).get(catalogue.GPU_UTILIZATION.name, [])) == 2,
                     15, agent.process, agent.log)
    metrics = scrape(agent)
    assert {labels["gpu"] for labels, _ in metrics[catalogue.GPU_UTILIZATION.name]} == {"0", "1"}
    assert metrics[catalogue.HOST_CPUS.name][0][1] >= 1
    success = {labels["collector"]: v for labels, v in metrics[catalogue.SCRAPE_COLLECTOR_SUCCESS.name]}
    assert success == {"correlator": 1.0, "events": 1.0, "gpu": 1.0, "host": 1.0}
    body = requests.get(agent.url, timeout=10).content
    lint = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint.stdout + lint.stderr
    assert requests.get(agent.base + "/-/healthy", timeout=5).text == "OK\n"
    assert "/metrics" in requests.get(agent.base + "/", timeout=5).text
    assert requests.get(agent.base + "/nope", timeout=5).status_code == 404


def test_openmetrics_is_served_when_asked(agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--no-collector.gpu")
    reply = requests.get(agent.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}, timeout=10)
    assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
    assert reply.text.rstrip().endswith("# EOF")


def test_without_a_gpu_the_agent_runs_on(agent_factory: Callable[..., AgentProcess]) -> None:
    # This machine has no NVIDIA driver: the real pynvml path must say so once and keep serving.
    agent = agent_factory()
    metrics = scrape(agent)
    assert metrics[catalogue.GPU_DEVICES.name] == [({}, 0.0)]
    assert metrics[catalogue.HOST_CPUS.name][0][1] >= 1
    time.sleep(0.5)
    assert agent.stderr().count("no GPU") == 1


def test_config_file_sets_options_and_flags_win(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text("collector.host: false\ngpu.fake-devices: 3\nweb.telemetry-path: /m\n")
    agent = agent_factory("--config.file", str(config), "--gpu.fake-devices", "1")
    assert agent.url.endswith("/m")
    metrics = scrape(agent)
    assert catalogue.HOST_CPUS.name not in metrics
    assert metrics[catalogue.GPU_DEVICES.name] == [({}, 1.0)]


@pytest.mark.parametrize(
    ("args", "config", "message"),
    [
        (["--bogus"], None, "unrecognized arguments: --bogus"),
        (["--log.format", "text"], None, "invalid choice: 'text'"),
        (["--gpu.interval", "-1"], None, "must be in (0, 60]"),
        (["--web.listen-address", "nowhere"], None, "is not [HOST]:PORT"),
        (["--config.file", "{config}"], "collector.gpu: [", "not valid YAML at line"),
        (["--config.file", "{config}"], "colector.gpu: true", "unknown option 'colector.gpu'"),
        (["--config.file", "{config}"], "collector.gpu: 3", "must be true or false"),
        (["--config.file", "{config}"], "gpu.interval: fast", "gpu.interval"),
        (["--config.file", "{config}"], "- a list", "expected a mapping"),
        (["--config.file", "/nonexistent/agent.yaml"], None, "cannot read"),
    ],
)
def test_bad_flags_and_files_are_one_line_and_exit_2(
    tmp_path: Path, args: list[str], config: str | None, message: str
) -> None:
    path = tmp_path / "agent.yaml"
    if config is not None:
        path.write_text(config + "\n")
    result = run_cli("agent", *[a.format(config=path) for a in args])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stallwatch agent: error:") and message in lines[0], result.stderr


def test_a_taken_port_is_a_one_line_error(agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--no-collector.gpu")
    address = agent.base.removeprefix("http://")
    result = run_cli("agent", "--no-collector.gpu", "--web.listen-address", address)
    assert result.returncode == 2 and "cannot listen on" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_command_and_help() -> None:
    assert run_cli("frobnicate").returncode == 2
    assert "agent" in run_cli("--help").stdout


def test_event_consumers_are_built_first_and_each_takes_every_other_collectors_batches() -> None:
    received: list[EventBatch] = []

    class Consumer:
        def submit(self, batch: EventBatch) -> None:
            received.append(batch)

        def collect(self) -> list[Metric]:
            return []

        def close(self) -> None: ...

    class Producer(Consumer):
        def __init__(self, context: CollectorContext) -> None:
            context.sink(EventBatch("gpu_util", {}))

    def consumer(_: CollectorContext) -> Consumer:
        return Consumer()

    specs = [CollectorSpec("producer", True, "", Producer),
             *(CollectorSpec(name, True, "", consumer, consumer=consumer) for name in ("first", "second"))]
    built = _build(specs, CollectorContext(options=argparse.Namespace(), sink=discard))
    assert list(built) == ["first", "second", "producer"]
    assert [batch.kind for batch in received] == ["gpu_util", "gpu_util"]  # each consumer got the batch


def test_a_collector_that_cannot_be_built_is_a_one_line_config_error() -> None:
    def broken(_: CollectorContext) -> Collector:
        raise OSError("no such file")

    with pytest.raises(ConfigError, match=r"^collector broken: no such file$"):
        _build([CollectorSpec("broken", True, "", broken)], CollectorContext(options=argparse.Namespace(),
                                                                             sink=discard))


def test_a_burst_of_connections_waits_in_the_listen_queue(agent_factory: Callable[..., AgentProcess]) -> None:
    """50 scrapers connecting at once while the agent is busy (here: stopped) are queued by the kernel,
    not dropped to SYN retries (Python's default backlog is 5; the exporters' is 128)."""
    agent = agent_factory("--no-collector.gpu", "--no-collector.host")
    host, port = urllib.parse.urlsplit(agent.url).netloc.split(":")
    agent.process.send_signal(signal.SIGSTOP)
    clients = [socket.socket() for _ in range(50)]
    try:
        for client in clients:
            client.setblocking(False)
            client.connect_ex((host, int(port)))
        time.sleep(1.0)
        _, connected, _ = select.select([], clients, [], 0)
        established = sum(client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 for client in connected)
    finally:
        agent.process.send_signal(signal.SIGCONT)
        for client in clients:
            client.close()
    print(f"{established} of 50 simultaneous connections established while the agent was busy")
    assert established == 50


def checkout_revision() -> str:
    """What the agent should report from this tree: git's HEAD where it is a checkout, else unknown."""
    if not (ROOT / ".git").exists():
        return build.UNKNOWN
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()[:12]


@pytest.mark.parametrize("command", [["--version"], ["agent", "--version"]])
def test_version_prints_version_and_revision_and_exits_0(command: list[str]) -> None:
    result = run_cli(*command)
    assert result.returncode == 0, result.stderr
    program = "stallwatch agent" if command[0] == "agent" else "stallwatch"
    assert result.stdout.startswith(f"{program}, version {__version__} (revision: {checkout_revision()},")
    assert len(result.stdout.strip().splitlines()) == 1


def test_build_info_carries_version_and_revision(agent_factory: Callable[..., AgentProcess]) -> None:
    metrics = scrape(agent_factory("--no-collector.gpu", "--no-collector.host"))
    assert metrics[catalogue.BUILD_INFO.name] == [({"version": __version__, "revision": checkout_revision()}, 1.0)]


def test_revision_sources(tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert build._from_direct_url(json.dumps({"url": "https://x/y.git", "vcs_info": {"vcs": "git",
                                                                                      "commit_id": commit}})) \
        == commit[:12]
    # An install from a directory or an index records no commit; a damaged record is no revision either.
    assert build._from_direct_url(json.dumps({"url": "file:///src", "dir_info": {}})) is None
    assert build._from_direct_url("{not json") is None
    (tmp_path / "_revision").write_text(commit.upper() + "\n")
    assert build._from_file(tmp_path / "_revision") == commit[:12]
    (tmp_path / "_revision").write_text("v1.2 dirty\n")
    assert build._from_file(tmp_path / "_revision") is None
    assert build._from_checkout(tmp_path) is None  # not a git checkout
