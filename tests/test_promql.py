"""PromQL built from the catalogue refuses selectors that do not fit the metric's definition."""

from __future__ import annotations

import pytest

from stallwatch import catalogue as c
from stallwatch.mixin.promql import PromQLError, by, quantile, rate, selector


def test_selectors_use_the_catalogue_name_and_check_labels() -> None:
    assert selector(c.STALL_SECONDS, 'training_job=~"$job"', 'cause="remote_fetch"', 'instance="n1"') == (
        c.STALL_SECONDS.name + '{training_job=~"$job", cause="remote_fetch", instance="n1"}')
    with pytest.raises(PromQLError, match="no label 'gpu'"):
        selector(c.STALL_SECONDS, 'gpu="0"')
    with pytest.raises(PromQLError, match="not a label matcher"):
        selector(c.STALL_SECONDS, "job=train")


def test_histograms_need_a_suffix_and_gauges_refuse_rate() -> None:
    with pytest.raises(PromQLError, match="histogram"):
        selector(c.LOADER_WAIT)
    with pytest.raises(PromQLError, match="no '_sum' series"):
        selector(c.STALL_SECONDS, suffix="_sum")
    with pytest.raises(PromQLError, match="rate\\(\\) of the gauge"):
        rate(c.INPUT_BOUND_RATIO, "5m")
    assert quantile(0.95, c.SPOKE_HUB_FETCH_DURATION, "5m", labels="spoke") == (
        f"histogram_quantile(0.95, sum by (spoke, le) (rate({c.SPOKE_HUB_FETCH_DURATION.name}_bucket[5m])))")
    assert by("", "sum", "x") == "sum(x)"
