"""The multi-node scenario end to end: two agents and spokes, a 4-rank gloo job with a real all-reduce per
step, node b's spoke cold. The job-level cost the recording rules give must match the scenario's ground
truth (step time minus compute-plus-collective, on every GPU), and the gating node and cause be found."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallwatch.demo.cluster import ClusterDemo, ClusterOutcome, ClusterSettings
from tests.conftest import require_binary

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> ClusterOutcome:
    for binary, package in (("nginx", "nginx-light"), ("prometheus", "prometheus")):
        require_binary(binary, package)
    work: Path = tmp_path_factory.mktemp("cluster")
    return ClusterDemo(ClusterSettings(steps=200, quiet=True, workdir=work)).run()


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
