"""The Helm chart, rendered by the real helm and checked against the real schemas and tools.

helm comes from scripts/install-helm.sh (`make test` runs it). The chart is tested as a copy that holds
its generated rules and dashboards plus small fixtures (tests/data/helm/), so the tests exercise the
PrometheusRule and dashboard templates whatever `make generate` has produced so far.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bcrypt
import jsonschema
import kubernetes_validate
import pytest
import yaml

from stallwatch.demo.stack import query, start_prometheus
from stallwatch.exporters import agent  # noqa: F401  (registers the collectors this checkout has)
from stallwatch.exporters.collector import registered
from stallwatch.exporters.config import parse
from stallwatch.harness import free_port, start_agent, stop_agent, wait_for
from stallwatch.mixin.alerts import all_alerts
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.generate import ARTIFACTS, CHART_COPIES, chart_copies
from tests.conftest import ROOT, require_binary
from tests.test_security import self_signed

CHART = ROOT / "helm" / "stallwatch"
HELM = ROOT / "build" / "tools" / "bin" / "helm"
FIXTURES = ROOT / "tests" / "data" / "helm"
CRDS = ROOT / "tests" / "data" / "crds"
# The oldest and newest Kubernetes minors the chart is validated against.
KUBERNETES_VERSIONS = ("1.29", "1.35")
OPERATOR_KINDS = {"ServiceMonitor": "servicemonitor", "PrometheusRule": "prometheusrule"}
NAMESPACE = "monitoring"

Manifest = dict[str, Any]

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything-off": {
        "agent": {"collectors": {"gpu": False, "host": False, "events": False}},
        "gpu": {"access": "none"},
        "serviceAccount": {"create": False},
        "service": {"enabled": False},
        "serviceMonitor": {"enabled": False},
        "prometheusRule": {"enabled": False},
        "dashboards": {"enabled": False},
        "nodeSelector": {},
        "tolerations": [],
        "updateStrategy": {},
    },
    "device-mounts-and-host-paths": {
        "gpu": {"access": "devices"},
        "spokeLogs": {"enabled": True, "hostPath": "/var/log/spoke"},
        "hostProc": {"enabled": True},
        "hostPID": True,
        "socket": {"chownInit": False, "hostPath": "/run/stallwatch", "mountPath": "/run/stallwatch"},
        "agent": {"port": 19842, "telemetryPath": "/stats",
                  "config": {"collector.spoke_nginx": True, "spoke_nginx.log": "/host/spoke-logs/access.log"}},
    },
    "tuned": {
        "podResources": {"enabled": True, "interval": 2},
        "hostNetwork": True,
        "webConfig": {"enabled": True, "config": {
            "tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"},
            "basic_auth_users": {"prometheus": "$2b$04$abcdefghijklmnopqrstuuBzHbzA3YxTPcTVqXG5fGTbOQQ7y1nK2"}},
            "files": {"tls.crt": "CERTIFICATE", "tls.key": "KEY"}},
        "serviceMonitor": {"tlsConfig": {"insecureSkipVerify": True}, "basicAuth": {
            "username": {"name": "scrape", "key": "user"}, "password": {"name": "scrape", "key": "password"}}},
        "extraTolerations": [{"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"}],
        "extraVolumes": [{"name": "spoke-config", "configMap": {"name": "spoke"}}],
        "extraVolumeMounts": [{"name": "spoke-config", "mountPath": "/etc/spoke", "readOnly": True}],
        "prometheusRule": {"disabled": ["StallwatchFixtureInputBound"], "ruleLabels": {"team": "ml-platform"},
                           "runbookUrlBase": "https://runbooks.example.com/stallwatch.md",
                           "alerts": {"StallwatchFixtureAgentDown": {"for": "2m", "severity": "critical"},
                                      "StallwatchTrainingInputBound": {"threshold": 0.3}}},
    },
    "kube-prometheus-stack": {
        "fullnameOverride": "gpu-agent",
        "serviceMonitor": {"additionalLabels": {"release": "kps"}, "interval": "30s", "honorLabels": False,
                           "metricRelabelings": [{"action": "labeldrop", "regex": "rank"}]},
        "prometheusRule": {"additionalLabels": {"release": "kps"}},
        "dashboards": {"label": "grafana_dashboard_stallwatch", "labelValue": "yes", "namespace": "grafana",
                       "annotations": {"grafana_folder": "GPU training"}},
        "serviceAccount": {"name": "gpu-agent-sa", "annotations": {"team": "ml-platform"}},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}]}]}}},
        "priorityClassName": "system-node-critical",
        "podLabels": {"team": "ml-platform"},
        "podAnnotations": {"example.com/scrape": "false"},
        "imagePullSecrets": [{"name": "registry"}],
        "agent": {"extraArgs": ["--gpu.interval=0.25"], "extraEnv": [{"name": "TZ", "value": "UTC"}],
                  "logLevel": "debug"},
    },
}


@pytest.fixture(scope="session")
def helm() -> str:
    if not HELM.exists():
        subprocess.run([str(ROOT / "scripts" / "install-helm.sh")], check=True, timeout=600)
    return str(HELM)


@pytest.fixture(scope="session")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart with its generated files and the fixtures in files/."""
    copy = tmp_path_factory.mktemp("chart") / "stallwatch"
    shutil.copytree(CHART, copy)
    for kind, pattern in (("rules", "*.yaml"), ("dashboards", "*.json")):
        (copy / "files" / kind).mkdir(parents=True, exist_ok=True)
        for fixture in (FIXTURES / kind).glob(pattern):
            shutil.copy(fixture, copy / "files" / kind / fixture.name)
    return copy


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def values_file(directory: Path, name: str, values: dict[str, Any]) -> Path:
    path = directory / f"{name}.values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def render(helm: str, chart: Path, values: Path) -> list[Manifest]:
    result = run_helm(helm, "template", "stallwatch", str(chart), "--namespace", NAMESPACE, "-f", str(values))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def rendered(helm: str, chart: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Manifest]]:
    directory = tmp_path_factory.mktemp("values")
    return {name: render(helm, chart, values_file(directory, name, values)) for name, values in VALUE_SETS.items()}


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def the(manifests: list[Manifest], kind: str) -> Manifest:
    [found] = of_kind(manifests, kind)
    return found


