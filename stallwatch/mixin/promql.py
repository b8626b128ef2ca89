"""PromQL built from the metric catalogue, so dashboards and rules never spell a metric or label by hand.

`selector(metric, 'training_job=~"$job"')` checks every matcher's label against the metric's own labels and the
labels Prometheus adds to every scraped series, so a typo fails when the artifact is generated, not in
front of a user. Histograms name their series by suffix (`_bucket`, `_sum`, `_count`).
"""

from __future__ import annotations

import re

from stallwatch.catalogue import AnyMetricDef, Kind

# Prometheus attaches these to every scraped series (the training job is catalogue.JOB_LABEL, so nothing
# collides with the scrape job). `node` (the node's name) and `cluster` are target labels the shipped
# scrape configs and the chart's ServiceMonitor add; where a scrape lacks them, a `=~".*"` matcher still
# matches.
TARGET_LABELS = ("instance", "job", "node", "cluster")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_MATCHER = re.compile(r'^(?P<label>[a-zA-Z_]\w*)(=~|!~|!=|=)"(?:[^"\\]|\\.)*"$')


class PromQLError(ValueError):
    """A selector that does not fit the metric's definition."""


def selector(metric: AnyMetricDef, *matchers: str, suffix: str = "") -> str:
    """`name{matchers}` for a metric of the catalogue; raises PromQLError on an unknown label or suffix."""
    if metric.kind is Kind.HISTOGRAM:
        if suffix not in HISTOGRAM_SUFFIXES:
            raise PromQLError(f"{metric.name} is a histogram: select one of {HISTOGRAM_SUFFIXES}, not {suffix!r}")
    elif suffix:
        raise PromQLError(f"{metric.name} is a {metric.kind.value}: it has no {suffix!r} series")
    allowed = set(metric.labels) | set(TARGET_LABELS)
    for matcher in matchers:
        match = _MATCHER.match(matcher)
        if match is None:
            raise PromQLError(f"not a label matcher: {matcher!r}")
        if match["label"] not in allowed:
            raise PromQLError(f"{metric.name} has no label {match['label']!r} (labels: {sorted(allowed)})")
    body = "{" + ", ".join(matchers) + "}" if matchers else ""
    return f"{metric.name}{suffix}{body}"


def back(metric: AnyMetricDef, offset: str, *matchers: str) -> str:
    """`name{matchers} offset 19s`: a gauge's value as of `offset` ago."""
    return f"{selector(metric, *matchers)} offset {offset}"


def rate(metric: AnyMetricDef, window: str, *matchers: str, suffix: str = "", offset: str = "") -> str:
    """`rate(name{matchers}[window])`, read `offset` back (`offset 25s`) when given."""
    if metric.kind is Kind.GAUGE:
        raise PromQLError(f"rate() of the gauge {metric.name}")
    back = f" offset {offset}" if offset else ""
    return f"rate({selector(metric, *matchers, suffix=suffix)}[{window}]{back})"


def increase(metric: AnyMetricDef, window: str, *matchers: str, suffix: str = "") -> str:
    if metric.kind is Kind.GAUGE:
        raise PromQLError(f"increase() of the gauge {metric.name}")
    return f"increase({selector(metric, *matchers, suffix=suffix)}[{window}])"


def by(labels: str, aggregation: str, inner: str) -> str:
    """`sum by (training_job) (inner)`; labels is a comma-separated list, empty for a total."""
    return f"{aggregation} by ({labels}) ({inner})" if labels else f"{aggregation}({inner})"


def quantile(q: float, metric: AnyMetricDef, window: str, *matchers: str, labels: str = "") -> str:
    """The q-quantile of a histogram over window, kept apart by labels (plus `le`)."""
    keep = ", ".join([*filter(None, [labels]), "le"])
    return f"histogram_quantile({q}, sum by ({keep}) ({rate(metric, window, *matchers, suffix='_bucket')}))"
