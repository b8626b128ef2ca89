"""Tested for real: a real Prometheus loads the generated rules and scrapes a real agent; every dashboard query
runs through its query API; an alert of the generated rules travels through a real Alertmanager to a webhook.

The correlator and the training client are not part of this branch yet, so their metrics are absent: their
queries must be accepted without error, and every query over metrics the agent already serves must return data.
"""

from __future__ import annotations

import json
import queue
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from stallwatch.alerts import Thresholds, render_alerting_rules, render_recording_rules
from stallwatch.dashboards import ARTIFACTS
from tests.conftest import ROOT, AgentProcess, require_binary

pytestmark = pytest.mark.slow
SCRAPE_INTERVAL_S = 1
# Grafana's values for a 1 s scrape interval; `All` of a variable is its allValue, `.*`.
GRAFANA_RANGES = {"__rate_interval": "5s", "__interval": "1s", "__range": "30s"}
METRIC = re.compile(r"(?<![\w:])stallwatch_\w+")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_for(what: str, check: Callable[[], bool], timeout: float, process: subprocess.Popen[bytes] | None = None,
             log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except requests.RequestException:
            pass
        if process is not None and process.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{log.read_text()[-3000:]}" if log else ""))


class Webhook(BaseHTTPRequestHandler):
    received: queue.Queue[dict[str, Any]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.put(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # keep pytest's output clean
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, queue.Queue[dict[str, Any]]]]:
    received: queue.Queue[dict[str, Any]] = queue.Queue()
    handler = type("Handler", (Webhook,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", received
    server.shutdown()
    server.server_close()


@pytest.fixture
def processes() -> Iterator[Callable[[list[str], Path], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        started.append(process)
        return process

    yield start
    for process in started:
        process.terminate()
    for process in started:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def served_names(agent: AgentProcess) -> set[str]:
    text = requests.get(agent.url, timeout=10).text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def grafana_expand(expr: str, dashboard: dict[str, Any]) -> str:
    values = dict(GRAFANA_RANGES)
    for variable in dashboard["templating"]["list"]:
        values[variable["name"]] = variable["query"] if variable["type"] == "textbox" else ".*"
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)


def query(prometheus: str, expr: str) -> dict[str, Any]:
    reply: dict[str, Any] = requests.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    return reply


def test_generated_rules_and_dashboards_on_a_real_prometheus_and_alertmanager(
    agent_factory: Callable[..., AgentProcess], processes: Callable[[list[str], Path], subprocess.Popen[bytes]],
    webhook: tuple[str, queue.Queue[dict[str, Any]]], tmp_path: Path,
) -> None:
    prometheus_bin = require_binary("prometheus", "prometheus")
    alertmanager_bin = require_binary("prometheus-alertmanager", "prometheus-alertmanager")
    agent = agent_factory("--gpu.fake-devices", "2", "--gpu.interval", "0.2")
    agent_target = agent.base.removeprefix("http://")
    dead_target = f"127.0.0.1:{free_port()}"  # nothing listens there: an agent that is down
    webhook_url, received = webhook

    # The rules come from the same code as alerts/*.yaml, with the agent-down alert made quick for the test.
    thresholds = Thresholds(agent_scrape_job="stallwatch", agent_down_for="1s")
    rule_files = [tmp_path / "recording.yaml", tmp_path / "alerting.yaml"]
    rule_files[0].write_text(render_recording_rules(thresholds))
    rule_files[1].write_text(render_alerting_rules(thresholds))

    am_port, prom_port = free_port(), free_port()
    (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump({
        "route": {"receiver": "hook", "group_by": ["alertname", "instance"], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "hook", "webhook_configs": [{"url": webhook_url, "send_resolved": False}]}],
    }))
    am_log = tmp_path / "alertmanager.log"
    alertmanager = processes([alertmanager_bin, f"--config.file={tmp_path / 'alertmanager.yml'}",
                              f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                              "--cluster.listen-address="], am_log)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "rule_files": [str(p) for p in rule_files],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [{"job_name": thresholds.agent_scrape_job, "honor_labels": True,
                            "static_configs": [{"targets": [agent_target, dead_target]}]}],
    }))
    prom_log = tmp_path / "prometheus.log"
    prom = processes([prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                      f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                     prom_log)
    prometheus = f"http://127.0.0.1:{prom_port}"
    wait_for("alertmanager", lambda: requests.get(f"http://127.0.0.1:{am_port}/-/ready", timeout=2).ok, 30,
             alertmanager, am_log)
    wait_for("prometheus", lambda: requests.get(f"{prometheus}/-/ready", timeout=2).ok, 30, prom, prom_log)

    # Enough scrapes of the agent for every rate over the rate interval to have two samples.
    def agent_scraped_enough() -> bool:
        result = query(prometheus, f'count_over_time(up{{instance="{agent_target}"}}[1m]) >= 4')["data"]["result"]
        return bool(result)

    wait_for("scrapes of the agent", agent_scraped_enough, 30, prom, prom_log)
    served = served_names(agent)

    checked, with_data = 0, 0
    for path in ARTIFACTS:
        dashboard = json.loads((ROOT / path).read_text())
        targets = [(p["title"], t["expr"], True) for p in dashboard["panels"] if p["type"] != "row"
                   for t in p["targets"]]
        targets += [(a["name"], a["expr"], False) for a in dashboard["annotations"].get("list", [])]
        for title, expr, must_have_data in targets:
            reply = query(prometheus, grafana_expand(expr, dashboard))
            assert reply["status"] == "success", f"{path} / {title}: {expr}: {reply}"
            checked += 1
            if must_have_data and set(METRIC.findall(expr)) <= served:
                assert reply["data"]["result"], f"{path} / {title}: no data for {expr}"
                with_data += 1
    assert checked >= 60 and with_data >= 20, (checked, with_data)

    rules = requests.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = [rule for group in rules for rule in group["rules"]]
    generated = sum(len(group["rules"]) for text in (render_alerting_rules(), render_recording_rules())
                    for group in yaml.safe_load(text)["groups"])
    assert len(loaded) == generated and all(rule["health"] != "err" for rule in loaded), [
        (rule["name"], rule.get("lastError")) for rule in loaded if rule["health"] == "err"]

    deadline = time.monotonic() + 45
    delivered: list[dict[str, Any]] = []
    while not delivered and time.monotonic() < deadline:
        try:
            message = received.get(timeout=1)
        except queue.Empty:
            continue
        delivered = [a for a in message["alerts"] if a["labels"]["alertname"] == "StallwatchAgentDown"]
    assert delivered, f"no alert reached the webhook:\n{prom_log.read_text()[-2000:]}\n{am_log.read_text()[-2000:]}"
    alert = delivered[0]
    assert alert["status"] == "firing"
    assert alert["labels"] == {"alertname": "StallwatchAgentDown", "instance": dead_target, "job": "stallwatch",
                               "severity": "warning"}
    assert alert["annotations"]["runbook_url"] == "docs/runbooks.md#stallwatchagentdown"
    assert alert["annotations"]["description"] == f"The stallwatch agent at {dead_target} has been unreachable for 1s."
    firing = query(prometheus, 'ALERTS{alertname="StallwatchAgentDown", alertstate="firing"}')["data"]["result"]
    assert [a["metric"]["instance"] for a in firing] == [dead_target]  # the live agent is not reported down
