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

A scrape body is hostile until read: `parse_sources` parses only the lines the mapping reads (the
regex engine skips the rest without splitting it), at most `MAX_LINES` of them, and refuses a family
or series written twice; `apply_mapping` refuses values our exposition cannot carry (NaN, infinities,
negative counts; histograms with a NaN or negative bound, no +Inf or decreasing counts). Each refusal
is a ScrapeError: the whole scrape is dropped and counted, never published in part.
"""

from __future__ import annotations

import importlib.resources
import itertools
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from stallwatch import catalogue
from stallwatch.exporters.config import ConfigError, parse_yaml, read_bounded
from stallwatch.exporters.openmetrics_scrape import ScrapeError

BUILTIN_MAPPINGS = ("juicefs", "alluxio", "qumulo")
# A cache's mapped families are tens to hundreds of series (a JuiceFS 1.4.2 gateway: 79 lines); far more is an attack.
MAX_LINES = 10_000
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
    rules = tuple(_rule(item, f"{origin}: metrics[{index}]") for index, item in enumerate(document["metrics"]))
    source_lines(rules)  # refused now, not when a collector is built from them
    return rules


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
    if not (math.isfinite(scale) and scale > 0):  # else counters fall, NaN spreads, +Inf turns -Inf
        raise MappingError(f"{where}: scale must be a positive number")
    return Rule(source, target, tuple(labels[name] for name in wanted), match, scale)


def mapping_text(name_or_path: str) -> tuple[str, str]:
    """A built-in mapping by name, or a file: (text, where it came from)."""
    if name_or_path in BUILTIN_MAPPINGS:
        resource = importlib.resources.files("stallwatch.exporters") / "mappings" / f"{name_or_path}.yaml"
        return resource.read_text(), f"built-in mapping {name_or_path}"
    return read_bounded(name_or_path), name_or_path


def source_lines(rules: Iterable[Rule]) -> re.Pattern[str]:
    """The lines of a body the rules read: their sources' samples (any suffix `_names_match` and
    `_HistogramSum` accept) with their `# HELP` and `# TYPE`; built once per collector."""
    names = "|".join(f"(?:{rule.source.pattern})" for rule in rules) or "(?!)"
    try:
        return re.compile(rf"^[ \t]*(?:#[ \t]+(?:HELP|TYPE)[ \t]+)?(?:{names})(?:_total|_bucket|_sum|_count)?"
                          rf"(?=[ \t{{]|$).*", re.MULTILINE)
    except re.error as error:  # e.g. the same group name in two sources
        raise MappingError(f"the sources cannot be matched together: {error}") from error


# A line that is neither blank, a comment nor a sample (HTML, JSON): the body is not exposition text.
_NOT_EXPOSITION = re.compile(r'^(?![ \t]*(?:\r?$|#|[a-zA-Z_:]|\{"))', re.MULTILINE)


def parse_sources(body: bytes, lines: re.Pattern[str], max_lines: int = MAX_LINES) -> list[Metric]:
    """The families of `body` on the `lines` of `source_lines`, parsed; work and memory follow those
    lines, not the body (a 16 MB body of 1M other series costs no Python object per series)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ScrapeError("parse_error", f"not Prometheus text: {error}") from error
    if junk := _NOT_EXPOSITION.search(text):
        raise ScrapeError("parse_error", f"not Prometheus text at offset {junk.start()}")
    kept: list[str] = []
    for line in lines.finditer(text):
        if len(kept) == max_lines:
            raise ScrapeError("too_many_series", f"more than {max_lines} lines of mapped families")
        kept.append(line.group())
    try:
        families = list(text_string_to_metric_families("\n".join(kept)))
    except (ValueError, IndexError, TypeError) as error:
        raise ScrapeError("parse_error", f"not Prometheus text: {error}") from error
    _refuse_duplicates(families)
    return families


