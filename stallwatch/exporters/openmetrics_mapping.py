"""Mapping a cache's own Prometheus/OpenMetrics samples onto the catalogue's spoke metrics.

A small YAML mapping says which source sample becomes which spoke metric; ready mappings ship in
`mappings/` (juicefs, alluxio, qumulo), and a file of the same shape works too:

    metrics:
      - source: juicefs_blockcache_hits         # sample name (`_total` optional), a regex matched in full
        target: spoke_requests_total            # a spoke metric of stallwatch/catalogue.py, no prefix
        labels: {result: hit}                   # values for the target's labels other than `spoke`
        match: {method: GET}                    # optional: only source samples with these labels
        scale: 1.0                              # optional: multiply values (e.g. 1e-3 for ms)

Label handling: the source's labels are only filters (`match`); everything else about a sample is
summed away, so the result has exactly the catalogue's labels, `spoke` set by the collector.
A histogram target takes the source histogram's base name and keeps the source's buckets.
"""

from __future__ import annotations

import importlib.resources
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from stallwatch import catalogue
from stallwatch.exporters.config import ConfigError, parse_yaml, read_bounded
from stallwatch.exporters.openmetrics_scrape import ScrapeError

BUILTIN_MAPPINGS = ("juicefs", "alluxio", "qumulo")
SPOKE_TARGETS: dict[str, catalogue.AnyMetricDef] = {
    m.name.removeprefix(catalogue.PREFIX): m for m in catalogue.by_subsystem("spoke")
}


class MappingError(ValueError):
    """A mapping file that cannot be used; the message names the file and the rule."""


@dataclass(frozen=True)
class Rule:
    source: re.Pattern[str]
    target: catalogue.AnyMetricDef
    labels: tuple[str, ...]  # values of the target's labels after `spoke`, in catalogue order
    match: Mapping[str, str] = field(default_factory=dict)
    scale: float = 1.0


def load_mapping(text: str, origin: str) -> tuple[Rule, ...]:
    try:
        document = parse_yaml(text, origin)
    except ConfigError as error:
        raise MappingError(str(error)) from error
    if not isinstance(document, dict) or not isinstance(document.get("metrics"), list):
        raise MappingError(f"{origin}: expected a mapping with a list under 'metrics'")
    return tuple(_rule(item, f"{origin}: metrics[{index}]") for index, item in enumerate(document["metrics"]))


def _rule(item: Any, where: str) -> Rule:
    if not isinstance(item, dict):
        raise MappingError(f"{where}: expected a mapping")
    unknown = set(item) - {"source", "target", "labels", "match", "scale"}
    if unknown:
        raise MappingError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    target = SPOKE_TARGETS.get(str(item.get("target")))
    if target is None:
        raise MappingError(f"{where}: target must be one of {', '.join(sorted(SPOKE_TARGETS))}")
    try:
        source = re.compile(str(item["source"]))
    except (KeyError, re.error) as error:
        raise MappingError(f"{where}: source must be a regular expression: {error}") from error
    labels = {str(k): str(v) for k, v in (item.get("labels") or {}).items()}
    wanted = [name for name in target.labels if name != "spoke"]
    if set(labels) != set(wanted):
        raise MappingError(f"{where}: {target.name} needs labels {wanted}, got {sorted(labels)}")
    match = {str(k): str(v) for k, v in (item.get("match") or {}).items()}
    try:
        scale = float(item.get("scale", 1.0))
    except (TypeError, ValueError) as error:
        raise MappingError(f"{where}: scale must be a number") from error
    return Rule(source, target, tuple(labels[name] for name in wanted), match, scale)


def mapping_text(name_or_path: str) -> tuple[str, str]:
    """A built-in mapping by name, or a file: (text, where it came from)."""
    if name_or_path in BUILTIN_MAPPINGS:
        resource = importlib.resources.files("stallwatch.exporters") / "mappings" / f"{name_or_path}.yaml"
        return resource.read_text(), f"built-in mapping {name_or_path}"
    return read_bounded(name_or_path), name_or_path


def apply_mapping(rules: Iterable[Rule], families: Iterable[Metric], spoke: str) -> list[Metric]:
    """Our metric families from a scrape's families, summed over every source label."""
    samples = [sample for family in families for sample in family.samples]
    totals: dict[catalogue.AnyMetricDef, dict[tuple[str, ...], float]] = defaultdict(lambda: defaultdict(float))
    histograms: dict[catalogue.AnyMetricDef, dict[tuple[str, ...], _HistogramSum]] = defaultdict(dict)
    for rule in rules:
        matching = [s for s in samples if all(s.labels.get(k) == v for k, v in rule.match.items())]
        key = (spoke, *rule.labels)
        if rule.target.kind is catalogue.Kind.HISTOGRAM:
            histogram = histograms[rule.target].setdefault(key, _HistogramSum())
            for sample in matching:
                histogram.add(rule, sample.name, sample.labels, sample.value)
            continue
        for sample in matching:
            if _names_match(rule.source, sample.name):
                totals[rule.target][key] += sample.value * rule.scale
    out: list[Metric] = []
    for target, values in totals.items():
        family = cast(CounterMetricFamily | GaugeMetricFamily, target.family())
        for labels, value in values.items():
            family.add_metric(list(labels), value)
        out.append(family)
    for target, by_labels in histograms.items():
        histogram_family = cast(HistogramMetricFamily, target.family())
        for labels, histogram in by_labels.items():
            if histogram.buckets:
                histogram_family.add_metric(list(labels), histogram.cumulative(), histogram.sum)
        out.append(histogram_family)
    return out


def _names_match(source: re.Pattern[str], name: str) -> bool:
    """The parser writes counter samples as NAME_total even where the source wrote NAME; OpenMetrics'
    NAME_created timestamps are never values."""
    if name.endswith("_created"):
        return False
    return bool(source.fullmatch(name) or source.fullmatch(name.removesuffix("_total")))


class _HistogramSum:
    def __init__(self) -> None:
        self.buckets: defaultdict[float, float] = defaultdict(float)
        self.sum = 0.0

    def add(self, rule: Rule, name: str, labels: Mapping[str, str], value: float) -> None:
        base, _, suffix = name.rpartition("_")
        if not rule.source.fullmatch(base):
            return
        if suffix == "bucket" and "le" in labels:
            try:
                bound = float(labels["le"])
            except ValueError as error:  # the text parser accepts any label value
                raise ScrapeError("parse_error", f"{name}: bucket bound le={labels['le']!r}") from error
            self.buckets[bound * rule.scale] += value
        elif suffix == "sum":
            self.sum += value * rule.scale

    def cumulative(self) -> list[tuple[str, float]]:
        return [("+Inf" if le == float("inf") else repr(le), count) for le, count in sorted(self.buckets.items())]
