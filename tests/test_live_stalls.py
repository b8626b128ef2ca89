"""Stalls seen while they last, on the real stack: a real agent fed by a real PyTorch job through the
client, a real Prometheus scraping it every second, and the demo's outage through Alertmanager.

The client reports what is in flight at each flush (a trainer waiting, a worker's read open) and the
correlator books an open stall window by window, so the stall counter rises during the stall, the stall
alert fires during the outage, and a job that ends is not waited for.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

from stallwatch import catalogue as c
from stallwatch.client import ReadSpan
from stallwatch.client.torch import instrument
from stallwatch.demo.run import DEMO_THRESHOLDS, Demo, Outcome, Settings, status_line
from stallwatch.demo.stack import Server, query, start_prometheus
from stallwatch.harness import AgentProcess, Samples, scrape, total
from stallwatch.mixin.config import duration_seconds
from tests.conftest import ROOT, require_binary

pytestmark = pytest.mark.slow
STALL_THRESHOLD_S = 0.001  # the correlator's: shorter waits are not stalls
STARVED = "StallwatchGPUsStarvedByRemoteFetches"
HUB_FAILING = "StallwatchHubFailingWhileTrainingStalls"


class Items(Dataset[bytes]):
    """Small files, each read through the client (`ReadSpan`); the read of item `hang_index` hangs
    `hang_s` inside its span (a remote read that does not answer), or with `fail_fast` fails at once and is
    retried after a second's back-off for `hang_s` (a spoke answering an error for an unreachable hub), or,
    given `hanging_url`, is a plain `requests.get` of it (captured, as `stallwatch run` captures it), and
    says on stdout when that began."""

    def __init__(self, folder: str, items: int, hang_index: int, hang_s: float, fail_fast: bool = False,
                 hanging_url: str = "") -> None:
        self.folder, self.items, self.hang_index, self.hang_s = Path(folder), items, hang_index, hang_s
        self.fail_fast, self.hanging_url = fail_fast, hanging_url

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> bytes:
        path = self.folder / str(index % 8)
        if index == self.hang_index:
            started = time.time()
            print(json.dumps({"hang_started": started}), flush=True)
            if self.hanging_url:
                import requests
                return bytes(requests.get(self.hanging_url, timeout=self.hang_s + 30).content)
            while self.fail_fast and time.time() < started + self.hang_s:
                try:
                    with ReadSpan(str(path)):
                        raise ConnectionError("502 Bad Gateway")
                except ConnectionError:
                    time.sleep(1.0)
        with ReadSpan(str(path)) as span:
            if index == self.hang_index and not self.fail_fast:
                time.sleep(self.hang_s)
            data = path.read_bytes()
            span.bytes = len(data)
        return data


def job(options: dict[str, Any]) -> None:
    """A small training job (run in a process of its own): two loader workers, a fixed compute per step,
    epochs until `train_s` has passed. Prints its loop's end (unix time) and its own measure of the steps:
    the seconds computed and the waits over the stall threshold."""
    folder = Path(options["folder"])
    for name in range(8):
        (folder / str(name)).write_bytes(os.urandom(4096))
    dataset = Items(str(folder), options["items"], options.get("hang_index", -1), options.get("hang_s", 0.0),
                    options.get("fail_fast", False), options.get("hanging_url", ""))
    loader = instrument(DataLoader(dataset, batch_size=4, num_workers=2), job=options["job"], rank=0)
    computed = stalled = 0.0
    deadline = time.monotonic() + options["train_s"]
    while time.monotonic() < deadline:
        batches = iter(loader)  # starts the epoch's workers: the client times the waits from here on
        asked = time.monotonic()
        for _batch in batches:
            got = time.monotonic()
            stalled += got - asked if got - asked > STALL_THRESHOLD_S else 0.0
            time.sleep(options["compute_s"])
            asked = time.monotonic()
            computed += asked - got
    print(json.dumps({"ended": time.time(), "computed": computed, "stalled": stalled}), flush=True)


def start_job(socket: str, env: dict[str, str] | None = None, **options: Any) -> subprocess.Popen[str]:
    code = f"import json; from tests.test_live_stalls import job; job(json.loads({json.dumps(options)!r}))"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, STALLWATCH_SOCKET=socket, **(env or {})))


def next_line(process: subprocess.Popen[str]) -> dict[str, Any]:
    """The job's next report on stdout."""
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"the job exited ({process.wait()}) without reporting"
    reply: dict[str, Any] = json.loads(line)
    return reply


@pytest.fixture
def socket() -> str:
    return os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")  # short: sun_path holds 108 bytes


