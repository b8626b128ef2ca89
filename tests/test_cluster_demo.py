"""The multi-node scenario end to end: two agents and spokes, a 4-rank gloo job with a real all-reduce per
step, node b's spoke cold. The job-level cost the recording rules give must match the scenario's ground
truth (step time minus compute-plus-collective, on every GPU), and the gating node and cause be found."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from stallwatch.demo.cluster import ClusterDemo, ClusterOutcome, ClusterSettings
from stallwatch.demo.stack import query
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.dashboards import job_across_nodes
from tests.conftest import require_binary
from tests.dashqueries import dashboard_queries

pytestmark = pytest.mark.slow
ACROSS_NODES = {panel.title for panel in job_across_nodes(Thresholds()).panels}  # as the shipped dashboards have it
PANEL_REPLIES: list[tuple[str, str, dict[str, Any]]] = []


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> ClusterOutcome:
    for binary, package in (("nginx", "nginx-light"), ("prometheus", "prometheus"),
                            ("prometheus-alertmanager", "prometheus-alertmanager")):
        require_binary(binary, package)
    work: Path = tmp_path_factory.mktemp("cluster")

    def ask_the_job_across_nodes_panels(outcome: ClusterOutcome) -> None:
        for _, title, expr, is_panel in dashboard_queries():
            if is_panel and title in ACROSS_NODES:
                PANEL_REPLIES.append((title, expr, query(outcome.prometheus, expr)))

    return ClusterDemo(ClusterSettings(steps=200, quiet=True, workdir=work)).run(ask_the_job_across_nodes_panels)


def test_the_job_level_cost_matches_the_ground_truth(outcome: ClusterOutcome) -> None:
    print(f"job-level cost {outcome.estimate_gpu_seconds:.1f} GPU-s, ground truth {outcome.truth_gpu_seconds:.1f} "
          f"GPU-s, error {outcome.error:+.1%}")
    assert outcome.truth_gpu_seconds > 0.2 * (outcome.ended - outcome.started) * 4  # the cold node does cost
    assert abs(outcome.error) < 0.15


def test_the_per_node_view_under_reports_and_the_gate_is_node_b_on_remote_fetches(outcome: ClusterOutcome) -> None:
    assert outcome.gating_node == "node-b" and outcome.gating_cause == "remote_fetch"
    # Each node's own ranks' stall seconds: the waiting GPUs of node a show almost nothing.
    assert sum(outcome.per_node_gpu_seconds.values()) < 0.6 * outcome.truth_gpu_seconds
    assert outcome.per_node_gpu_seconds["node-a"] < 0.2 * outcome.per_node_gpu_seconds["node-b"]


def test_the_node_cost_alert_fires_for_node_b_only(outcome: ClusterOutcome) -> None:
    firing = [a for a in outcome.alerts if a["alertname"] == "StallwatchNodeStallsCostJob"]
    assert [a["node"] for a in firing] == ["node-b"]


def test_every_panel_of_the_job_across_nodes_row_has_data(outcome: ClusterOutcome) -> None:
    assert {title for title, _, _ in PANEL_REPLIES} == ACROSS_NODES and len(ACROSS_NODES) == 4
    for title, expr, reply in PANEL_REPLIES:
        assert reply["status"] == "success" and reply["data"]["result"], f"{title}: {expr}: {reply}"


def test_the_report_is_written_and_alertmanager_delivers_the_node_alert(outcome: ClusterOutcome) -> None:
    assert "StallwatchNodeStallsCostJob" in outcome.delivered
    assert outcome.report is not None
    html = outcome.report.read_text()
    assert re.search(r'id="time-to-steady">[^<]+<', html) and html.count("data:image/png;base64,") >= 4
