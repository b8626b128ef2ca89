"""Which part of the cluster a report covers: one training job, one node, or both.

A node is the `node` label the scrape adds (the chart's ServiceMonitor relabels it from the pod's node,
deploy/prometheus/ from the target's host), the label the mixin's rules and alerts keep nodes apart by.
A training job is `catalogue.JOB_LABEL`; series without that label (the GPUs', the spoke's) are the node's.
"""

from __future__ import annotations

from dataclasses import dataclass

from stallwatch import catalogue as c
from stallwatch.catalogue import AnyMetricDef
from stallwatch.mixin.promql import selector

NODE_LABEL = "node"


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class Scope:
    job: str | None = None
    node: str | None = None

    def select(self, metric: AnyMetricDef, suffix: str = "") -> str:
        """The metric's series in scope: the job's (where the metric has the job label) on the node."""
        matchers = []
        if self.job is not None and c.JOB_LABEL in metric.labels:
            matchers.append(f"{c.JOB_LABEL}={_quoted(self.job)}")
        if self.node is not None:
            matchers.append(f"{NODE_LABEL}={_quoted(self.node)}")
        return selector(metric, *matchers, suffix=suffix)


EVERYTHING = Scope()
