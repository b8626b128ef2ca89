"""Cache what-if: the hit ratio an LRU spoke would reach at other capacities.

A spatially sampled miss-ratio curve (SHARDS, Waldspurger et al., FAST '15), fixed-size variant: a
read is sampled when a hash of its key falls below a threshold T (rate R = T / 2^64), so every
reference to a sampled key is seen and reuse distances among sampled keys, scaled by 1/R, estimate
the true ones. T starts at 2^64, every key sampled, so a working set of up to `max_keys` keys gets
the exact curve; when a batch would bring the tracked keys past `max_keys`, T is lowered first, to
the rate at which the tracked and the batch's keys fill 7/8 of the cap, and the keys above it are
dropped: memory stays bounded whatever the working set. Reuse distances are in bytes (a reference
hits an LRU cache of C bytes when the distinct bytes used since its last use, itself included, fit
in C) and land in a log-spaced histogram, so any capacity can be asked after the fact.

A failed fetch (a read of 0 bytes: the client records a read that raised with the bytes it got) is
no reference for the curve: it moved nothing, the spoke cached nothing, and its retry is the
reference. Failures are counted (`failed`), not sampled.

Sampling by key assumes no single key carries a large share of all references. Training reads
satisfy it (each item once per epoch); a few very hot keys make the estimate swing with whether
they happen to be sampled.

All of it is array work: a batch's sampled references and the tracked keys (in recency order, one
reference each) form one sequence whose exact reuse distances come from `reuse.distances_from_previous`.
The tracked keys are also held sorted, with each one's place in the recency order, so a batch finds its
keys' previous references by binary search: a window's work grows with its sampled references, not
with the thousands of keys tracked (with 0.5 s windows, sorting those each window was most of it).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from stallwatch.correlator.reuse import distances_from_previous, previous_references

_BINS_PER_OCTAVE = 256  # a bin is 0.27 % wide: a capacity is answered to that
_OCTAVES = 56  # 1 byte .. 2^56 bytes
_FULL = 2**64
FEED_SLICE = 32_768  # references folded at once


def _distinct(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The distinct values, sorted: `np.unique` hashes first (NumPy 2.3+), several times slower here."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if ordered.size else ordered


def _mix(keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser: read keys are hashes already, this decorrelates sampling from them."""
    z = keys.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


