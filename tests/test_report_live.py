"""`stallwatch report` against real servers: a Prometheus 2.42 behind TLS and basic auth
(`--web.config.file`) scraping a real agent, and both report modes of one real demo run."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import numpy as np
import pytest
import yaml

from stallwatch import catalogue as c
from stallwatch import prices
from stallwatch.demo.run import JOB, Demo, Settings
from stallwatch.demo.stack import RELABELS, SCRAPE_INTERVAL_SECONDS
from stallwatch.harness import AgentProcess, free_port, start_agent, stop_agent, stop_process, wait_for
from stallwatch.report.api import Access, Prometheus, PrometheusError
from stallwatch.report.prometheus import range_step, run_from_prometheus
from stallwatch.report.run import Run, Series
from stallwatch.report.scope import Scope
from stallwatch.report.windows import run_from_windows
from tests.conftest import ROOT, require_binary
from tests.test_security import self_signed

pytestmark = pytest.mark.slow
USER, PASSWORD = "report", "report-pass-3"


@dataclass
class Secured:
    url: str
    ca: Path
    password_file: Path
    node: str  # the agent's `node` label: its host, as the shipped scrape configs set it
    work: Path
    socket: Path  # the agent's events socket

    def access(self, **changes: object) -> Access:
        return Access(**{"basic_auth_user": USER, "basic_auth_password_file": self.password_file,
                         "ca_file": self.ca, **changes})  # type: ignore[arg-type]


def _answers(prometheus: Prometheus, expr: str) -> bool:
    try:
        return bool(prometheus.instant(expr, time.time()))
    except PrometheusError:  # not listening yet
        return False


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    binary = require_binary("prometheus", "prometheus")
    work = tmp_path_factory.mktemp("secured")
    agent: AgentProcess = start_agent(["--gpu.fake-devices", "2", "--events.socket", str(work / "events.sock")],
                                      work / "agent.log")
    _, cert = self_signed(work, "127.0.0.1")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    (work / "web.yml").write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": str(cert), "key_file": str(work / "127.0.0.1.key")},
        "basic_auth_users": {USER: hashed}}))
    target = agent.url.split("//")[1].split("/", 1)[0]
    (work / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "stallwatch", "relabel_configs": RELABELS,
                            "static_configs": [{"targets": [target]}]}]}))
    (work / "password").write_text(PASSWORD + "\n")
    port = free_port()
    log = work / "prometheus.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                                    f"--web.config.file={work / 'web.yml'}"], stdout=sink, stderr=subprocess.STDOUT)
    try:
        setup = Secured(f"https://127.0.0.1:{port}", cert, work / "password", target.rsplit(":", 1)[0], work,
                        work / "events.sock")
        prometheus = Prometheus(setup.url, setup.access())
        wait_for("Prometheus to scrape the agent's GPUs twice",
                 lambda: _answers(prometheus, f"count_over_time({c.GPU_UTILIZATION.name}[1m]) >= 2"), 60, process, log)
        yield setup
    finally:
        stop_process(process)
        stop_agent(agent)


def report(secured: Secured, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stallwatch", "report", "--prometheus", secured.url, "--start", "-2m",
                           "--out", str(secured.work / "report.html"), *flags],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_report_reaches_prometheus_through_tls_and_basic_auth(secured: Secured) -> None:
    (secured.work / "report.html").unlink(missing_ok=True)
    done = report(secured, "--basic-auth-user", USER, "--basic-auth-password-file", str(secured.password_file),
                  "--ca-file", str(secured.ca), "--node", secured.node)
    assert done.returncode == 0, done.stderr
    page = (secured.work / "report.html").read_text()
    assert f"Run from {time.strftime('%Y-%m-%d', time.gmtime())}" in page and f"node {secured.node}." in page
    insecure = report(secured, "--basic-auth-user", USER, "--basic-auth-password-file", str(secured.password_file),
                      "--insecure-skip-tls-verify")
    assert insecure.returncode == 0, insecure.stderr


@pytest.mark.parametrize(("flags", "said"), [
    (["--basic-auth-user", USER, "--basic-auth-password-file", "{wrong}", "--ca-file", "{ca}"],
     "refused the credentials (HTTP 401 Unauthorized)"),
    (["--basic-auth-user", "mallory", "--basic-auth-password-file", "{password}", "--ca-file", "{ca}"],
     "refused the credentials (HTTP 401 Unauthorized)"),
    (["--bearer-token-file", "{wrong}", "--ca-file", "{ca}"], "refused the credentials"),
    (["--ca-file", "{ca}"], "asks for credentials (HTTP 401 Unauthorized): give --basic-auth-user"),
    (["--basic-auth-user", USER, "--basic-auth-password-file", "{password}"],
     "cannot verify the certificate of https://127.0.0.1:"),
])
def test_refusals_are_one_line_and_exit_1(secured: Secured, flags: list[str], said: str) -> None:
    (secured.work / "wrong").write_text("not-the-password\n")
    paths = {"wrong": secured.work / "wrong", "ca": secured.ca, "password": secured.password_file}
    done = report(secured, *(flag.format(**paths) for flag in flags))
    assert done.returncode == 1 and said in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert PASSWORD not in done.stderr
    if "certificate" in said:
        assert "--ca-file" in done.stderr and "--insecure-skip-tls-verify" in done.stderr


def known(series: Series) -> int:
    """How many of the series' values are known."""
    return int(np.count_nonzero(~np.isnan(series.v)))


def stall_time(run: Run, until: float) -> float:
    """The mean time of the run's stall-seconds before `until`, each weighted by its seconds."""
    series = list(run.stall_by_cause.values())
    t = (series[0].t + series[0].end) / 2
    seconds = np.nansum([s.v * (s.end - s.t) for s in series], axis=0) * (t < until)
    return float(np.sum(seconds * t) / np.sum(seconds))


