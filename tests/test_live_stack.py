"""Tested for real: a real Prometheus loads the generated rules and scrapes a real agent; every dashboard query
runs through its query API; an alert of the generated rules travels through a real Alertmanager to a webhook.
(The stall alert, fed by a real training job, is delivered in tests/test_demo.py.)
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from stallwatch import catalogue as c
from stallwatch.demo.stack import Server, Webhook, query, start_alertmanager, start_prometheus
from stallwatch.harness import AgentProcess, free_port, parse_samples, scrape, wait_for
from stallwatch.mixin.alerts import render_alerting_rules
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.rules import render_recording_rules
from tests.conftest import require_binary
from tests.dashqueries import dashboard_queries, needs_served

pytestmark = pytest.mark.slow


@pytest.fixture
def servers() -> Iterator[list[Server | Webhook | FakeDcgmExporter]]:
    started: list[Server | Webhook | FakeDcgmExporter] = []
    yield started
    for server in reversed(started):
        server.close()


def served_names(agent: AgentProcess) -> set[str]:
    text = requests.get(agent.url, timeout=10).text
    return {name for name, _ in parse_samples(text)}


class FakeDcgmExporter:
    """Serves dcgm-exporter's SM-activity gauge for the given GPU UUIDs, as dcgm-exporter labels it."""

    def __init__(self, uuids: list[str]) -> None:
        body = "".join(f'DCGM_FI_PROF_SM_ACTIVE{{gpu="{i}",UUID="{uuid}",Hostname="n"}} 0.4\n'
                       for i, uuid in enumerate(uuids)).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.target = f"127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def gpu_uuids(agent: AgentProcess) -> list[str]:
    return [dict(labels)["uuid"] for name, labels in scrape(agent.url) if name == c.GPU_INFO.name]


def test_generated_rules_and_dashboards_on_a_real_prometheus_and_alertmanager(
    agent_factory: Callable[..., AgentProcess], servers: list[Server | Webhook | FakeDcgmExporter], tmp_path: Path,
) -> None:
    prometheus_bin = require_binary("prometheus", "prometheus")
    alertmanager_bin = require_binary("prometheus-alertmanager", "prometheus-alertmanager")
    agent = agent_factory("--gpu.fake-devices", "2", "--gpu.interval", "0.2")
    agent_target = agent.base.removeprefix("http://")
    dead_target = f"127.0.0.1:{free_port()}"  # nothing listens there: an agent that is down
    webhook = Webhook()
    servers.append(webhook)
    dcgm = FakeDcgmExporter(gpu_uuids(agent))
    servers.append(dcgm)
    received: queue.Queue[dict[str, Any]] = webhook.received

    # The rules come from the same code as alerts/*.yaml, with the agent-down alert made quick for the test.
    thresholds = Thresholds(agent_scrape_job="stallwatch", agent_down_for="1s")
    rule_files = [tmp_path / "recording.yaml", tmp_path / "alerting.yaml"]
    rule_files[0].write_text(render_recording_rules(thresholds))
    rule_files[1].write_text(render_alerting_rules(thresholds))
    alertmanager = start_alertmanager(alertmanager_bin, tmp_path / "alertmanager", webhook.url)
    servers.append(alertmanager)
    prom = start_prometheus(prometheus_bin, tmp_path / "prometheus", [agent_target, dead_target, dcgm.target],
                            rule_files, alertmanager.url, job=thresholds.agent_scrape_job)
    servers.append(prom)
    prometheus, prom_log, am_log = prom.url, prom.log, alertmanager.log

    # Enough scrapes of the agent for every rate over the rate interval to have two samples.
    def agent_scraped_enough() -> bool:
        result = query(prometheus, f'count_over_time(up{{instance="{agent_target}"}}[1m]) >= 4')["data"]["result"]
        return bool(result)

    wait_for("scrapes of the agent", agent_scraped_enough, 30, prom.process, prom_log)
    served = served_names(agent) | {"DCGM_FI_PROF_SM_ACTIVE"}

    checked, with_data = 0, 0
    for path, title, expr, is_panel in dashboard_queries():
        reply = query(prometheus, expr)
        assert reply["status"] == "success", f"{path} / {title}: {expr}: {reply}"
        checked += 1
        if is_panel and needs_served(expr, served):
            assert reply["data"]["result"], f"{path} / {title}: no data for {expr}"
            with_data += 1
    assert checked >= 60 and with_data >= 20, (checked, with_data)
    # Series are keyed on the node name; dcgm-exporter's SM activity is matched to the agent's GPUs.
    node = agent_target.rsplit(":", 1)[0]
    gpu = query(prometheus, f'{c.GPU_UTILIZATION.name}{{instance="{agent_target}"}}')["data"]["result"]
    assert gpu and all(series["metric"]["node"] == node for series in gpu)
    sm = next(expr for _, title, expr, _ in dashboard_queries() if title == "GPU utilization" and "DCGM" in expr)
    matched = query(prometheus, sm)["data"]["result"]
    assert sorted(series["metric"]["gpu"] for series in matched) == ["0", "1"]
    assert all(series["metric"]["node"] == node and series["value"][1] == "0.4" for series in matched)

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
                               "node": "127.0.0.1", "severity": "warning", "component": "stallwatch"}
    assert alert["annotations"]["runbook_url"] == "docs/runbooks.md#stallwatchagentdown"
    assert alert["annotations"]["description"] == f"The stallwatch agent at {dead_target} has been unreachable for 1s."
    firing = query(prometheus, 'ALERTS{alertname="StallwatchAgentDown", alertstate="firing"}')["data"]["result"]
    assert [a["metric"]["instance"] for a in firing] == [dead_target]  # the live agent is not reported down
