"""The report's Prometheus mode over a two-node job: a real Prometheus serving series written as the two
agents publish them (backfilled with `promtool tsdb create-blocks-from openmetrics`, window-end timestamps),
so each node's figures are known and the report's combination of them can be checked."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import numpy as np
import pytest

from stallwatch import catalogue as c
from stallwatch.harness import free_port, stop_process, wait_for
from stallwatch.report.api import Prometheus, PrometheusError
from stallwatch.report.prometheus import run_from_prometheus
from stallwatch.report.render import render_html
from stallwatch.report.scope import Scope
from tests.conftest import require_binary

pytestmark = pytest.mark.slow
JOB = "llama"
T0 = float(int(time.time()) // 60 * 60 - 3600)  # an hour ago, on a minute: inside the head's retention
RUN_S = 60
WINDOW_S = 0.5
# Per node: when its time to steady is published, its value, the warm-up idle and hub bytes, its what-if at
# 1x capacity and the reads its curve replayed; node b's cache is cold, its ranks stall from 10 s to 30 s.
NODES = {
    "a": {"steady_at": 6.0, "tts": 4.0, "idle": 1.0, "hub": 2e8, "whatif": 0.9, "reads": 100.0},
    "b": {"steady_at": 34.0, "tts": 30.0, "idle": 35.0, "hub": 9e8, "whatif": 0.2, "reads": 300.0},
}
STALL = (10.0, 30.0)
FAILING_S = 5.0


def _line(name: str, labels: dict[str, str], value: float, t: float) -> str:
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{text}}} {value} {t:.3f}\n"


def _series() -> str:
    """Each node publishes every window: its series stamped with the window's end, as the correlator does."""
    out: dict[str, list[str]] = {}
    for node, figures in NODES.items():
        own = {"instance": f"{node}:9400", "node": node}
        job = {**own, c.JOB_LABEL: JOB}
        stalled = compute = 0.0
        failed = 0
        for end in np.arange(WINDOW_S, RUN_S + WINDOW_S / 2, WINDOW_S):
            t = T0 + end
            stalls = node == "b" and STALL[0] < end <= STALL[1]
            stalled += WINDOW_S if stalls else 0.0
            compute += 0.0 if stalls else WINDOW_S
            phase = "steady" if end >= figures["steady_at"] else "cold"
            emit = out.setdefault
            for rank in ("0", "1"):
                for cause in c.CAUSES:
                    emit(c.STALL_SECONDS.name, []).append(_line(
                        c.STALL_SECONDS.name, {**job, "rank": rank, "cause": cause},
                        stalled if cause == "remote_fetch" else 0.0, t))
                emit(c.COMPUTE_SECONDS.name, []).append(
                    _line(c.COMPUTE_SECONDS.name, {**job, "rank": rank}, compute, t))
            for p in c.PHASES:
                emit(c.WARMUP_PHASE.name, []).append(_line(c.WARMUP_PHASE.name, {**job, "phase": p},
                                                           float(p == phase), t))
            if end >= figures["steady_at"]:
                emit(c.WARMUP_TIME_TO_STEADY.name, []).append(_line(c.WARMUP_TIME_TO_STEADY.name, job,
                                                                    figures["tts"], t))
            emit(c.WARMUP_IDLE_GPU_SECONDS.name, []).append(_line(c.WARMUP_IDLE_GPU_SECONDS.name, job,
                                                                  figures["idle"], t))
            emit(c.WARMUP_HUB_BYTES.name, []).append(_line(c.WARMUP_HUB_BYTES.name, job, figures["hub"], t))
            emit(c.CACHE_WHATIF_HIT_RATIO.name, []).append(_line(
                c.CACHE_WHATIF_HIT_RATIO.name, {**own, "spoke": node, "capacity_factor": "1"}, figures["whatif"], t))
            emit(c.CACHE_WHATIF_KEYS.name, []).append(_line(c.CACHE_WHATIF_KEYS.name, {**own, "spoke": node}, 50, t))
            emit(c.DATASET_READS.name, []).append(_line(
                c.DATASET_READS.name, {**job, "rank": "0", "verdict": "hit"}, figures["reads"], t))
            failing = node == "b" and STALL[0] < end <= min(STALL[1], STALL[0] + FAILING_S)
            failed += 1 if failing else 0  # a fetch a window fails, the first FAILING_S of b's stall
            emit(c.DATASET_FAILED_READS.name, []).append(_line(
                c.DATASET_FAILED_READS.name, {**job, "rank": "0"}, failed, t))
            emit(c.GPU_DEVICES.name, []).append(_line(c.GPU_DEVICES.name, own, 2, t))
    return "".join(line for lines in out.values() for line in lines) + "# EOF\n"


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = require_binary("prometheus", "prometheus")
    promtool = require_binary("promtool", "prometheus")
    work = tmp_path_factory.mktemp("nodes")
    (work / "series.om").write_text(_series())
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(work / "series.om"), str(work / "tsdb")],
                   check=True, capture_output=True, timeout=120)
    (work / "prometheus.yml").write_text("global: {}\n")
    port = free_port()
    log = work / "prometheus.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            return bool(Prometheus(url).instant(f"count({c.WARMUP_PHASE.name})", T0 + RUN_S))
        except PrometheusError:
            return False

    try:
        wait_for("Prometheus to serve the backfilled series", answers, 60, process, log)
        yield url
    finally:
        stop_process(process)


