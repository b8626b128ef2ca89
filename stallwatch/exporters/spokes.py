"""What every spoke collector shares."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import CounterMetricFamily

from stallwatch import catalogue


def collector_errors(spoke: str, errors: Mapping[str, int]) -> CounterMetricFamily:
    """`stallwatch_spoke_collector_errors_total` of one spoke, a series per reason."""
    family = catalogue.SPOKE_COLLECTOR_ERRORS.family()
    for reason, count in sorted(errors.items()):
        family.add_metric([spoke, reason], count)
    return family