@pytest.fixture
def agent(agent_factory: Callable[..., AgentProcess], socket: str, tmp_path: Path) -> AgentProcess:
    """An agent with a spoke: its nginx collector on (over a log nobody writes), so reads may cross a spoke."""
    spoke_log = tmp_path / "spoke.log"
    spoke_log.touch()
    return agent_factory("--events.socket", socket, "--no-collector.gpu", "--no-collector.host",
                         "--collector.spoke_nginx", "--spoke_nginx.log", str(spoke_log))


@pytest.fixture
def prometheus(agent: AgentProcess, tmp_path: Path) -> Iterator[Server]:
    target = agent.url.split("//")[1].split("/", maxsplit=1)[0]
    server = start_prometheus(require_binary("prometheus", "prometheus"), tmp_path / "prometheus", [target], [])
    yield server
    server.close()


def stalls(samples: Samples, name: str) -> dict[str, float]:
    return {cause: total(samples, c.STALL_SECONDS.name, training_job=name, cause=cause) for cause in c.CAUSES}


def prometheus_stalls(prometheus: str, name: str) -> dict[str, float]:
    """The job's stall seconds by cause in Prometheus now (its latest samples)."""
    reply = query(prometheus, f'sum by (cause) ({c.STALL_SECONDS.name}{{training_job="{name}"}})')
    return {r["metric"]["cause"]: float(r["value"][1]) for r in reply["data"]["result"]}


@pytest.mark.parametrize("fail_fast", [False, True], ids=["hanging", "failing fast"])
def test_a_hanging_reads_stall_is_booked_while_it_lasts(
        agent: AgentProcess, prometheus: Server, socket: str, tmp_path: Path, fail_fast: bool) -> None:
    """A worker's read hangs 20 s; 12 s into it the agent and Prometheus (1 s scrapes) hold 8 s or more of
    the rank's stall, nearly all remote_fetch (an open read that long is a miss): the counter rises with the
    stall, within about 2 s of real time, not when the batch finally arrives. Alike when the read fails at
    once, again and again, the worker sleeping a second between tries: the back-off waits on the hub too
    (booked as the worker's own work, `preprocess`, before), and the failures are counted as they happen."""
    process = start_job(socket, folder=str(tmp_path), job="hang", items=400, hang_index=160, hang_s=20.0,
                        compute_s=0.05, train_s=1.0, fail_fast=fail_fast)
    try:
        hang_started = next_line(process)["hang_started"]
        before = stalls(scrape(agent.url), "hang")
        time.sleep(max(0.0, hang_started + 12.0 - time.time()))
        samples = scrape(agent.url)
        in_agent, in_prometheus = stalls(samples, "hang"), prometheus_stalls(prometheus.url, "hang")
        failed = total(samples, c.DATASET_FAILED_READS.name, training_job="hang")
        assert failed >= 10 if fail_fast else failed == 0, failed  # a try a second, counted as it fails
        booked = {cause: in_agent[cause] - before[cause] for cause in c.CAUSES}
        assert sum(booked.values()) >= 8.0, (booked, before)
        assert booked["remote_fetch"] >= 0.9 * sum(booked.values()), booked
        assert sum(in_prometheus.values()) - sum(before.values()) >= 8.0, (in_prometheus, before)
        print(f"12 s into the hang: {sum(booked.values()):.2f} s booked on /metrics, "
              f"{sum(in_prometheus.values()) - sum(before.values()):.2f} s in Prometheus, by cause {booked}")
        assert next_line(process)["ended"] > hang_started + 20.0
    finally:
        process.kill()
        process.wait()


QUIET_S = 20.0


class _QuietHub(BaseHTTPRequestHandler):
    """Answers a GET only after `QUIET_S`: a hub, or a spoke waiting on one, gone quiet."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        time.sleep(QUIET_S)
        body = os.urandom(4096)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_plain_http_read_waiting_for_its_reply_is_booked_while_it_lasts(
        agent: AgentProcess, socket: str, tmp_path: Path) -> None:
    """A worker's plain `requests.get` through a spoke (captured: the Dataset calls no stallwatch API) waits 20 s
    for the reply's headers. 12 s in, the agent holds 8 s or more of the stall, nearly all remote_fetch: the
    request is an open read from when it was sent, not the worker's own work (`preprocess`)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _QuietHub)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spoke = f"http://127.0.0.1:{server.server_port}"
    process = start_job(socket, {"STALLWATCH_SPOKE_URLS": spoke}, folder=str(tmp_path), job="quiet", items=400,
                        hang_index=160, hang_s=QUIET_S, compute_s=0.05, train_s=1.0, hanging_url=f"{spoke}/item.bin")
    try:
        hang_started = next_line(process)["hang_started"]
        before = stalls(scrape(agent.url), "quiet")
        time.sleep(max(0.0, hang_started + 12.0 - time.time()))
        booked = {cause: seconds - before[cause] for cause, seconds in stalls(scrape(agent.url), "quiet").items()}
        print(f"12 s into a request's wait for its reply: {sum(booked.values()):.2f} s booked, by cause {booked}")
        assert sum(booked.values()) >= 8.0, (booked, before)
        assert booked["remote_fetch"] >= 0.9 * sum(booked.values()), booked
        assert next_line(process)["ended"] > hang_started + QUIET_S
    finally:
        process.kill()
        process.wait()
        server.shutdown()
        server.server_close()


