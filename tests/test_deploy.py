"""Deployment without Kubernetes: the systemd unit, Prometheus and Alertmanager examples, checked by
the real tools that will read them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, require_binary

DEPLOY = ROOT / "deploy"


def test_systemd_unit_verifies_clean(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    unit = (DEPLOY / "systemd" / "stallwatch-agent.service").read_text()
    assert "/usr/local/bin/stallwatch agent" in unit
    # verify checks that ExecStart exists: point it at this installation's command.
    here = Path(sys.executable).with_name("stallwatch")
    (tmp_path / "stallwatch-agent.service").write_text(unit.replace("/usr/local/bin/stallwatch", str(here)))
    result = subprocess.run([analyze, "verify", str(tmp_path / "stallwatch-agent.service")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    # and verify does complain about a misspelt hardening key, so the check above can fail
    (tmp_path / "typo.service").write_text(unit.replace("ProtectSystem=", "ProtectSystm=").replace(
        "/usr/local/bin/stallwatch", str(here)))
    typo = subprocess.run([analyze, "verify", str(tmp_path / "typo.service")], capture_output=True, text=True,
                          timeout=60)
    assert "Unknown key" in typo.stderr
    for hardening in ("ProtectSystem=strict", "RuntimeDirectory=stallwatch", "NoNewPrivileges=yes", "DynamicUser=yes"):
        assert hardening in unit


@pytest.mark.parametrize("config", ["scrape-static.yml", "scrape-file-sd.yml"])
def test_prometheus_examples_are_valid(config: str) -> None:
    promtool = require_binary("promtool", "prometheus")
    result = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("config", ["scrape-static.yml", "scrape-file-sd.yml"])
def test_prometheus_examples_label_each_target_with_its_node(config: str) -> None:
    # The dashboards key nodes on `node`; the demo's Prometheus sets it the same way.
    import yaml

    from stallwatch.demo.stack import NODE_RELABEL

    [scrape] = yaml.safe_load((DEPLOY / "prometheus" / config).read_text())["scrape_configs"]
    assert NODE_RELABEL in scrape["relabel_configs"]


def test_file_sd_example_targets_parse() -> None:
    import json

    targets = json.loads((DEPLOY / "prometheus" / "targets.example.json").read_text())
    assert all(t["targets"] and all(":" in x for x in t["targets"]) for t in targets)


def test_alertmanager_example_is_valid() -> None:
    amtool = require_binary("amtool", "prometheus-alertmanager")
    result = subprocess.run([amtool, "check-config", str(DEPLOY / "alertmanager" / "alertmanager.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    routes = subprocess.run(
        [amtool, "config", "routes", "test", "--config.file", str(DEPLOY / "alertmanager" / "alertmanager.yml"),
         "component=stallwatch", "severity=critical"], capture_output=True, text=True, timeout=60)
    assert routes.stdout.strip() == "training-oncall", routes.stdout + routes.stderr


def test_slurm_prolog_writes_file_sd_targets(tmp_path: Path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    # scontrol is Slurm's; here it expands a fixed node list the way `scontrol show hostnames` does.
    (fake_bin / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-001\\ngpu-002\\n'\n")
    (fake_bin / "scontrol").chmod(0o755)
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "gpu-[001-002]", "SLURM_JOB_ID": "4242",
           "STALLWATCH_TARGETS_DIR": str(tmp_path)}
    subprocess.run([str(DEPLOY / "slurm" / "prolog-targets.sh")], check=True, env=env, timeout=30)
    import json

    written = json.loads((tmp_path / "stallwatch-job-4242.json").read_text())
    assert written == [{"targets": ["gpu-001:9842", "gpu-002:9842"], "labels": {"slurm_job_id": "4242"}}]
