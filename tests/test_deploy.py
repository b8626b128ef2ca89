"""Deployment: the walk-through of docs/deploy.md (every command run where one machine can), the systemd
unit, Prometheus and Alertmanager examples, checked by the real tools that will read them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from stallwatch import __version__
from stallwatch.harness import AgentProcess
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


@pytest.mark.parametrize("config", ["scrape-static.yml", "scrape-file-sd.yml", "remote-write-thanos.yml",
                                    "remote-write-mimir.yml", "remote-write-victoriametrics.yml"])
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


# --- docs/deploy.md, Kubernetes: every command, run here where one machine can -------------------------

DEPLOY_DOC = ROOT / "docs" / "deploy.md"
# Commands that need a cluster or a registry: the test checks that nothing else is left unrun.
NEEDS_A_CLUSTER = ("kubectl ", "docker build ", "docker push ", "STORAGE_DRIVER=vfs buildah push ", "helm uninstall ")


def kubernetes_section() -> str:
    text = DEPLOY_DOC.read_text()
    return text[text.index("## Kubernetes"):text.index("## Without Kubernetes")]


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", kubernetes_section(), re.MULTILINE | re.DOTALL)


def commands() -> list[str]:
    return [line.strip() for block in blocks("sh") for line in block.splitlines() if line.strip()]


def values_blocks() -> list[dict[str, Any]]:
    return [yaml.safe_load(block) for block in blocks("yaml")]


def test_every_command_of_the_walkthrough_is_run_or_needs_a_cluster() -> None:
    # `make dist` (the wheels the Containerfile installs) is run by tests/test_install.py
    handled = ("make dist", "make image ", "helm install ", "curl -s localhost:9842/metrics ")
    found = commands()
    assert len(found) >= 10
    for command in found:
        assert command.startswith(handled + NEEDS_A_CLUSTER), f"deploy.md command not covered by a test: {command}"


def the_command(prefix: str) -> str:
    [command] = [c for c in commands() if c.startswith(prefix)]
    return command


@pytest.mark.slow
def test_make_image_builds_the_image_the_values_name() -> None:
    command = the_command("make image ")
    image = command.removeprefix("make image IMAGE=")
    recipe = subprocess.run(["make", "-n", "image", f"IMAGE={image}"], capture_output=True, text=True, cwd=ROOT,
                            timeout=60).stdout
    assert f"scripts/build-image.sh {image}" in recipe
    # the recipe itself, without make's venv prerequisite (the tests run inside that venv)
    build = subprocess.run([str(ROOT / "scripts" / "build-image.sh"), image], capture_output=True, text=True,
                           cwd=ROOT, timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable))
    assert build.returncode == 0, build.stdout + build.stderr
    assert image in build.stdout
    [values] = [v for v in values_blocks() if "image" in v]
    assert image == f"{values['image']['repository']}:{__version__}"


def helm_bin() -> str:
    helm = ROOT / "build" / "tools" / "bin" / "helm"
    if not helm.exists():
        subprocess.run([str(ROOT / "scripts" / "install-helm.sh")], check=True, timeout=600)
    return str(helm)


def helm_template(args: list[str], values: list[dict[str, Any]], directory: Path) -> list[dict[str, Any]]:
    files = []
    for index, document in enumerate(values):
        files += ["-f", str(directory / f"values-{index}.yaml")]
        (directory / f"values-{index}.yaml").write_text(yaml.safe_dump(document))
    result = subprocess.run([helm_bin(), "template", *args, *files], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_helm_install_with_the_documented_values_renders_valid_objects(tmp_path: Path) -> None:
    from tests.test_helm import OPERATOR_KINDS, operator_schemas, validator

    words = the_command("helm install ").split()
    assert words[-2:] == ["-f", "my-values.yaml"]
    [mine] = [v for v in values_blocks() if "image" in v]
    manifests = helm_template(words[2:-2], [mine], tmp_path)
    for manifest in manifests:
        if manifest["kind"] in OPERATOR_KINDS:
            for schema in operator_schemas(manifest["kind"]):
                validator(schema).validate(manifest)
        else:
            kubernetes_validate.validate(manifest, "1.35", strict=True)
    [daemonset] = [m for m in manifests if m["kind"] == "DaemonSet"]
    [agent] = daemonset["spec"]["template"]["spec"]["containers"]
    assert agent["image"] == f"{mine['image']['repository']}:{__version__}"
    assert all(m["metadata"]["labels"]["release"] == "kps" for m in manifests if m["kind"] in OPERATOR_KINDS)
    # the page's other value snippets (rule tuning, TLS and basic auth) render on top of it
    tuning = [v for v in values_blocks() if "image" not in v]
    assert {key for v in tuning for key in v} == {"prometheusRule", "webConfig", "serviceMonitor"}
    tuned = helm_template(words[2:-2], [mine, *tuning], tmp_path)
    alerts = {r["alert"] for m in tuned if m["kind"] == "PrometheusRule" for g in m["spec"]["groups"]
              for r in g["rules"] if "alert" in r}
    assert "StallwatchTrainingInputBound" in alerts and "StallwatchEgressOverBudget" not in alerts
    [monitor] = [m for m in tuned if m["kind"] == "ServiceMonitor"]
    assert monitor["spec"]["endpoints"][0]["scheme"] == "https"


def test_the_agent_check_finds_what_the_page_says(agent_factory: Callable[..., AgentProcess]) -> None:
    command = the_command("curl -s localhost:9842/metrics ")
    agent = agent_factory("--gpu.fake-devices", "1")
    here = command.replace("localhost:9842", agent.base.removeprefix("http://"))
    result = subprocess.run(["bash", "-c", here], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "stallwatch_build_info" in result.stdout
    assert 'stallwatch_scrape_collector_success{collector="gpu"} 1.0' in result.stdout


def test_the_pod_label_joins_of_the_page_evaluate(promtool: str, tmp_path: Path) -> None:
    [block] = re.findall(r"^```promql\n(.*?)^```$", kubernetes_section(), re.MULTILINE | re.DOTALL)
    first, second = (expr.strip() for expr in re.split(r"\n(?=\S)", block.strip()))
    owner = 'namespace="ml", pod="p", container="t"'
    pod = f'instance="n1", gpu="0", device="GPU-1", resource="nvidia.com/gpu", {owner}'
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": 'stallwatch_gpu_utilization_ratio{instance="n1", gpu="0"}', "values": "0.5x10"},
            {"series": 'stallwatch_gpu_utilization_ratio{instance="n1", gpu="1"}', "values": "0.9x10"},
            {"series": 'stallwatch_gpu_stall_idle_seconds_total{instance="n1", gpu="0", training_job="j", '
                       'cause="remote_fetch"}', "values": "0+60x10"},
            {"series": f"stallwatch_gpu_pod_info{{{pod}}}", "values": "1x10"},
        ],
        "promql_expr_test": [
            {"expr": first, "eval_time": "5m", "exp_samples": [
                {"labels": f'{{instance="n1", gpu="0", {owner}}}', "value": 0.5}]},
            {"expr": second, "eval_time": "5m", "exp_samples": [
                {"labels": '{namespace="ml", pod="p", cause="remote_fetch"}', "value": 1}]},
        ]}]}
    (tmp_path / "join.test.yaml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool, "test", "rules", str(tmp_path / "join.test.yaml")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