class MissRatioCurve:
    def __init__(self, *, sample_rate: float = 1.0, max_keys: int = 8192) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        self._threshold = min(round(sample_rate * _FULL), _FULL)  # sampled: hash < threshold
        self._max_keys = max_keys
        # Tracked keys, least recently used first, with their sizes at their last reference.
        self._keys = np.zeros(0, dtype=np.uint64)
        self._sizes = np.zeros(0, dtype=np.int64)
        # The same keys sorted, and each one's place in the recency order above.
        self._sorted = np.zeros(0, dtype=np.uint64)
        self._place = np.zeros(0, dtype=np.int64)
        self._hist = np.zeros(_BINS_PER_OCTAVE * _OCTAVES, dtype=np.float64)
        self._total = 0.0
        self.failed = 0

    @property
    def sample_rate(self) -> float:
        return self._threshold / _FULL

    @property
    def keys(self) -> int:
        """Keys tracked now; divided by the sample rate, an estimate of the distinct keys seen."""
        return int(self._keys.size)

    @property
    def references(self) -> float:
        """Estimated references seen (sampled ones scaled by 1/R)."""
        return self._total

    def feed(self, keys: npt.NDArray[np.uint64], sizes: npt.NDArray[np.int64],
             times: npt.NDArray[np.int64] | None = None) -> None:
        """References in time order, a slice at a time: the tracked keys carry the recency order from one slice
        to the next, so the distances are the same, and the work arrays stay the size of a slice (one window
        of a flood holds hundreds of thousands of reads). With `times` (each reference's), references in any
        order: in one slice, those not sampled are left out first, so only the sampled few are sorted; the
        references of several slices are all sorted, since the rate may fall between slices."""
        if times is not None and keys.size <= FEED_SLICE:
            self._feed(keys, sizes, times)
            return
        if times is not None:
            order = np.argsort(times, kind="stable")
            keys, sizes = keys[order], sizes[order]
        for first in range(0, keys.size, FEED_SLICE):
            self._feed(keys[first:first + FEED_SLICE], sizes[first:first + FEED_SLICE])

    def _feed(self, keys: npt.NDArray[np.uint64], sizes: npt.NDArray[np.int64],
              times: npt.NDArray[np.int64] | None = None) -> None:
        """One slice: its fetched references sampled, then, with `times`, the sampled few put in time order."""
        fetched = sizes > 0
        n_fetched = int(np.count_nonzero(fetched))
        self.failed += int(sizes.size - n_fetched)
        rows = None if n_fetched == sizes.size else np.flatnonzero(fetched)  # usually every read fetched
        hashes = _mix(keys if rows is None else keys[rows])
        sampled = self._sampled(hashes)  # places, not masks: a window samples a few of its thousands of reads
        rows, hashes = (sampled if rows is None else rows[sampled]), hashes[sampled]
        if times is not None:
            order = np.argsort(times[rows], kind="stable")
            rows, hashes = rows[order], hashes[order]
        sizes = sizes[rows].astype(np.int64)
        places = self._places(hashes)
        unseen = _distinct(hashes[places < 0])
        if self._keys.size + unseen.size > self._max_keys:
            # The batch would pass the cap: T drops first, to keep 7/8 of the cap of these keys.
            distinct = np.sort(np.concatenate((self._sorted, unseen)))
            self._threshold = int(distinct[self._max_keys * 7 // 8])
            self._drop_keys_from(self._threshold)
            kept = self._sampled(hashes)
            hashes, sizes = hashes[kept], sizes[kept]
            places = self._places(hashes)
        self._reference(hashes, sizes, places)

    def _sampled(self, hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """The places of the sampled hashes."""
        if self._threshold >= _FULL:
            return np.arange(hashes.size)
        return np.flatnonzero(hashes < np.uint64(self._threshold))

    def _places(self, hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """Each hash's place in the recency order of the tracked keys; -1 for a key not tracked."""
        if self._sorted.size == 0:
            return np.full(hashes.size, -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self._sorted, hashes), self._sorted.size - 1)
        return np.where(self._sorted[at] == hashes, self._place[at], -1)

    def _drop_keys_from(self, threshold: int) -> None:
        """Stop tracking the keys at or above the threshold (no longer sampled)."""
        kept = self._keys < np.uint64(threshold)
        self._keys, self._sizes = self._keys[kept], self._sizes[kept]
        below = int(np.searchsorted(self._sorted, np.uint64(threshold)))
        self._sorted = self._sorted[:below]
        self._place = (np.cumsum(kept) - 1)[self._place[:below]]

    def _reference(self, hashes: npt.NDArray[np.uint64], sizes: npt.NDArray[np.int64],
                   places: npt.NDArray[np.int64]) -> None:
        """Fold references at one sampling rate into the histogram; the tracked keys precede them, each
        reference's tracked key at `places` (-1 if untracked)."""
        if hashes.size == 0:
            return
        rate = self.sample_rate
        weight = 1.0 / rate
        tracked = self._keys.size
        # In the sequence (tracked keys, then the batch) a reference's previous one is the batch's last
        # reference to its key before it, else the key's tracked place; a tracked key has none.
        within = previous_references(hashes)
        previous = np.concatenate((np.full(tracked, -1, dtype=np.int64),
                                   np.where(within >= 0, tracked + within, places)))
        distance = distances_from_previous(previous, np.concatenate((self._sizes, sizes)))[tracked:]
        reused = np.isfinite(distance)
        # Other keys' bytes are a 1/R sample of all others'; the key's own size is known exactly.
        scaled = sizes[reused] + (distance[reused] - sizes[reused]) / rate
        np.add.at(self._hist, self._bins(scaled), weight)
        self._total += weight * hashes.size
        self._retrack(hashes, sizes, places, within)

    def _retrack(self, hashes: npt.NDArray[np.uint64], sizes: npt.NDArray[np.int64], places: npt.NDArray[np.int64],
                 within: npt.NDArray[np.int64]) -> None:
        """The tracked keys after the batch: each one's last reference, in time order. The keys the batch
        did not use keep their order; the batch's last references follow."""
        last = np.ones(hashes.size, dtype=bool)
        last[within[within >= 0]] = False  # a reference some later one follows
        last_rows = np.flatnonzero(last)
        moved = np.zeros(self._keys.size, dtype=bool)
        moved[places[places >= 0]] = True
        stayed = ~moved
        kept = int(stayed.sum())
        new_place = np.cumsum(stayed) - 1
        was = places[last_rows]
        new_place[was[was >= 0]] = kept + np.flatnonzero(was >= 0)
        self._keys = np.concatenate((self._keys[stayed], hashes[last_rows]))
        self._sizes = np.concatenate((self._sizes[stayed], sizes[last_rows]))
        # The index: every tracked key stays, at its new place; the batch's new keys go in, in key order.
        fresh = np.flatnonzero(was < 0)
        fresh = fresh[np.argsort(hashes[last_rows[fresh]])]
        at = np.searchsorted(self._sorted, hashes[last_rows[fresh]])
        self._sorted = np.insert(self._sorted, at, hashes[last_rows[fresh]])
        self._place = np.insert(new_place[self._place], at, kept + fresh)

    @staticmethod
    def _bins(distance: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
        bins = (np.log2(np.maximum(distance, 1.0)) * _BINS_PER_OCTAVE).astype(np.int64)
        return np.minimum(bins, _BINS_PER_OCTAVE * _OCTAVES - 1)

    def hit_ratio(self, capacity_bytes: float) -> float | None:
        """Estimated LRU hit ratio at this capacity; None before any reference."""
        if self._total <= 0:
            return None
        fits = int(np.log2(max(capacity_bytes, 1.0)) * _BINS_PER_OCTAVE)
        return float(self._hist[: fits + 1].sum() / self._total)