def chart_files(chart: Path, kind: str) -> list[Path]:
    return sorted((chart / "files" / kind).glob("*.yaml" if kind == "rules" else "*.json"))


def dashboard_maps(manifests: list[Manifest]) -> list[Manifest]:
    return [m for m in of_kind(manifests, "ConfigMap") if "-dashboard-" in m["metadata"]["name"]]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict(helm: str, chart: Path, tmp_path: Path, name: str) -> None:
    result = run_helm(helm, "lint", "--strict", str(chart), "-f", str(values_file(tmp_path, name, VALUE_SETS[name])))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chart_as_committed_lints(helm: str) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


def test_toggles_decide_what_is_rendered(rendered: dict[str, list[Manifest]], chart: Path) -> None:
    rules, dashboards = len(chart_files(chart, "rules")), len(chart_files(chart, "dashboards"))
    assert rules >= 1 and dashboards >= 1  # the fixtures at least
    everything = Counter({"ServiceAccount": 1, "ConfigMap": 1 + dashboards, "Service": 1, "DaemonSet": 1,
                          "ServiceMonitor": 1, "PrometheusRule": rules})
    for name in ("defaults", "device-mounts-and-host-paths", "kube-prometheus-stack"):
        assert Counter(m["kind"] for m in rendered[name]) == everything, name
    assert Counter(m["kind"] for m in rendered["tuned"]) == everything + Counter({"Secret": 1})
    assert Counter(m["kind"] for m in rendered["everything-off"]) == Counter({"ConfigMap": 1, "DaemonSet": 1})


