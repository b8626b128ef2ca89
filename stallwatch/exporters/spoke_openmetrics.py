"""The `spoke_openmetrics` collector: a cache that already exposes Prometheus/OpenMetrics counters.

JuiceFS, Alluxio and Qumulo publish their own metrics; a small YAML mapping says which source sample
becomes which of our catalogue's spoke metrics. Ready mappings ship in `mappings/` (juicefs, alluxio,
qumulo); `--spoke_openmetrics.mapping` takes one of those names or a path to a file of the same shape:

    metrics:
      - source: juicefs_blockcache_hits         # sample name (`_total` optional), a regex matched in full
        target: spoke_requests_total            # a spoke metric of stallwatch/catalogue.py, no prefix
        labels: {result: hit}                   # values for the target's labels other than `spoke`
        match: {method: GET}                    # optional: only source samples with these labels
        scale: 1.0                              # optional: multiply values (e.g. 1e-3 for ms)

Label handling: the source's labels are only filters (`match`); everything else about a sample is
summed away, so the result has exactly the catalogue's labels, `spoke` set from `--spoke_openmetrics.name`.
A histogram target takes the source histogram's base name and keeps the source's buckets.

The endpoint is scraped on each of the agent's scrapes, with a timeout and a size limit. A failed
scrape (timeout, refused, HTTP error, unparsable text) yields no spoke values that time and counts the
reason in `stallwatch_spoke_collector_errors_total`.
"""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import re
import ssl
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from stallwatch import catalogue
from stallwatch.exporters.collector import CollectorContext, register_collector
from stallwatch.exporters.spokes import collector_errors
from stallwatch.flags import positive_float

log = logging.getLogger(__name__)

BUILTIN_MAPPINGS = ("juicefs", "alluxio", "qumulo")
MAX_BODY_BYTES = 16 << 20
SPOKE_TARGETS: dict[str, catalogue.AnyMetricDef] = {
    m.name.removeprefix(catalogue.PREFIX): m for m in catalogue.by_subsystem("spoke")
}


class MappingError(ValueError):
    """A mapping file that cannot be used; the message names the file and the rule."""


class ScrapeError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Rule:
    source: re.Pattern[str]
    target: catalogue.AnyMetricDef
    labels: tuple[str, ...]  # values of the target's labels after `spoke`, in catalogue order
    match: Mapping[str, str] = field(default_factory=dict)
    scale: float = 1.0


def load_mapping(text: str, origin: str) -> tuple[Rule, ...]:
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise MappingError(f"{origin}: not valid YAML: {error}") from error
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
    return Path(name_or_path).read_text(), name_or_path


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


HttpGet = Callable[[str, Mapping[str, str], float], bytes]


def http_get(url: str, headers: Mapping[str, str], timeout: float, context: ssl.SSLContext | None = None) -> bytes:
    """GET with a timeout and a size limit; every failure is a ScrapeError with a short reason.
    TLS is verified against the system's CAs unless the caller passes another context."""
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            body: bytes = response.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as error:
        raise ScrapeError("http_error", f"HTTP {error.code} from {url}") from error
    except TimeoutError as error:
        raise ScrapeError("timeout", f"no answer from {url} within {timeout} s") from error
    except urllib.error.URLError as error:
        if isinstance(error.reason, TimeoutError):
            raise ScrapeError("timeout", f"no answer from {url} within {timeout} s") from error
        if isinstance(error.reason, ssl.SSLError):
            raise ScrapeError("tls_error", f"{url}: {error.reason}") from error
        raise ScrapeError("unreachable", f"{url}: {error.reason}") from error
    except OSError as error:
        raise ScrapeError("unreachable", f"{url}: {error}") from error
    if len(body) > MAX_BODY_BYTES:
        raise ScrapeError("too_large", f"{url}: more than {MAX_BODY_BYTES} bytes")
    return body


def parse_exposition(body: bytes) -> list[Metric]:
    try:
        return list(text_string_to_metric_families(body.decode("utf-8")))
    except (ValueError, UnicodeDecodeError, IndexError, TypeError) as error:
        raise ScrapeError("parse_error", f"not Prometheus text: {error}") from error


class OpenMetricsSpokeCollector:
    def __init__(
        self,
        url: str,
        rules: Iterable[Rule],
        spoke: str,
        *,
        timeout: float = 2.0,
        headers: Mapping[str, str] | None = None,
        get: HttpGet = http_get,
    ) -> None:
        self._url, self._rules, self._spoke = url, tuple(rules), spoke
        self._timeout, self._headers, self._get = timeout, dict(headers or {}), get
        self._errors: Counter[str] = Counter()

    def collect(self) -> Iterator[Metric]:
        try:
            families = parse_exposition(self._get(self._url, self._headers, self._timeout))
            mapped = apply_mapping(self._rules, families, self._spoke)
        except ScrapeError as error:
            if not self._errors[error.reason]:
                log.warning("spoke %s: %s (counted from now on)", self._spoke, error)
            self._errors[error.reason] += 1
        else:
            yield from mapped
        yield collector_errors(self._spoke, self._errors)

    def close(self) -> None:
        pass


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--spoke_openmetrics.url", dest="spoke_openmetrics_url", metavar="URL",
                       default="http://127.0.0.1:9567/metrics",
                       help="the cache's metrics endpoint (default: %(default)s, JuiceFS's)")
    group.add_argument("--spoke_openmetrics.mapping", dest="spoke_openmetrics_mapping", default="juicefs",
                       metavar="NAME|PATH", help=f"built-in mapping ({', '.join(BUILTIN_MAPPINGS)}) or a YAML "
                       "file (default: %(default)s)")
    group.add_argument("--spoke_openmetrics.name", dest="spoke_openmetrics_name", default="openmetrics",
                       metavar="NAME", help="the spoke label of its metrics (default: %(default)s)")
    group.add_argument("--spoke_openmetrics.timeout", dest="spoke_openmetrics_timeout", type=positive_float,
                       default=2.0, metavar="SECONDS", help="scrape timeout (default: %(default)s)")


def _from_context(context: CollectorContext) -> OpenMetricsSpokeCollector:
    options = context.options
    text, origin = mapping_text(options.spoke_openmetrics_mapping)
    return OpenMetricsSpokeCollector(
        options.spoke_openmetrics_url, load_mapping(text, origin), options.spoke_openmetrics_name,
        timeout=options.spoke_openmetrics_timeout,
    )


register_collector("spoke_openmetrics", False, "caches with their own Prometheus endpoint (JuiceFS, Alluxio, "
                   "Qumulo), mapped onto spoke metrics", _from_context, _add_arguments)
