"""Every PromQL expression of the generated dashboards, expanded the way Grafana would expand it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from stallwatch.mixin.dashboards import ARTIFACTS
from tests.conftest import ROOT

# Grafana's values for a 1 s scrape interval; `All` of a variable is its allValue, `.*`.
GRAFANA_RANGES = {"__rate_interval": "5s", "__interval": "1s", "__range": "30s", "__range_s": "30"}
# stallwatch's metrics, and dcgm-exporter's the dashboards offer beside them
METRIC = re.compile(r"(?<![\w:])(?:stallwatch_\w+|DCGM_\w+)")
# A recorded series, `level:metric:operation`: what it needs is its metric.
RECORDED = re.compile(r"(?<![\w:])[a-z_]+:(stallwatch_\w+?):\w+")


def needs_served(expr: str, served: set[str]) -> bool:
    """Whether every metric `expr` reads, directly or through a recording rule, is among `served`."""
    return all(name in served for name in METRIC.findall(expr)) and all(
        any(s == base or s.startswith(base + "_") for s in served) for base in RECORDED.findall(expr))


def grafana_expand(expr: str, dashboard: dict[str, Any]) -> str:
    values = dict(GRAFANA_RANGES)
    for variable in dashboard["templating"]["list"]:
        values[variable["name"]] = variable["query"] if variable["type"] == "textbox" else ".*"
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: values[m.group(1)], expr)  # not label_replace's $1


def dashboard_queries() -> Iterator[tuple[str, str, str, bool]]:
    """(dashboard path, panel or annotation title, expanded expression, is a panel query)."""
    for path in ARTIFACTS:
        dashboard = json.loads((ROOT / path).read_text())
        for panel in dashboard["panels"]:
            if panel["type"] != "row":
                for target in panel["targets"]:
                    yield path, panel["title"], grafana_expand(target["expr"], dashboard), True
        for annotation in dashboard["annotations"].get("list", []):
            yield path, annotation["name"], grafana_expand(annotation["expr"], dashboard), False