def test_one_object_per_generated_file_named_after_it(rendered: dict[str, list[Manifest]]) -> None:
    names = {m["metadata"]["name"] for m in rendered["defaults"] if m["kind"] in {"PrometheusRule", "ConfigMap"}}
    assert {"stallwatch-fixture", "stallwatch-dashboard-fixture-overview", "stallwatch"} <= names
    for manifests in rendered.values():
        keys = [(m["kind"], m["metadata"]["name"]) for m in manifests]
        assert len(keys) == len(set(keys))


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SETS)
def test_objects_validate_against_kubernetes(rendered: dict[str, list[Manifest]], name: str, version: str) -> None:
    for manifest in rendered[name]:
        if manifest["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(manifest, version, strict=True)


def operator_schemas(kind: str) -> list[dict[str, Any]]:
    """The strict catalogue schema (no unknown fields) and the operator's own CRD schema."""
    strict = json.loads((CRDS / f"{OPERATOR_KINDS[kind]}_v1.strict.json").read_text())
    crd = yaml.safe_load((CRDS / f"monitoring.coreos.com_{OPERATOR_KINDS[kind]}s.yaml").read_text())
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return [strict, served["schema"]["openAPIV3Schema"]]


def validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    """A validator without the meta-schema check: the CRDs hold Go regular expressions (`^(?i)(abort|warn)?$`)
    that Python's `re` rejects; they apply only to fields the chart does not set."""
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_operator_objects_validate_against_crds(rendered: dict[str, list[Manifest]], name: str) -> None:
    for kind in OPERATOR_KINDS:
        for manifest in of_kind(rendered[name], kind):
            for schema in operator_schemas(kind):
                validator(schema).validate(manifest)


def test_crd_schemas_catch_a_typo(rendered: dict[str, list[Manifest]]) -> None:
    monitor = json.loads(json.dumps(the(rendered["defaults"], "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["scrapeInterval"] = "15s"  # the field is `interval`
    with pytest.raises(jsonschema.ValidationError, match="scrapeInterval"):
        validator(operator_schemas("ServiceMonitor")[0]).validate(monitor)


def chart_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def with_runbook_base(groups: list[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    """The generated groups as the chart renders them by default: runbook links under an absolute base."""
    groups = json.loads(json.dumps(groups))
    for rule in (r for g in groups for r in g["rules"] if "runbook_url" in r.get("annotations", {})):
        rule["annotations"]["runbook_url"] = base + rule["annotations"]["runbook_url"].removeprefix(
            Thresholds().runbook_base_url)
    return groups


def check_rules(promtool: str, manifests: list[Manifest], directory: Path) -> None:
    for manifest in of_kind(manifests, "PrometheusRule"):
        extracted = directory / f"{manifest['metadata']['name']}.yaml"
        extracted.write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}))
        result = subprocess.run([promtool, "check", "rules", str(extracted)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_rules_pass_promtool_and_keep_their_templates(
    rendered: dict[str, list[Manifest]], chart: Path, promtool: str, tmp_path: Path
) -> None:
    manifests = of_kind(rendered["defaults"], "PrometheusRule")
    sources = {yaml.safe_load(path.read_text())["groups"][0]["name"]: path for path in chart_files(chart, "rules")}
    check_rules(promtool, manifests, tmp_path)
    base = chart_values()["prometheusRule"]["runbookUrlBase"]
    assert base.startswith("https://")
    for manifest in manifests:
        groups = manifest["spec"]["groups"]
        # `{{ $labels.training_job }}` and friends reach Prometheus exactly as generated, not consumed by helm.
        assert groups == with_runbook_base(yaml.safe_load(sources[groups[0]["name"]].read_text())["groups"], base)
    fixture = next(m for m in manifests if m["spec"]["groups"][0]["name"] == "stallwatch-fixture")
    assert "{{ $labels.training_job }}" in fixture["spec"]["groups"][0]["rules"][1]["annotations"]["description"]


def rules_by_name(manifests: list[Manifest]) -> dict[str, dict[str, Any]]:
    return {r.get("alert", r.get("record")): r for m in of_kind(manifests, "PrometheusRule")
            for g in m["spec"]["groups"] for r in g["rules"]}


def test_rules_are_tuned_from_values(rendered: dict[str, list[Manifest]], promtool: str, tmp_path: Path) -> None:
    check_rules(promtool, rendered["tuned"], tmp_path)
    default, tuned = rules_by_name(rendered["defaults"]), rules_by_name(rendered["tuned"])
    assert set(default) - set(tuned) == {"StallwatchFixtureInputBound"}  # disabled
    assert tuned["StallwatchTrainingInputBound"]["expr"].endswith(" >= 0.3")  # the threshold is the last number
    down = tuned["StallwatchFixtureAgentDown"]
    assert down["expr"] == 'up{job="stallwatch"} == 0'
    assert (down["for"], down["labels"]) == ("2m", {"severity": "critical", "team": "ml-platform"})
    assert down["annotations"]["runbook_url"] == "https://runbooks.example.com/stallwatch.md#stallwatchfixtureagentdown"
    assert all(r["labels"]["team"] == "ml-platform" for r in tuned.values() if "alert" in r)
    assert all("labels" not in r for r in tuned.values() if "record" in r)
    assert default["StallwatchFixtureAgentDown"]["labels"] == {"severity": "warning"}


@pytest.mark.parametrize(("values", "flags", "message"), [
    ({"alerts": {"StallwatchNoSuchAlert": {"for": "1m"}}}, (), "no generated alert is called StallwatchNoSuchAlert"),
    ({"disabled": ["StallwatchNoSuchAlert"]}, (), "no generated alert is called StallwatchNoSuchAlert"),
    # an alert without a tunable number: the schema refuses its threshold (`up == 0` must not become `up == 1`)
    ({"alerts": {"StallwatchAgentDown": {"threshold": 1}}}, (),
     "at '/prometheusRule/alerts/StallwatchAgentDown': additional properties 'threshold' not allowed"),
    ({"alerts": {"StallwatchTrainingInputBound": {"threshold": "a lot"}}}, (),
     "/prometheusRule/alerts/StallwatchTrainingInputBound/threshold"),
    # past the schema, the template refuses what it cannot place
    ({"alerts": {"StallwatchSpokeHitRatioRegressed": {"threshold": 0.5}}}, ("--skip-schema-validation",),
     "StallwatchSpokeHitRatioRegressed.threshold: its expression does not end in a comparison with a number"),
])
def test_a_rule_setting_that_cannot_apply_is_refused(helm: str, chart: Path, tmp_path: Path, values: dict[str, Any],
                                                     flags: tuple[str, ...], message: str) -> None:
    result = run_helm(helm, "template", "stallwatch", str(chart), *flags,
                      "-f", str(values_file(tmp_path, "rules", {"prometheusRule": values})))
    assert result.returncode != 0 and message in result.stderr, result.stderr


def trailing_numbers(t: Thresholds) -> dict[str, str | None]:
    """Each alert's number after its expression's last comparison, if it ends in one."""
    found = {rule.name: re.search(r"\s(?:>|>=|<|<=|==|!=)\s([-+0-9.e]+)$", rule.expr) for rule in all_alerts(t)}
    return {name: match.group(1) if match else None for name, match in found.items()}


def test_the_schema_takes_a_threshold_for_exactly_the_alerts_that_end_in_a_tunable_number() -> None:
    defaults = Thresholds()
    halved = dataclasses.replace(defaults, **{field.name: getattr(defaults, field.name) / 2
                                              for field in dataclasses.fields(defaults)
                                              if type(getattr(defaults, field.name)) is float})
    before, after = trailing_numbers(defaults), trailing_numbers(halved)
    tunable = {name for name in before if before[name] != after[name]}
    schema = json.loads((CHART / "values.schema.json").read_text())
    alerts = schema["properties"]["prometheusRule"]["properties"]["alerts"]
    with_threshold = {name for name, tuning in alerts["properties"].items()
                      if tuning["$ref"].endswith("/thresholdAlertTuning")}
    assert with_threshold == tunable and "StallwatchAgentDown" not in tunable
    assert "threshold" not in schema["definitions"]["alertTuning"]["properties"]
    assert alerts["additionalProperties"] == {"$ref": "#/definitions/alertTuning"}


@pytest.mark.parametrize("setting", [
    ("--set", "prometheusRule.alerts.StallwatchTrainingInputBound.threshold=0.3"),  # reaches the chart as "0.3"
    ("--set-json", 'prometheusRule.alerts.StallwatchTrainingInputBound={"threshold": 0.3}'),
])
def test_a_threshold_set_on_the_command_line_is_placed(helm: str, chart: Path, promtool: str, tmp_path: Path,
                                                       setting: tuple[str, str]) -> None:
    manifests = render_release(helm, chart, "stallwatch", *setting)
    assert rules_by_name(manifests)["StallwatchTrainingInputBound"]["expr"].endswith(" >= 0.3")
    check_rules(promtool, manifests, tmp_path)


@pytest.mark.parametrize(("setting", "capacity"), [
    (("--set", "agent.spokeCapacityBytes=1e12"), 10**12),  # a string to helm
    (("--set", "agent.spokeCapacityBytes=500000000000"), 5 * 10**11),
    (("--set-json", "agent.spokeCapacityBytes=2.5e11"), 25 * 10**10),
])
def test_the_spoke_capacity_reaches_the_correlators_what_if(helm: str, chart: Path, tmp_path: Path,
                                                            setting: tuple[str, str], capacity: int) -> None:
    config = agent_config(render_release(helm, chart, "stallwatch", *setting))
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(yaml.safe_dump({"correlator.cache-capacity": config["correlator.cache-capacity"]}))
    assert parse(["--config.file", str(config_file)], registered()).correlator_cache_capacity == capacity


def render_release(helm: str, chart: Path, release: str, *settings: str) -> list[Manifest]:
    result = run_helm(helm, "template", release, str(chart), "--namespace", NAMESPACE, *settings)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def scrape_job(manifests: list[Manifest]) -> str:
    """The job Prometheus Operator gives the ServiceMonitor's targets: the Service's jobLabel value, else its name."""
    monitor, service = the(manifests, "ServiceMonitor"), the(manifests, "Service")
    label = monitor["spec"].get("jobLabel")
    job: str = service["metadata"]["labels"][label] if label else service["metadata"]["name"]
    return job


@pytest.mark.parametrize("release", ["stallwatch", "gpu-mon"])
def test_the_rules_select_the_agents_under_any_release_name(helm: str, chart: Path, release: str) -> None:
    manifests = render_release(helm, chart, release)
    assert the(manifests, "Service")["metadata"]["name"].startswith(release)
    job = scrape_job(manifests)
    assert job == "stallwatch" == Thresholds().agent_scrape_job
    selectors = {r["expr"] for r in rules_by_name(manifests).values() if "job=" in r["expr"]}
    assert selectors and all(f'job="{job}"' in expr for expr in selectors)
    # a chart renamed by nameOverride gets a job of that name, and its rules follow
    renamed = render_release(helm, chart, release, "--set", "nameOverride=gpu-agent")
    assert scrape_job(renamed) == "gpu-agent"
    assert rules_by_name(renamed)["StallwatchFixtureAgentDown"]["expr"] == 'up{job="gpu-agent"} == 0'


@pytest.mark.slow
@pytest.mark.parametrize("release", ["stallwatch", "gpu-mon"])
def test_the_rendered_rules_find_the_agents_on_a_real_prometheus(
    helm: str, chart: Path, tmp_path: Path, release: str
) -> None:
    """Scraped as the ServiceMonitor makes Prometheus scrape them (job from jobLabel, no honor_labels), the
    agents keep the training job in training_job, and the rendered agent-down rule fires for a dead one."""
    manifests = render_release(helm, chart, release, "--set-json",
                               'prometheusRule.alerts={"StallwatchAgentDown":{"for":"1s"}}')
    assert the(manifests, "ServiceMonitor")["spec"]["endpoints"][0]["honorLabels"] is False
    job = scrape_job(manifests)
    rule_files = []
    for manifest in of_kind(manifests, "PrometheusRule"):
        rule_files.append(tmp_path / f"{manifest['metadata']['name']}.yaml")
        rule_files[-1].write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}))
    socket_path = Path(tempfile.mkdtemp(prefix="sw-")) / "events.sock"
    running = start_agent(["--gpu.fake-devices=1", f"--events.socket={socket_path}"], tmp_path / "agent.log")
    dead = f"127.0.0.1:{free_port()}"
    prometheus = start_prometheus(require_binary("prometheus", "prometheus"), tmp_path / "prometheus",
                                  [running.base.removeprefix("http://"), dead], rule_files, job=job)
    try:
        training = "from stallwatch.client import monitor\nimport time\n" \
                   "for _ in monitor(range(40), job='resnet50', rank=0):\n    time.sleep(0.01)\n"
        subprocess.run([sys.executable, "-c", training], check=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, STALLWATCH_SOCKET=str(socket_path)))
        both = f'stallwatch_loader_wait_seconds_count{{job="{job}", training_job="resnet50"}}'
        wait_for("the training job's series", lambda: bool(query(prometheus.url, both)["data"]["result"]), 60,
                 log=prometheus.log)
        down = f'ALERTS{{alertname="StallwatchAgentDown", alertstate="firing", job="{job}"}}'
        wait_for("StallwatchAgentDown", lambda: bool(query(prometheus.url, down)["data"]["result"]), 60,
                 log=prometheus.log)
        [alert] = query(prometheus.url, down)["data"]["result"]
        assert alert["metric"]["instance"] == dead  # the live agent is not reported down
    finally:
        prometheus.close()
        stop_agent(running)


def test_a_job_label_the_service_lacks_is_refused(helm: str, chart: Path) -> None:
    result = run_helm(helm, "template", "stallwatch", str(chart), "--set", "serviceMonitor.jobLabel=team")
    assert result.returncode != 0 and 'serviceMonitor.jobLabel: the Service has no label "team"' in result.stderr


def test_tuned_pod_spec(rendered: dict[str, list[Manifest]]) -> None:
    spec = pod_spec(rendered["tuned"])
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                   {"key": "dedicated", "operator": "Equal", "value": "training",
                                    "effect": "NoSchedule"}]
    [agent_container] = spec["containers"]
    mounts = {m["name"]: m for m in agent_container["volumeMounts"]}
    assert mounts["pod-resources"] == {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources",
                                       "readOnly": True}
    assert mounts["spoke-config"]["mountPath"] == "/etc/spoke"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["spoke-config"] == {"name": "spoke-config", "configMap": {"name": "spoke"}}
    assert volumes["web-config"]["secret"]["secretName"] == "stallwatch-web-config"
    config = agent_config(rendered["tuned"])
    assert config["collector.pods"] is True and config["pods.interval"] == 2
    assert config["pods.socket"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert config["web.config.file"] == "/etc/stallwatch/web/web-config.yml"
    endpoint = the(rendered["tuned"], "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == {"insecureSkipVerify": True}
    assert endpoint["basicAuth"]["password"] == {"name": "scrape", "key": "password"}
    assert the(rendered["defaults"], "ServiceMonitor")["spec"]["endpoints"][0]["scheme"] == "http"
    assert pod_spec(rendered["defaults"])["priorityClassName"] == "system-node-critical"


def test_dashboards_reach_the_grafana_sidecar_unchanged(rendered: dict[str, list[Manifest]], chart: Path) -> None:
    sources = {path.name: path.read_text() for path in chart_files(chart, "dashboards")}
    for name, label, value, namespace in (("defaults", "grafana_dashboard", "1", NAMESPACE),
                                          ("kube-prometheus-stack", "grafana_dashboard_stallwatch", "yes", "grafana")):
        maps = dashboard_maps(rendered[name])
        assert sorted(key for m in maps for key in m["data"]) == sorted(sources)
        for config_map in maps:
            assert config_map["metadata"]["labels"][label] == value
            assert config_map["metadata"]["namespace"] == namespace
            [(file_name, text)] = config_map["data"].items()
            assert text == sources[file_name].rstrip("\n")
            json.loads(text)
    assert "{{training_job}}" in dashboard_maps(rendered["defaults"])[0]["data"]["Fixture_Overview.json"]
    kps = dashboard_maps(rendered["kube-prometheus-stack"])[0]
    assert kps["metadata"]["annotations"] == {"grafana_folder": "GPU training"}


def test_operator_objects_carry_the_release_label_when_asked(rendered: dict[str, list[Manifest]]) -> None:
    for kind in OPERATOR_KINDS:
        assert "release" not in of_kind(rendered["defaults"], kind)[0]["metadata"]["labels"]
        labelled = of_kind(rendered["kube-prometheus-stack"], kind)
        assert all(m["metadata"]["labels"]["release"] == "kps" for m in labelled)


@pytest.mark.parametrize(("setting", "message"), [
    ("agent.port=abc", "at '/agent/port': got string, want integer"),
    ("serviceMonitor.interval=30", "at '/serviceMonitor/interval': got number, want string"),
    ("dashboards.enabled=yes", "at '/dashboards/enabled': got string, want boolean"),
    ("gpu.access=cuda", "at '/gpu/access'"),
    ("serviceMonitor.enable=false", "additional properties 'enable' not allowed"),
])
def test_a_wrong_value_fails_with_a_clear_message(helm: str, setting: str, message: str) -> None:
    result = run_helm(helm, "template", "stallwatch", str(CHART), "--set", setting)
    assert result.returncode != 0
    assert message in result.stderr


def test_a_service_monitor_without_its_service_is_refused(helm: str) -> None:
    result = run_helm(helm, "template", "stallwatch", str(CHART), "--set", "service.enabled=false")
    assert result.returncode != 0 and "serviceMonitor.enabled needs service.enabled" in result.stderr


def pod_spec(manifests: list[Manifest]) -> dict[str, Any]:
    spec: dict[str, Any] = the(manifests, "DaemonSet")["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("name", VALUE_SETS)
def test_policy_no_privilege_unless_asked(rendered: dict[str, list[Manifest]], name: str) -> None:
    """The cheap policy check of issue 9: what a pod security admission reviewer looks for first."""
    values = VALUE_SETS[name]
    devices = values.get("gpu", {}).get("access") == "devices"
    spec = pod_spec(rendered[name])
    assert spec.get("hostNetwork", False) is bool(values.get("hostNetwork")) and not spec.get("hostIPC")
    assert spec["hostPID"] is bool(values.get("hostPID"))
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in spec["containers"] + spec.get("initContainers", []):
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
        assert set(context["capabilities"].get("add", [])) <= {"CHOWN"}, container["name"]
        assert context.get("privileged", False) is (devices and container["name"] == "agent"), container["name"]
        assert context["allowPrivilegeEscalation"] is bool(context.get("privileged")), container["name"]
        assert "resources" in container
    [agent_container] = spec["containers"]
    # the kubelet's pod-resources socket accepts root only; the container keeps no capability
    root = values.get("podResources", {}).get("enabled", False)
    assert agent_container["securityContext"]["runAsNonRoot"] is not root
    assert not any(m["kind"] in {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"} for m in rendered[name])


def test_gpu_access_modes(rendered: dict[str, list[Manifest]]) -> None:
    runtime = pod_spec(rendered["defaults"])
    assert runtime["runtimeClassName"] == "nvidia"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in runtime["containers"][0]["env"]
    assert runtime["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    devices = pod_spec(rendered["device-mounts-and-host-paths"])
    assert "runtimeClassName" not in devices
    assert {v["name"]: v["hostPath"]["path"] for v in devices["volumes"] if "hostPath" in v} == {
        "socket": "/run/stallwatch", "spoke-logs": "/var/log/spoke", "host-proc": "/proc",
        "nvml": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"}
    assert all(m.get("readOnly") for m in devices["containers"][0]["volumeMounts"]
               if m["name"] in {"spoke-logs", "host-proc", "nvml", "config"})
    off = pod_spec(rendered["everything-off"])
    assert "runtimeClassName" not in off and "initContainers" not in off
    assert not any("hostPath" in v for v in off["volumes"])


def agent_config(manifests: list[Manifest]) -> dict[str, Any]:
    config_map = next(m for m in of_kind(manifests, "ConfigMap") if "agent.yaml" in m["data"])
    config: dict[str, Any] = yaml.safe_load(config_map["data"]["agent.yaml"])
    return config


def known_to_this_agent(config: dict[str, Any]) -> dict[str, Any]:
    """The chart also configures collectors that other parts of the project add (events, spoke_*); this
    checkout's agent would reject their keys as unknown, so those keys are left out. Once they are
    registered, nothing is left out and the whole rendered file is tested."""
    collectors = registered()

    def owner(key: str) -> str:
        return key.removeprefix("collector.").split(".")[0]

    return {key: value for key, value in config.items() if owner(key) in {"web", "log", *collectors}}


def test_rendered_config_and_probes_work_on_the_real_agent(helm: str, chart: Path, tmp_path: Path) -> None:
    values = {"gpu": {"access": "none"}, "socket": {"mountPath": str(tmp_path / "socket")},
              "agent": {"telemetryPath": "/stats", "config": {"gpu.fake-devices": 2, "gpu.interval": 0.1}}}
    (tmp_path / "socket").mkdir()
    manifests = render(helm, chart, values_file(tmp_path, "agent", values))
    config = agent_config(manifests)
    assert config["events.socket"] == f"{tmp_path}/socket/events.sock"
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(yaml.safe_dump(known_to_this_agent(config)))
    container = pod_spec(manifests)["containers"][0]
    assert container["command"][:2] == ["stallwatch", "agent"]
    assert container["command"][2] == "--config.file=/etc/stallwatch/agent.yaml"
    assert container["ports"][0]["containerPort"] == 9842
    # The listen address is the test's own free port; everything else comes from the rendered file.
    running = start_agent(["--config.file", str(config_file)], tmp_path / "agent.log")
    try:
        assert running.url.endswith("/stats")
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["port"] == "metrics"
            with urllib.request.urlopen(running.base + container[probe]["httpGet"]["path"], timeout=10) as reply:
                assert reply.status == 200
        with urllib.request.urlopen(running.url, timeout=10) as reply:
            body = reply.read().decode()
        assert 'stallwatch_scrape_collector_success{collector="gpu"} 1.0' in body
    finally:
        stop_agent(running)


def kubelet_probe(probe: dict[str, Any], base_url: str) -> bool:
    """Run a rendered probe as the kubelet does: HTTPS without verifying the certificate, TCP by connecting."""
    port = int(base_url.rsplit(":", 1)[1])
    if "tcpSocket" in probe:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    get = probe["httpGet"]
    scheme = get.get("scheme", "HTTP").lower()
    context = ssl._create_unverified_context() if scheme == "https" else None
    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}{get['path']}", timeout=10, context=context) as reply:
        return bool(reply.status == 200)


@pytest.mark.parametrize("security", ["tls", "basic-auth", "tls-and-basic-auth"])
def test_probes_work_with_the_web_config_on(helm: str, chart: Path, tmp_path: Path, security: str) -> None:
    key, cert = self_signed(tmp_path, "agent")
    web: dict[str, Any] = {}
    if "tls" in security:
        web["tls_server_config"] = {"cert_file": "tls.crt", "key_file": "tls.key"}
    if "basic-auth" in security:
        web["basic_auth_users"] = {"prometheus": bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode()}
    values = {"gpu": {"access": "none"}, "agent": {"collectors": {"events": False}, "config": {"gpu.fake-devices": 1}},
              "webConfig": {"enabled": True, "config": web,
                            "files": {"tls.crt": cert.read_text(), "tls.key": key.read_text()}}}
    manifests = render(helm, chart, values_file(tmp_path, "web", values))
    mounted = tmp_path / "web"  # the Secret as the pod sees it under webConfig.mountPath
    mounted.mkdir()
    for name, content in the(manifests, "Secret")["stringData"].items():
        (mounted / name).write_text(content)
    config = agent_config(manifests)
    assert config["web.config.file"] == "/etc/stallwatch/web/web-config.yml"
    config["web.config.file"] = str(mounted / "web-config.yml")
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(known_to_this_agent(config)))
    container = pod_spec(manifests)["containers"][0]
    running = start_agent(["--config.file", str(tmp_path / "agent.yaml")], tmp_path / "agent.log")
    try:
        port = running.base.rsplit(":", 1)[1]
        if "basic-auth" in security:  # an HTTP probe would get 401: the chart probes by TCP
            scheme = "https" if "tls" in security else "http"
            with pytest.raises(urllib.error.HTTPError, match="401"):
                urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/-/healthy", timeout=10,
                                       context=ssl._create_unverified_context() if scheme == "https" else None)
        for probe in ("livenessProbe", "readinessProbe"):
            assert ("tcpSocket" in container[probe]) is ("basic-auth" in security)
            assert kubelet_probe(container[probe], running.base)
        endpoint = the(manifests, "ServiceMonitor")["spec"]["endpoints"][0]
        assert endpoint["scheme"] == ("https" if "tls" in security else "http")
    finally:
        stop_agent(running)


def test_the_node_proc_means_the_nodes_mounts(rendered: dict[str, list[Manifest]], tmp_path: Path) -> None:
    """With the node's /proc the agent reads PID 1's mountstats: its own /proc/self lists the pod's mounts."""
    config = agent_config(rendered["device-mounts-and-host-paths"])
    mount = next(m for m in pod_spec(rendered["device-mounts-and-host-paths"])["containers"][0]["volumeMounts"]
                 if m["name"] == "host-proc")
    assert config["spoke_nfs.proc"] == mount["mountPath"] and config["spoke_nfs.pid"] == 1
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(yaml.safe_dump({key: config[key] for key in ("spoke_nfs.proc", "spoke_nfs.pid")}))
    options = parse(["--config.file", str(config_file)], registered())
    assert (options.spoke_nfs_proc, options.spoke_nfs_pid) == ("/host/proc", "1")
    assert not any(key.startswith("spoke_nfs.") for key in agent_config(rendered["defaults"]))


def test_example_training_job_matches_the_chart(rendered: dict[str, list[Manifest]]) -> None:
    job = yaml.safe_load((ROOT / "docs" / "training-job.yaml").read_text())
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    config = agent_config(rendered["defaults"])
    pod = job["spec"]["template"]
    socket_volume = next(v for v in pod["spec"]["volumes"] if "hostPath" in v)
    [trainer] = pod["spec"]["containers"]
    # the Job's name, set by the Job controller on its pods, names the training job
    [named] = [e for e in trainer["env"] if e["name"] == "STALLWATCH_JOB"]
    assert named["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/job-name']"
    mount = next(m for m in trainer["volumeMounts"] if m["name"] == socket_volume["name"])
    socket = next(e["value"] for e in trainer["env"] if e["name"] == "STALLWATCH_SOCKET")
    host_dir = next(v for v in pod_spec(rendered["defaults"])["volumes"] if v["name"] == "socket")["hostPath"]["path"]
    assert socket_volume["hostPath"]["path"] == host_dir
    # a training pod must start whether or not the agent has created the directory yet
    assert socket_volume["hostPath"]["type"] == "DirectoryOrCreate"
    # The same socket file, seen from the agent's mount and from the training pod's.
    assert Path(socket).relative_to(mount["mountPath"]) == Path(config["events.socket"]).relative_to(
        "/var/run/stallwatch")


def test_chart_copies_follow_the_artifacts_table() -> None:
    def render_a() -> str:
        return "a"

    def render_b() -> str:
        return "b"

    table: dict[str, Callable[[], str]] = {"dashboards/gpu.json": render_a, "alerts/stalls.yaml": render_b,
                                           "docs/metrics.md": render_a}
    assert chart_copies(table) == {"helm/stallwatch/files/dashboards/gpu.json": render_a,
                                   "helm/stallwatch/files/rules/stalls.yaml": render_b}
    assert chart_copies(ARTIFACTS).items() <= ARTIFACTS.items()


def chart_file_paths() -> Iterator[str]:
    for target in CHART_COPIES.values():
        for path in (ROOT / target).glob("*"):
            yield str(path.relative_to(ROOT))


def test_the_chart_holds_no_file_the_generator_does_not_write() -> None:
    """A dashboard or rule file removed from the table must leave the chart too."""
    assert set(chart_file_paths()) == set(chart_copies(ARTIFACTS))
