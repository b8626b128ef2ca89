"""End-to-end golden exposition, as node_exporter's `end-to-end-test.sh` does: the real agent run on fixture
inputs (two fake NVML GPUs, the real-format nginx log of tests/data, a job sending steps and reads through the
real client) and its /metrics, in the OpenMetrics format, diffed against `tests/golden/agent.txt`.

What a run cannot repeat (times, this machine's CPUs, disks and interfaces, the GPUs' sampled readings) is
left out: each family keeps its HELP, TYPE and UNIT lines and each sample its name and label names; the
families fed only by the fixtures keep their label values and values too. So a renamed metric or label, a
changed help text or unit, a collector's new or lost family, or a different count from the same inputs, fails
here. After a deliberate change: `pytest tests/test_golden.py --update-golden`, and review the diff.
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from stallwatch import catalogue as c
from stallwatch.harness import AgentProcess, scrape, total, wait_for
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
GOLDEN = ROOT / "tests" / "golden" / "agent.txt"
NGINX_LOG = ROOT / "tests" / "data" / "nginx-stallwatch.log"
# Families whose every value comes from the fixtures alone: kept whole.
FROM_FIXTURES = {metric.name.removesuffix("_total") for metric in (
    c.SPOKE_REQUESTS, c.SPOKE_BYTES, c.SPOKE_HUB_ERRORS, c.DATASET_READS, c.DATASET_READ_BYTES, c.DATASET_FAILED_READS,
    c.GPU_DEVICES)}
STEPS, READS_PER_STEP = 40, 2
OPENMETRICS = "application/openmetrics-text; version=1.0.0"
# Families whose series exist only if the run happened to stall (a preempted step on a busy machine): their
# samples are left out, their HELP, TYPE and UNIT kept.
BY_CHANCE = {metric.name.removesuffix("_total") for metric in (c.GPU_STALL_IDLE_SECONDS, c.STALL_GPU_COST)}
JOB = f"""
import os, sys
from stallwatch.client import monitor, open_recorded
from stallwatch.client.transport import sender
folder = sys.argv[1]
for step in monitor(range({STEPS}), job="golden", rank=0):
    for read in range({READS_PER_STEP}):
        with open_recorded(os.path.join(folder, str(read))) as f:
            f.read()
sender().close()
"""


def normalised(exposition: str) -> str:
    lines = []
    for family in text_string_to_metric_families(exposition):
        lines += [f"# HELP {family.name} {family.documentation}", f"# TYPE {family.name} {family.type}"]
        if family.unit:
            lines.append(f"# UNIT {family.name} {family.unit}")
        samples = set()
        for sample in [] if family.name in BY_CHANCE else family.samples:
            if family.name in FROM_FIXTURES:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples.add(f"{sample.name}{{{labels}}} {sample.value:g}")
            else:
                samples.add(f"{sample.name}{{{','.join(sorted(sample.labels))}}}")
        lines += sorted(samples)
    return "\n".join(lines) + "\n"


def test_the_agents_exposition_on_fixture_inputs_matches_the_golden_file(
        agent_factory: Callable[..., AgentProcess], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    log = tmp_path / "nginx.log"
    shutil.copyfile(NGINX_LOG, log)
    socket_path = os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")
    agent = agent_factory("--gpu.fake-devices", "2", "--collector.spoke_nginx", "--spoke_nginx.log", str(log),
                          "--spoke_nginx.from-start", "--spoke_nginx.name", "fixture", "--events.socket",
                          socket_path)
    for read in range(READS_PER_STEP):
        (tmp_path / str(read)).write_bytes(b"x" * 4096)
    subprocess.run([sys.executable, "-c", JOB, str(tmp_path)], check=True, timeout=60, cwd=ROOT,
                   env=dict(os.environ, STALLWATCH_SOCKET=socket_path))
    wait_for("the fixtures counted", lambda: (
        total(samples := scrape(agent.url), c.DATASET_READS.name) == STEPS * READS_PER_STEP
        and total(samples, c.SPOKE_REQUESTS.name) > 0), 30)
    shapes = [""]

    def settled() -> bool:
        """The job's windows published and nothing new since the previous look (half a second ago)."""
        shapes.append(normalised(requests.get(agent.url, headers={"Accept": OPENMETRICS}, timeout=10).text))
        time.sleep(0.5)
        return shapes[-1] == shapes[-2] and f"{c.COMPUTE_SECONDS.name}{{rank,training_job}}" in shapes[-1]

    wait_for("the exposition settled", settled, 60)
    got = shapes[-1]
    if request.config.getoption("--update-golden"):
        GOLDEN.write_text(got)
    want = GOLDEN.read_text()
    assert got == want, "the exposition changed (--update-golden to accept it):\n" + "".join(
        difflib.unified_diff(want.splitlines(True), got.splitlines(True), "golden", "agent"))
