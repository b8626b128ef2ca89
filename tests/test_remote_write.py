"""The roll-up on a real remote-write receiver: one Prometheus scrapes the real correlator's metrics and
evaluates the job rules, sends only the recorded series (as deploy/prometheus/remote-write-*.yml do) to a
second Prometheus started with --web.enable-remote-write-receiver, and the roll-up queries run there."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from stallwatch import catalogue as c
from stallwatch.correlator.live import LiveCorrelator
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.demo.stack import query, start_prometheus
from stallwatch.eventbatch import EventBatch
from stallwatch.harness import free_port, wait_for
from stallwatch.mixin import rules
from stallwatch.mixin.config import Thresholds, correlator_lag
from tests.conftest import ROOT, require_binary

pytestmark = pytest.mark.slow
SETTINGS = CorrelatorSettings(window_s=1.0, lateness_s=0.5)
T = Thresholds(job_stall_window="10s", agent_scrape_interval="1s",  # start_prometheus's scrape interval
               correlator_lag=correlator_lag(SETTINGS, "1s"))


def feed(service: LiveCorrelator, stop: threading.Event) -> None:
    """Two ranks of job 0 stepping every 0.5 s, both waiting the same 0.1 s at each step's start (20 %)."""
    batch = 0
    while not stop.wait(0.5):
        now = time.monotonic_ns()
        start = np.array([now - 500_000_000] * 2, np.int64)
        service.submit(EventBatch.of("step", {
            "job": np.zeros(2, np.int32), "rank": np.arange(2, dtype=np.int32), "gpu": np.arange(2, dtype=np.int16),
            "batch": np.full(2, batch, np.int64), "wait_start_ns": start, "wait_end_ns": start + 100_000_000,
            "compute_end_ns": start + 490_000_000, "ready_ns": np.full(2, -1, np.int64)}))
        batch += 1


def test_recorded_series_reach_the_receiver_and_roll_up_there(tmp_path: Path) -> None:
    binary = require_binary("prometheus", "prometheus")
    shipped = yaml.safe_load((ROOT / "deploy/prometheus/remote-write-thanos.yml").read_text())["remote_write"][0]
    service = LiveCorrelator(SETTINGS, tick_s=0.1)
    registry = CollectorRegistry()
    registry.register(service)
    port = free_port()
    server, _ = start_http_server(port, "127.0.0.1", registry=registry)
    stop = threading.Event()
    threading.Thread(target=feed, args=(service, stop), daemon=True).start()
    receiver = start_prometheus(binary, tmp_path / "receiver", [], [], flags=["--web.enable-remote-write-receiver"])
    (tmp_path / "rules.yaml").write_text(rules.render_recording_rules(T))
    sender = start_prometheus(binary, tmp_path / "shard", [f"127.0.0.1:{port}"], [tmp_path / "rules.yaml"],
                              extra={"remote_write": [{
                                  "url": f"{receiver.url}/api/v1/write",
                                  "write_relabel_configs": shipped["write_relabel_configs"]}]})
    try:
        recorded = rules.job_stall_rule(T).record
        wait_for("the job's recorded loss on the receiver",
                 lambda: bool(query(receiver.url, recorded)["data"]["result"]), 60, receiver.process, receiver.log)
        time.sleep(5)
        rolled = query(receiver.url, f"max by ({c.JOB_LABEL}) ({rules.node_stall_rule(T).record})")["data"]["result"]
        assert [r["metric"] for r in rolled] == [{c.JOB_LABEL: "0"}]
        assert float(rolled[0]["value"][1]) == pytest.approx(0.2, abs=0.05)  # both ranks' waits overlap: 20 %
        gpus = query(receiver.url, rules.job_gpus_rule(T).record)["data"]["result"]
        assert float(gpus[0]["value"][1]) == 2
        # Raw series stay in the shard.
        assert not query(receiver.url, c.STALL_SECONDS.name)["data"]["result"]
        assert query(sender.url, c.STALL_SECONDS.name)["data"]["result"]
    finally:
        stop.set()
        sender.close()
        receiver.close()
        server.shutdown()
        service.close()