def test_a_slow_read_on_a_node_without_a_spoke_is_a_direct_read_not_a_remote_fetch(
        agent_factory: Callable[..., AgentProcess], socket: str, tmp_path: Path) -> None:
    """No spoke collector on: a local read that takes 3 s crosses no spoke, so its stall is `direct_read`, none
    of it `remote_fetch` (the latency split would call a read that slow a miss)."""
    agent = agent_factory("--events.socket", socket, "--no-collector.gpu", "--no-collector.host")
    process = start_job(socket, folder=str(tmp_path), job="local", items=160, hang_index=60, hang_s=3.0,
                        compute_s=0.02, train_s=0.5)
    try:
        next_line(process)
        truth = next_line(process)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
    booked: dict[str, float] = {}
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and sum(booked.values()) < truth["stalled"] * 0.95:
        booked = stalls(scrape(agent.url), "local")
        time.sleep(0.2)
    print(f"a 3 s local read with no spoke: stall seconds by cause {booked}, the job's own {truth['stalled']:.2f} s")
    assert booked["direct_read"] >= 2.7, booked
    assert booked["remote_fetch"] == 0.0 and booked["cache_read"] == 0.0, booked


def test_a_short_jobs_series_reach_the_agent_within_3_s_of_its_end(
        agent: AgentProcess, socket: str, tmp_path: Path) -> None:
    """A job trains 5 s and exits; its rank's stall and compute seconds, all of them (its own measure), are
    on the agent's /metrics within 3 s of its loop's end: the agent does not wait for the ended rank."""
    process = start_job(socket, folder=str(tmp_path), job="short", items=200, compute_s=0.02, train_s=5.0)
    truth = next_line(process)
    seen: list[tuple[float, float, float]] = []  # (unix time, stall, compute seconds on /metrics)
    while time.time() < truth["ended"] + 10.0:
        samples = scrape(agent.url)
        seen.append((time.time(), sum(stalls(samples, "short").values()),
                     total(samples, c.COMPUTE_SECONDS.name, training_job="short")))
        time.sleep(0.1)
    assert process.wait(timeout=30) == 0
    final = seen[-1][1:]
    assert final[1] == pytest.approx(truth["computed"], rel=0.02, abs=0.02), (final, truth)
    assert final[0] == pytest.approx(truth["stalled"], rel=0.05, abs=0.05), (final, truth)
    reached = next(at for at, *values in seen if tuple(values) == final)
    assert reached - truth["ended"] <= 3.0, (reached - truth["ended"], seen[:40])
    print(f"the short job's last seconds on /metrics {reached - truth['ended']:.2f} s after its end")


Outage = tuple[Outcome, dict[str, dict[str, list[float]]]]


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Outage:
    """The demo with a 60 s outage, cut 22 s in (so the job trains 92 s), and per alert (the starvation and the
    failing-hub alerts) the times Prometheus had it pending and firing. The demo's hub answers nothing while
    cut, as a broken long-haul link does: no fetch through the spoke fails within its timeout."""
    for binary, package in (("nginx", "nginx-light"), ("prometheus", "prometheus"),
                            ("prometheus-alertmanager", "prometheus-alertmanager")):
        require_binary(binary, package)
    settings = Settings(duration=40, shards=48, shard_mib=1, bandwidth_mbit=100, outage=True, outage_seconds=60,
                        quiet=True, workdir=tmp_path_factory.mktemp("outage"))
    states: dict[str, dict[str, list[float]]] = {STARVED: {}, HUB_FAILING: {}}

    def alert_states(prometheus: str | None, agent: str) -> None:
        assert prometheus is not None
        for alert, by_state in states.items():
            for series in query(prometheus, f'ALERTS{{alertname="{alert}"}}[10m]')["data"]["result"]:
                by_state.setdefault(series["metric"]["alertstate"], []).extend(
                    float(at) for at, _ in series["values"])

    return Demo(settings).run(while_running=alert_states), states


