"""Whether each read hit the spoke or missed it: the read's own verdict, the spoke's, or its latency.

Order of trust: the verdict the reader saw (e.g. an `X-Cache-Status` header); else the spoke's log
line for the same key ending at about the same time; else a hit/miss split of read latencies learnt
online. Hits and misses form two clusters in log-latency (local disk or memory versus a round trip
across regions), so the split is Otsu's threshold on a decaying histogram of log-durations: the
two-means split of a one-dimensional distribution, computed in O(bins) per window.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from stallwatch.correlator.intervals import I64
from stallwatch.eventbatch import Verdict

I8 = npt.NDArray[np.int8]

# log10(duration in ns) from 1 µs to 1000 s.
_LOG_LO, _LOG_HI, _BINS = 3.0, 12.0, 180


def join_spoke(
    read_key: npt.NDArray[np.uint64], read_end: I64, spoke_key: npt.NDArray[np.uint64], spoke_end: I64,
    spoke_verdict: I8, tolerance_ns: int,
) -> I8:
    """The spoke's verdict for each read: same key, the request ending nearest the read's end.

    UNKNOWN where no request of that key ended within `tolerance_ns` of the read's end.
    """
    verdict = np.full(read_key.size, Verdict.UNKNOWN, dtype=np.int8)
    if read_key.size == 0 or spoke_key.size == 0:
        return verdict
    _, rank = np.unique(np.concatenate((spoke_key, read_key)), return_inverse=True)
    spoke_rank, read_rank = rank[: spoke_key.size].astype(np.int64), rank[spoke_key.size:].astype(np.int64)
    # Time in µs relative to the earliest stamp keeps (key rank, time) packable in one int64.
    base = int(min(spoke_end.min(), read_end.min()))
    spoke_us, read_us = (spoke_end - base) // 1000, (read_end - base) // 1000
    span = int(max(spoke_us.max(), read_us.max())) + 2
    packed = spoke_rank * span + spoke_us
    order = np.argsort(packed, kind="stable")
    packed_sorted = packed[order]
    position = np.searchsorted(packed_sorted, read_rank * span + read_us)
    best_distance = np.full(read_key.size, np.iinfo(np.int64).max, dtype=np.int64)
    for candidate in (position - 1, position):
        valid = (candidate >= 0) & (candidate < packed_sorted.size)
        index = order[np.clip(candidate, 0, packed_sorted.size - 1)]
        same_key = valid & (spoke_rank[index] == read_rank)
        distance = np.abs(spoke_end[index] - read_end)
        better = same_key & (distance <= tolerance_ns) & (distance < best_distance)
        verdict[better] = spoke_verdict[index][better]
        best_distance[better] = distance[better]
    return verdict


class LatencySplit:
    """Hit/miss threshold on read latency, learnt online from two clusters.

    `separation` is the least ratio between the two cluster means for the split to be trusted; when
    the histogram is one cluster (a fully warm or fully cold cache), reads are classed by
    `fallback_threshold_ns` alone.
    """

    def __init__(self, *, half_life_reads: float = 50_000.0, separation: float = 4.0,
                 fallback_threshold_ns: int = 20_000_000) -> None:
        self._counts = np.zeros(_BINS, dtype=np.float64)
        self._decay_per_read = 0.5 ** (1.0 / half_life_reads)
        self._min_gap = np.log10(separation)
        self._centres = np.linspace(_LOG_LO, _LOG_HI, _BINS + 1)[:-1] + (_LOG_HI - _LOG_LO) / _BINS / 2
        self.threshold_ns = float(fallback_threshold_ns)
        self.fallback_threshold_ns = float(fallback_threshold_ns)

    def learn(self, duration_ns: I64) -> None:
        if duration_ns.size == 0:
            return
        # In place: one float array per window's reads rather than one per operation. Single precision: its
        # logarithm costs a fifth of a double's, and errs by about 1e-6 decades where a bin is 0.05 wide.
        scaled = np.maximum(duration_ns, 1).astype(np.float32)
        np.log10(scaled, out=scaled)
        scaled -= _LOG_LO
        scaled *= _BINS / (_LOG_HI - _LOG_LO)
        np.clip(scaled, 0, _BINS - 1, out=scaled)  # clipped before the cast: the same bins, half the bytes
        bins = scaled.astype(np.intp)
        self._counts *= self._decay_per_read ** duration_ns.size
        self._counts += np.bincount(bins, minlength=_BINS)
        self.threshold_ns = self._split()

    def _split(self) -> float:
        counts, centres = self._counts, self._centres
        total = counts.sum()
        below = np.cumsum(counts)[:-1]
        above = total - below
        moment_below = np.cumsum(counts * centres)[:-1]
        moment_above = (counts * centres).sum() - moment_below
        with np.errstate(divide="ignore", invalid="ignore"):
            mean_below, mean_above = moment_below / below, moment_above / above
            between = below * above * (mean_above - mean_below) ** 2
        between[(below == 0) | (above == 0)] = -1.0
        cut = int(np.argmax(between))
        if between[cut] <= 0 or mean_above[cut] - mean_below[cut] < self._min_gap:
            return self.fallback_threshold_ns
        return float(10 ** ((centres[cut] + centres[cut + 1]) / 2))

    def classify(self, duration_ns: I64) -> I8:
        return np.where(duration_ns > self.threshold_ns, Verdict.MISS, Verdict.HIT).astype(np.int8)