def test_filters_narrow_every_query_on_a_real_prometheus(secured: Secured) -> None:
    end = time.time()

    def run(scope: Scope) -> tuple[int, int]:
        got = run_from_prometheus(secured.url, end - 120, end, scope, secured.access())
        utilization = got.gpu_utilization or Series.empty()  # none: the scope's nodes have no GPU
        return known(utilization), sum(known(series) for series in got.stall_by_cause.values())

    assert run(Scope())[0] > 0
    assert run(Scope(node=secured.node))[0] > 0
    assert run(Scope(node="elsewhere")) == (0, 0)
    # No job ran on this agent: a job's GPUs come from the correlator's map, which names none (and every
    # query, the `@ end()` lookup among them, is one Prometheus accepts).
    assert run(Scope(job="nobody"))[0] == 0


def test_over_several_jobs_the_report_names_them_instead_of_running_their_phases_together(secured: Secured) -> None:
    from stallwatch.client import transport, wire

    client = transport.configure(str(secured.socket))
    channels = [client.channel(wire.Source(job, 0)) for job in ("alpha", "beta")]
    prometheus = Prometheus(secured.url, secured.access())
    phases = f'count({c.WARMUP_PHASE.name}{{{c.JOB_LABEL}=~"alpha|beta"}} == 1)'
    deadline = time.monotonic() + 60
    batch = 0
    while not _answers(prometheus, f"{phases} == 2") and time.monotonic() < deadline:
        for _ in range(10):
            end = time.monotonic_ns()
            for channel in channels:
                channel.step((batch, end - 2_000_000, end - 1_000_000, end, -1))
            batch += 1
            time.sleep(0.02)
        client.flush_all()
    assert _answers(prometheus, f"{phases} == 2"), "both jobs' phases reached Prometheus"
    until = time.time()
    both = run_from_prometheus(secured.url, until - 120, until, Scope(), secured.access())
    alpha = run_from_prometheus(secured.url, until - 120, until, Scope(job="alpha"), secured.access())
    assert both.phases == [] and both.several_jobs == ("alpha", "beta")
    assert alpha.phases and alpha.several_jobs == ()


def phase_starts(run: Run) -> list[tuple[str, float]]:
    return [(phase, start) for start, _, phase in run.phases]


def test_both_report_modes_of_one_run_agree_on_its_phases(tmp_path: Path) -> None:
    """A real demo run (hub, nginx spoke, DataLoader job, agent, Prometheus) read from Prometheus over a
    span that starts before the job, as a user's `--start -10m` does, and from its window file: the same
    phases, on the wall clock. Prometheus holds only the windows its scrapes caught, and the report reads
    it at its range step, so a phase's start there is the window file's within a scrape, a step and a
    window (0.5 and 1.0 s apart were both seen with 0.5 s windows, 1 s scrapes and 1 s steps); so is its
    stall's time."""
    for binary, package in (("nginx", "nginx-light"), ("prometheus", "prometheus")):
        require_binary(binary, package)
    settings = Settings(duration=30, shards=48, shard_mib=1, bandwidth_mbit=100, quiet=True, workdir=tmp_path)
    before = time.time() - 60
    from_prometheus: list[Run] = []
    resolution: list[float] = []

    def read_prometheus(prometheus: str | None, agent: str) -> None:
        assert prometheus is not None
        until = time.time()
        from_prometheus.append(run_from_prometheus(prometheus, before, until, Scope(job=JOB)))
        resolution.append(SCRAPE_INTERVAL_SECONDS + range_step(before, until) + settings.window_seconds)

    outcome = Demo(settings).run(while_running=read_prometheus)
    from_windows = run_from_windows(outcome.windows, JOB)
    prometheus_phases = phase_starts(from_prometheus[0])
    # The window file also holds the windows published after Prometheus was read (the job's last ones, held
    # until the agent stopped): compare what both had.
    read_until = from_prometheus[0].phases[-1][1]
    window_phases = [(phase, start) for phase, start in phase_starts(from_windows) if start < read_until]
    print("prometheus:", prometheus_phases, "\nwindows:", window_phases)
    utilization = from_prometheus[0].gpu_utilization
    assert utilization is not None and known(utilization) > 0  # the job's GPUs, found through the correlator's map
    assert [p for p, _ in prometheus_phases] == [p for p, _ in window_phases]
    assert outcome.started - settings.window_seconds <= window_phases[0][1] <= outcome.ended  # a wall-clock time
    for (phase, seen), (_, recorded) in zip(prometheus_phases, window_phases, strict=True):
        assert abs(seen - recorded) <= resolution[0], (phase, seen, recorded)
    # The stall is drawn at the same time by both: the correlator stamps a window's series with its end.
    assert abs(stall_time(from_prometheus[0], read_until) - stall_time(from_windows, read_until)) <= resolution[0]
    # The demo gives the agent its dataset's size: both modes hold the forecast the correlator published while cold.
    for run in (from_prometheus[0], from_windows):
        told = run.forecast_time_to_steady
        assert np.isfinite(told.v).any(), run.source
        assert run.time_to_steady_seconds is not None
        assert abs(np.nanmedian(told.v) - run.time_to_steady_seconds) <= 0.5 * run.time_to_steady_seconds
    # The demo's fake GPUs are H200s, a type the price table lacks: the agent priced them at the default type.
    assert from_prometheus[0].gpu_types == (prices.DEFAULT_GPU_TYPE,)
    # The agent publishes the dataset's size it was given: the report's stage-or-stream copy is of that.
    assert from_prometheus[0].dataset_bytes == settings.dataset_bytes