@pytest.mark.parametrize(("alert", "for_"), [(STARVED, DEMO_THRESHOLDS.gpu_starved_for),
                                             (HUB_FAILING, DEMO_THRESHOLDS.hub_failing_for)])
def test_the_outage_alerts_fire_during_the_outage(outage: Outage, alert: str, for_: str) -> None:
    """Each alert, not firing when the hub is cut, fires while it is still cut, and no later than the cut plus its
    `for`, its rate window and 30 s: the stall is booked as it lasts, not after the outage, and a hub that
    answers nothing fails the agent's probes of it long before any fetch gives up."""
    outcome, states = outage
    cut = outcome.cut_at
    assert cut is not None and alert in outcome.fired_at, (outcome.alerts, states)
    firing = states[alert].get("firing", [])
    assert not [at for at in firing if cut - 2.0 <= at <= cut], "already firing when the hub was cut"
    fired = min(at for at in firing if at > cut)
    pending = min(at for at in states[alert].get("pending", []) if at > cut - 2.0)
    received = outcome.fired_at[alert]
    since_cut = {"pending": pending - cut, "firing": fired - cut, "received": received - cut}
    deadline = cut + duration_seconds(for_) + duration_seconds(DEMO_THRESHOLDS.rate_window) + 30.0
    assert fired <= received < min(cut + 60.0, deadline), since_cut
    print(f"{alert} after the cut (s): {since_cut}")


@pytest.mark.parametrize("alert", [STARVED, HUB_FAILING])
def test_the_outage_alerts_resolve_once_the_hub_is_back(outage: Outage, alert: str) -> None:
    """The demo waits for the outage's alerts to end: each resolves after the hub is back, within its rate window
    and 30 s of it (the job's stalls end, the probes succeed again), and the webhook hears it."""
    outcome, _ = outage
    assert outcome.cut_at is not None
    back = outcome.cut_at + 60.0
    resolved = [a for a in outcome.alerts if a["labels"]["alertname"] == alert and a["status"] == "resolved"]
    assert resolved, [(a["labels"]["alertname"], a["status"]) for a in outcome.alerts]
    ended = datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", resolved[-1]["endsAt"])).timestamp()
    print(f"{alert} resolved {ended - back:.1f} s after the hub came back")
    assert back < ended <= back + duration_seconds(DEMO_THRESHOLDS.rate_window) + 30.0, ended - back


def test_the_demos_live_line_shows_a_stall_from_the_last_scrapes() -> None:
    """Over the scrapes' span: the share of it the rank stalled and the main cause, the input-bound ratio of
    the seconds booked in it, the alerts firing; a series the agent forgot and began again counts from 0."""
    def stall(cause: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return c.STALL_SECONDS.name, (("cause", cause), ("rank", "0"), ("training_job", "demo"))

    compute = (c.COMPUTE_SECONDS.name, (("rank", "0"), ("training_job", "demo")))
    first = {stall("remote_fetch"): 10.0, stall("delivery"): 1.0, compute: 50.0}
    during = {stall("remote_fetch"): 13.8, stall("delivery"): 1.0, compute: 50.0}
    line = status_line([(100.0, first), (102.0, {}), (104.0, during)], {STARVED})
    assert "input-bound 100%" in line and "stalled  95% remote_fetch" in line and f"FIRING {STARVED}" in line
    forgotten = {stall("remote_fetch"): 300.0, stall("delivery"): 5.0, compute: 50.0}
    began_again = {stall("remote_fetch"): 0.5, stall("delivery"): 3.0, compute: 1.0}
    assert "stalled  88% delivery" in status_line([(100.0, forgotten), (104.0, began_again)])


def test_the_demos_live_line_forecasts_only_until_the_job_is_first_steady() -> None:
    """Once steady, the forecast's gauge holds the actual time to steady: after an outage sends the job back to
    `transition`, the line must not read it as a forecast ("steady 12 s in" through a minute's cut)."""
    job = ("training_job", "demo")
    transition = {(c.WARMUP_PHASE.name, (("phase", "transition"), job)): 1.0,
                  (c.WARMUP_PHASE.name, (("phase", "steady"), job)): 0.0,
                  (c.WARMUP_FORECAST_TIME_TO_STEADY.name, (job,)): 12.3}
    assert "forecast: steady 12 s in" in status_line([(100.0, transition)])
    regressed = {**transition, (c.WARMUP_TIME_TO_STEADY.name, (job,)): 12.3}
    line = status_line([(100.0, regressed)])
    assert "recognised phase transition" in line and "forecast" not in line