def test_a_two_node_jobs_warmup_is_combined_over_its_nodes(prometheus: str) -> None:
    run = run_from_prometheus(prometheus, T0 - 5, T0 + RUN_S + 1, Scope(job=JOB))
    assert run.nodes == 2
    # Steady once its last node is: node b, 30 s after its first window (which is the job's).
    assert run.time_to_steady_seconds == pytest.approx(NODES["b"]["tts"], abs=1.0)
    assert run.warmup_idle_gpu_seconds == NODES["a"]["idle"] + NODES["b"]["idle"]
    assert run.warmup_hub_bytes == NODES["a"]["hub"] + NODES["b"]["hub"]
    steady = [start for start, _, phase in run.phases if phase == "steady"]
    assert steady and steady[0] == pytest.approx(T0 + NODES["b"]["steady_at"], abs=1.5)
    # The time to steady points at when the cache was warm, before steady was recognised.
    assert run.steady_at is not None and run.steady_at < steady[0]
    assert run.steady_at == pytest.approx(T0 + NODES["b"]["tts"], abs=1.0)
    # The what-if: each node's estimate weighted by the reads its curve replayed, not the best node's.
    reads = NODES["a"]["reads"] + NODES["b"]["reads"]
    expected = (NODES["a"]["whatif"] * NODES["a"]["reads"] + NODES["b"]["whatif"] * NODES["b"]["reads"]) / reads
    assert run.whatif == {"1": pytest.approx(expected)}
    assert run.gpu_devices == 4
    page = render_html(run)
    assert "2 nodes combined" in page and "the last of 2 nodes to be steady" in page
    assert "weighted by the reads it replayed" in page


def test_a_two_node_jobs_stalls_are_drawn_where_they_were_booked(prometheus: str) -> None:
    """Node b's two ranks stall from 10 s to 30 s, node a's two never: averaged over the four ranks, half a
    stall-second a second there, and nothing outside it; the headline's seconds are the counters' increase."""
    run = run_from_prometheus(prometheus, T0, T0 + RUN_S, Scope(job=JOB))
    assert run.ranks == 4
    assert run.stall_seconds["remote_fetch"] == pytest.approx(2 * (STALL[1] - STALL[0]))
    remote = run.stall_by_cause["remote_fetch"]
    inside = (remote.t >= T0 + STALL[0]) & (remote.end <= T0 + STALL[1])
    assert remote.v[inside] == pytest.approx(0.5)
    outside = (remote.end <= T0 + STALL[0]) | (remote.t >= T0 + STALL[1])
    assert not np.nan_to_num(remote.v[outside]).any()
    assert run.input_bound_ratio == pytest.approx(40 / (40 + run.compute_seconds))
    # Node b's fetches failed through the first 5 s of its stall, one a window: the report says so.
    assert run.failed_reads == FAILING_S / WINDOW_S
    assert "Failed reads: 10 reads got no bytes" in render_html(run)
