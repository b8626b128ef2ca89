"""The generated dashboards against Grafana's published JSON schemas, and the project's own conventions."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from stallwatch import catalogue
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.dashboards import ARTIFACTS, all_dashboards
from stallwatch.mixin.grafana import render_json
from tests.conftest import ROOT

SCHEMAS = ROOT / "tests/data/grafana"  # from grafana-foundation-sdk's jsonschema/ (see SOURCE there)
PANEL_SCHEMAS = {"timeseries": "timeseries", "stat": "stat", "heatmap": "heatmap", "table": "table",
                 "state-timeline": "statetimeline"}
GRAFANA_BUILTINS = {"__rate_interval", "__range", "__range_s", "__interval"}
VARIABLE_USE = re.compile(r"\$\{?([A-Za-z_]\w*)")  # not label_replace's $1


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def schema_errors(document: object, schema_file: str, definition: str | None = None) -> list[str]:
    schema = load(SCHEMAS / schema_file)
    if definition is not None:
        schema = {**schema, "$ref": f"#/definitions/{definition}"}
    validator = jsonschema.Draft7Validator(schema)
    return [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(document)]


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    return exprs + [a["expr"] for a in dashboard["annotations"].get("list", [])]


DASHBOARDS = {path: load(ROOT / path) for path in ARTIFACTS}


def test_three_dashboards_with_stable_uids() -> None:
    uids = [d["uid"] for d in DASHBOARDS.values()]
    assert uids == ["stallwatch-training", "stallwatch-spoke", "stallwatch-gpu-node"]
    assert [f"dashboards/{uid}.json" for uid in uids] == list(DASHBOARDS)


@pytest.mark.parametrize("path", list(DASHBOARDS))
def test_dashboard_validates_against_grafanas_schema(path: str) -> None:
    dashboard = DASHBOARDS[path]
    assert schema_errors(dashboard, "dashboard.jsonschema.json") == []
    for panel in panels(dashboard):
        plugin = PANEL_SCHEMAS[panel["type"]]
        assert schema_errors(panel["options"], f"{plugin}.jsonschema.json", "Options") == [], panel["title"]
        if "custom" in panel["fieldConfig"]["defaults"]:
            errors = schema_errors(panel["fieldConfig"]["defaults"]["custom"], f"{plugin}.jsonschema.json",
                                   "FieldConfig")
            assert errors == [], panel["title"]
        for target in panel["targets"]:
            assert schema_errors(target, "prometheus.jsonschema.json") == [], panel["title"]


def test_the_schema_rejects_what_grafanalib_emits() -> None:
    # The check can fail: legacy keys of the schemaVersion 12 model (what grafanalib 0.7.1 writes) are refused.
    legacy = {**DASHBOARDS["dashboards/stallwatch-spoke.json"], "rows": [], "sharedCrosshair": True}
    assert any("rows" in error for error in schema_errors(legacy, "dashboard.jsonschema.json"))
    broken_panel = {**panels(legacy)[0]["options"], "legend": {"show": True}}
    assert schema_errors(broken_panel, "timeseries.jsonschema.json", "Options") != []


@pytest.mark.parametrize("path", list(DASHBOARDS))
def test_every_panel_has_a_unit_a_question_and_a_query(path: str) -> None:
    for panel in panels(DASHBOARDS[path]):
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["description"].endswith("?"), panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


@pytest.mark.parametrize("path", list(DASHBOARDS))
def test_variables_are_defined_and_links_reach_the_siblings(path: str) -> None:
    dashboard = DASHBOARDS[path]
    defined = [v["name"] for v in dashboard["templating"]["list"]]
    assert defined[0] == "datasource" and len(set(defined)) == len(defined)
    used = {name for expr in expressions(dashboard) for name in VARIABLE_USE.findall(expr)}
    used |= {name for v in dashboard["templating"]["list"] for name in VARIABLE_USE.findall(str(v.get("query", "")))}
    assert used - GRAFANA_BUILTINS <= set(defined)
    # One link by tag: Grafana lists the tagged dashboards itself, so the links keep any sub-path Grafana is
    # served under (an absolute /d/uid would drop it); every dashboard carries the tag.
    [link] = dashboard["links"]
    assert link["type"] == "dashboards" and link["tags"] == ["stallwatch"] and not link.get("url")
    assert link["includeVars"] and link["keepTime"]
    assert all("stallwatch" in d["tags"] for d in DASHBOARDS.values())


def test_the_issues_template_variables_exist() -> None:
    names = {v["name"] for d in DASHBOARDS.values() for v in d["templating"]["list"]}
    assert {"datasource", "cluster", "job", "node", "gpu", "spoke", "egress_price_usd_per_gb"} <= names


def variable_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"}


def test_nodes_are_keyed_on_their_name_and_the_variables_chain_job_node_gpu() -> None:
    training = variable_queries(DASHBOARDS["dashboards/stallwatch-training.json"])
    node = variable_queries(DASHBOARDS["dashboards/stallwatch-gpu-node.json"])
    for queries in (training, node):
        assert queries["node"].endswith(", node)") and "instance" not in queries["node"]
        assert queries["cluster"].endswith(", cluster)") and '$cluster' in queries["node"]
        assert '$node' in queries["gpu"]
    assert '$job' in training["node"] and '$job' in training["gpu"]
    assert list(training) == ["cluster", "job", "node", "gpu"]  # in the order Grafana refreshes them
    # legends name nodes, never scrape addresses
    legends = [t.get("legendFormat", "") for d in DASHBOARDS.values() for p in panels(d) for t in p["targets"]]
    assert not [legend for legend in legends if "{{instance}}" in legend]


def test_every_selector_is_limited_to_the_cluster() -> None:
    for dashboard in DASHBOARDS.values():
        for expr in expressions(dashboard):
            for selected in re.findall(r"(?<![\w:])(?:stallwatch_\w+|DCGM_\w+)(\{[^}]*\})?", expr):
                assert 'cluster=~"$cluster"' in selected, expr


def test_the_jobs_gpu_panels_show_only_the_jobs_gpus() -> None:
    # Each training-dashboard query of a per-GPU NVML series is joined on the correlator's job -> GPU map.
    training = DASHBOARDS["dashboards/stallwatch-training.json"]
    gpu_series = (catalogue.GPU_UTILIZATION.name, catalogue.GPU_INFO.name)
    queries = [t["expr"] for p in panels(training) for t in p["targets"]
               if any(name in t["expr"] for name in gpu_series)]
    assert len(queries) >= 2
    job_map = f"{catalogue.GPU_STALL_IDLE_SECONDS.name}{{cluster=~\"$cluster\", {catalogue.JOB_LABEL}=~\"$job\""
    assert all("and on (instance, gpu)" in q and job_map in q for q in queries), queries


def test_recorded_job_series_are_drawn_back_at_the_time_they_cover() -> None:
    """The job rules read the correlator's series `correlator_lag` back: every recorded series a dashboard
    draws is offset forward by as much, so it lines up with the GPU series of its time."""
    lag = Thresholds().correlator_lag
    recorded = re.compile(r"(?<![\w:])[a-z_]+:stallwatch_\w+:\w+\{[^}]*\}(\[[^\]]*\])?( offset -\w+)?")
    found = [match for dashboard in DASHBOARDS.values() for expr in expressions(dashboard)
             for match in recorded.finditer(expr)]
    assert len(found) >= 6
    assert all(match.group(2) == f" offset -{lag}" for match in found), [m.group(0) for m in found]


def test_rates_of_seconds_are_shown_as_shares_not_seconds() -> None:
    # rate() of a *_seconds_total is seconds per second: a share of time, never the unit `s`.
    for dashboard in DASHBOARDS.values():
        for panel in panels(dashboard):
            rates = [t["expr"] for t in panel["targets"] if re.search(r"rate\(stallwatch_\w+_seconds_total", t["expr"])]
            if rates:
                assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit", (panel["title"], rates)


def test_dcgm_sm_activity_is_offered_beside_nvml_utilization() -> None:
    for path, title in (("dashboards/stallwatch-gpu-node.json", "GPU utilization"),
                        ("dashboards/stallwatch-training.json", "GPU utilization, loader wait and spoke misses")):
        panel = next(p for p in panels(DASHBOARDS[path]) if p["title"] == title)
        exprs = [t["expr"] for t in panel["targets"]]
        assert any(catalogue.GPU_UTILIZATION.name in e for e in exprs)
        [dcgm] = [e for e in exprs if "DCGM_FI_PROF_SM_ACTIVE" in e]
        assert "on (UUID)" in dcgm and catalogue.GPU_INFO.name in dcgm  # matched to our GPUs by UUID


def test_panel_ids_and_grid_positions_do_not_overlap() -> None:
    for dashboard in DASHBOARDS.values():
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(set(ids)) == len(ids)
        cells: set[tuple[int, int]] = set()
        for panel in dashboard["panels"]:
            g = panel["gridPos"]
            assert g["x"] + g["w"] <= 24
            area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not area & cells, panel["title"]
            cells |= area


def test_queries_name_only_catalogue_metrics() -> None:
    known = set(catalogue.family_names(catalogue.all_metrics()))
    for dashboard in DASHBOARDS.values():
        for expr in expressions(dashboard):
            assert set(re.findall(r"(?<![\w:])stallwatch_\w+", expr)) <= known, expr


def test_generators_spell_no_metric_name() -> None:
    generators = list((ROOT / "stallwatch/mixin").glob("*.py"))
    assert len(generators) > 5
    for module in generators:
        assert not re.search(r"stallwatch_\w", module.read_text()), module


def test_egress_cost_uses_the_price_variable_and_its_default_is_configurable() -> None:
    cheap = next(d for d in all_dashboards(Thresholds(egress_price_usd_per_gb=0.005)) if d.uid == "stallwatch-spoke")
    document: dict[str, Any] = json.loads(render_json(cheap, ()))
    price = next(v for v in document["templating"]["list"] if v["name"] == "egress_price_usd_per_gb")
    assert price["query"] == "0.005" and price["type"] == "textbox"
    spoke = DASHBOARDS["dashboards/stallwatch-spoke.json"]
    cost = next(p for p in panels(spoke) if p["title"].startswith("Egress cost"))
    assert cost["fieldConfig"]["defaults"]["unit"] == "currencyUSD"
    assert cost["targets"][0]["expr"].endswith("/ 1e9 * $egress_price_usd_per_gb")
