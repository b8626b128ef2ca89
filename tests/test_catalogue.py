"""The metric catalogue: Prometheus naming conventions, a clean promtool lint, a fresh reference doc."""

from __future__ import annotations

import ast
import re
import subprocess
from typing import Any

from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import CollectorRegistry

from stallwatch import catalogue
from stallwatch.catalogue import Kind
from stallwatch.mixin.metrics_doc import render_metrics_reference
from tests.conftest import ROOT

UNIT_SUFFIXES = {
    "seconds": "_seconds", "bytes": "_bytes", "ratio": "_ratio", "watts": "_watts", "joules": "_joules",
    "hertz": "_hertz", "celsius": "_celsius", "bytes_per_second": "_bytes_per_second",
    "dollars": "_dollars",
}
BOUNDED_LABELS = {
    "training_job", "rank", "gpu", "uuid", "name", "spoke", "cause", "phase", "collector", "version", "revision",
    "direction",
    "reason", "xid", "call", "error", "mode", "interface", "device", "verdict", "result", "source", "kind",
    "label", "capacity_factor", "code", "recording", "gpu_type", "region_pair",
    # pod labels only on stallwatch_gpu_pod_info: one series per allocated GPU device of the node
    "resource", "namespace", "pod", "container",
}


class PopulatedCatalogue:
    """Every catalogue metric with one sample, as a collector would expose it."""

    def collect(self):  # type: ignore[no-untyped-def]
        for metric in catalogue.all_metrics():
            family: Any = metric.family()  # each kind's add_metric has its own signature
            labels = [f"{label}-value" for label in metric.labels]
            if metric.kind is Kind.HISTOGRAM:
                buckets = [(str(b), float(i)) for i, b in enumerate(metric.buckets)]
                buckets.append(("+Inf", float(len(metric.buckets))))
                family.add_metric(labels, buckets, 1.5)
            else:
                family.add_metric(labels, 1.0)
            yield family


def test_names_follow_prometheus_conventions() -> None:
    names = [m.name for m in catalogue.all_metrics()]
    assert len(names) == len(set(names)), "a metric is defined twice"
    for m in catalogue.all_metrics():
        assert re.fullmatch(r"stallwatch_[a-z][a-z0-9_]*", m.name), m.name
        assert m.name.endswith("_total") == (m.kind is Kind.COUNTER), m.name
        if m.unit:
            suffix = UNIT_SUFFIXES[m.unit]
            assert m.name.removesuffix("_total").endswith(suffix), f"{m.name} should end in {suffix}"
        assert m.help and not m.help[0].islower() and m.help.endswith("."), f"{m.name}: help is a sentence"
        assert set(m.labels) <= BOUNDED_LABELS, f"{m.name}: unbounded label in {m.labels}"
        if m.kind is Kind.HISTOGRAM:
            assert list(m.buckets) == sorted(m.buckets) and m.buckets, m.name


def test_promtool_finds_nothing_to_complain_about(promtool: str) -> None:
    registry = CollectorRegistry()
    registry.register(PopulatedCatalogue())
    exposition = generate_latest(registry)
    for m in catalogue.all_metrics():
        assert f"# TYPE {m.name.removesuffix('_total')}".encode() in exposition
    result = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    ).decode()


def test_the_openmetrics_exposition_gives_each_metric_its_unit() -> None:
    registry = CollectorRegistry()
    registry.register(PopulatedCatalogue())
    units = dict(re.findall(r"^# UNIT (\S+) (\S+)$", openmetrics_latest(registry).decode(), re.MULTILINE))
    assert units == {m.name.removesuffix("_total"): m.unit for m in catalogue.all_metrics() if m.unit}


def test_promtool_lint_does_catch_a_bad_name(promtool: str) -> None:
    # The check above must be able to fail: promtool does flag a non-base unit.
    name = b"stallwatch_wait_milliseconds"
    text = b"# HELP %s Wait.\n# TYPE %s gauge\n%s 1\n" % (name, name, name)
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert result.returncode != 0


def test_metrics_reference_is_fresh() -> None:
    committed = (ROOT / "docs" / "metrics.md").read_text()
    assert committed == render_metrics_reference(), "docs/metrics.md is stale: run `make generate`"
    for m in catalogue.all_metrics():
        assert f"`{m.name}`" in committed


def test_the_causes_are_declared_once() -> None:
    """Code names a cause through the catalogue's table, never by spelling it or by its position: no string
    constant outside catalogue.py is a cause's name or selects one (`cause="..."`), and each cause has its
    colour, meaning and what it points at."""
    names = set(catalogue.CAUSES)
    spelt = []
    for path in sorted((ROOT / "stallwatch").rglob("*.py")):
        if path.name == "catalogue.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value in names or re.search(r'cause="(\w+)"', node.value)):
                spelt.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert not spelt, spelt
    for cause in catalogue.CAUSE_TABLE:
        assert re.fullmatch(r"#[0-9a-f]{6}", cause.colour) and cause.meaning and cause.points_at, cause
    assert len({cause.colour for cause in catalogue.CAUSE_TABLE}) == len(catalogue.CAUSE_TABLE)
