"""A histogram of durations: filled in nanoseconds a batch at a time, exposed in seconds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from prometheus_client.core import HistogramMetricFamily


class DurationHistogram:
    def __init__(self, bounds: Sequence[float]) -> None:
        """`bounds`: the upper bounds in seconds (a catalogue histogram's `buckets`), +Inf implied."""
        self._bounds = tuple(bounds)
        self._bounds_ns = np.array([round(bound * 1e9) for bound in self._bounds], dtype=np.int64)
        self._counts = np.zeros(len(self._bounds) + 1, np.int64)
        self._sum_ns = 0

    def add(self, durations_ns: npt.NDArray[np.int64]) -> None:
        if len(durations_ns):
            # bucket i counts bounds[i-1] < d <= bounds[i], Prometheus's `le`; the last one is +Inf.
            self._counts += np.bincount(np.searchsorted(self._bounds_ns, durations_ns), minlength=len(self._counts))
            self._sum_ns += int(durations_ns.sum())

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative = np.cumsum(self._counts)
        buckets = [(repr(bound), float(count)) for bound, count in zip(self._bounds, cumulative[:-1], strict=True)]
        buckets.append(("+Inf", float(cumulative[-1])))
        family.add_metric(labels, buckets, self._sum_ns / 1e9)