def _refuse_duplicates(families: Iterable[Metric]) -> None:
    """A family or series written twice would be summed (5 + 5 = 10); the text format forbids both."""
    names: set[str] = set()
    series: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for family in families:
        if family.name in names:
            raise ScrapeError("duplicate_family", f"family {family.name} written twice")
        names.add(family.name)
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            if key in series:
                raise ScrapeError("duplicate_family", f"series {sample.name}{sample.labels} written twice")
            series.add(key)


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
        counts = rule.target.kind is catalogue.Kind.COUNTER
        for sample in matching:
            if _names_match(rule.source, sample.name):
                totals[rule.target][key] += _valid(sample.value, sample.name, counts=counts) * rule.scale
    out: list[Metric] = []
    for target, values in totals.items():
        family = cast(CounterMetricFamily | GaugeMetricFamily, target.family())
        for labels, value in values.items():  # checked again: a sum can overflow
            family.add_metric(list(labels), _valid(value, target.name, counts=target.kind is catalogue.Kind.COUNTER))
        out.append(family)
    for target, by_labels in histograms.items():
        histogram_family = cast(HistogramMetricFamily, target.family())
        for labels, histogram in by_labels.items():
            if histogram.buckets:
                histogram_family.add_metric(list(labels), histogram.cumulative(),
                                             _valid(histogram.sum, target.name, counts=True))
        out.append(histogram_family)
    return out


class SourceMapping:
    """A mapping's rules with the pattern of the lines they read: a scrape's body in, our families out."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self._rules = tuple(rules)
        self._lines = source_lines(self._rules)

    def families(self, body: bytes, spoke: str) -> list[Metric]:
        return apply_mapping(self._rules, parse_sources(body, self._lines), spoke)



def _names_match(source: re.Pattern[str], name: str) -> bool:
    """The parser writes counter samples as NAME_total even where the source wrote NAME; OpenMetrics'
    NAME_created timestamps are never values."""
    if name.endswith("_created"):
        return False
    return bool(source.fullmatch(name) or source.fullmatch(name.removesuffix("_total")))


def _valid(value: float, name: str, *, counts: bool) -> float:
    """A value our exposition can carry: finite, and not negative where it counts something."""
    if not math.isfinite(value) or (counts and value < 0):
        raise ScrapeError("invalid_value", f"{name} = {value}")
    return value


class _HistogramSum:
    def __init__(self) -> None:
        self.buckets: defaultdict[float, float] = defaultdict(float)
        self.sum = 0.0
        self._series: set[frozenset[tuple[str, str]]] = set()  # source series (labels but le) with buckets
        self._closed: set[frozenset[tuple[str, str]]] = set()  # those with a +Inf bucket

    def add(self, rule: Rule, name: str, labels: Mapping[str, str], value: float) -> None:
        base, _, suffix = name.rpartition("_")
        if not rule.source.fullmatch(base):
            return
        if suffix == "bucket" and "le" in labels:
            try:
                bound = float(labels["le"])
            except ValueError as error:  # the text parser accepts any label value
                raise ScrapeError("parse_error", f"{name}: bucket bound le={labels['le']!r}") from error
            if not bound >= 0:  # NaN, or negative (OpenMetrics forbids those beside a _sum)
                raise ScrapeError("invalid_histogram", f"{name}: bucket bound le={labels['le']!r}")
            series = frozenset((k, v) for k, v in labels.items() if k != "le")
            self._series.add(series)
            if bound == math.inf:
                self._closed.add(series)
            if not float(_valid(value, name, counts=True)).is_integer():  # the parser gives ints too
                raise ScrapeError("invalid_value", f"{name} = {value}: a bucket counts whole observations")
            self.buckets[bound * rule.scale] += value
        elif suffix == "sum":
            self.sum += _valid(value, name, counts=True) * rule.scale

    def cumulative(self) -> list[tuple[str, float]]:
        """The buckets in our exposition's form, refused unless every source series ends in +Inf and
        the sums stay cumulative (series with different bounds can break that)."""
        if self._series != self._closed:
            raise ScrapeError("invalid_histogram", "a histogram without a +Inf bucket")
        buckets = sorted(self.buckets.items())
        if any(later < earlier for (_, earlier), (_, later) in itertools.pairwise(buckets)):
            raise ScrapeError("invalid_histogram", "bucket counts that decrease (or series with different bounds)")
        return [("+Inf" if le == math.inf else repr(le), _valid(count, "bucket", counts=True))
                for le, count in buckets]
