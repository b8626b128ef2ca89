"""Cache what-if: the hit ratio an LRU spoke would reach at other capacities.

A spatially sampled miss-ratio curve (SHARDS, Waldspurger et al., FAST '15), fixed-size variant: a
read is sampled when a hash of its key falls below a threshold T (rate R = T / 2^64), so every
reference to a sampled key is seen and reuse distances among sampled keys, scaled by 1/R, estimate
the true ones. When more than `max_keys` keys are tracked, T is lowered and the keys above it are
dropped: memory stays bounded whatever the working set. Reuse distances are in bytes (a reference
hits an LRU cache of C bytes when the distinct bytes used since its last use, itself included, fit
in C) and land in a log-spaced histogram, so any capacity can be asked after the fact.

Sampling by key assumes no single key carries a large share of all references. Training reads
satisfy it (each item once per epoch); a few very hot keys make the estimate swing with whether
they happen to be sampled.

The sampling filter is vectorised; only sampled references (a fraction R of reads, which shrinks
as the working set grows) take a Python step, each one vectorised over the tracked keys.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_BINS_PER_OCTAVE = 32
_OCTAVES = 56  # 1 byte .. 2^56 bytes
_FULL = float(2**64)


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
    def __init__(self, *, sample_rate: float = 0.1, max_keys: int = 1024) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        self._threshold = min(int(sample_rate * _FULL), 2**64 - 1)
        self._max_keys = max_keys
        self._slot_of: dict[int, int] = {}
        self._hash = np.zeros(max_keys + 1, dtype=np.uint64)
        self._size = np.zeros(max_keys + 1, dtype=np.int64)
        self._last = np.full(max_keys + 1, -1, dtype=np.int64)  # -1: free slot
        self._free = list(range(max_keys, -1, -1))
        self._clock = 0
        self._hist = np.zeros(_BINS_PER_OCTAVE * _OCTAVES, dtype=np.float64)
        self._cold = 0.0
        self._total = 0.0

    @property
    def sample_rate(self) -> float:
        return self._threshold / _FULL

    @property
    def references(self) -> float:
        """Estimated references seen (sampled ones scaled by 1/R)."""
        return self._total

    def feed(self, keys: npt.NDArray[np.uint64], sizes: npt.NDArray[np.int64]) -> None:
        """References in time order."""
        hashes = _mix(keys)
        sampled = np.flatnonzero(hashes < np.uint64(self._threshold))
        for h, size in zip(hashes[sampled].tolist(), sizes[sampled].tolist(), strict=True):
            if h >= self._threshold:  # the threshold dropped earlier in this batch
                continue
            self._reference(h, max(int(size), 1))

    def _reference(self, h: int, size: int) -> None:
        rate = self._threshold / _FULL
        weight = 1.0 / rate
        self._total += weight
        self._clock += 1
        slot = self._slot_of.get(h)
        if slot is None:
            self._cold += weight
            slot = self._free.pop()
            self._slot_of[h] = slot
            self._hash[slot] = h
        else:
            newer = self._last > self._last[slot]
            # Other keys' bytes are a 1/R sample of all others'; the key's own size is known exactly.
            distance = size + int(self._size[newer].sum()) / rate
            self._hist[self._bin(distance)] += weight
        self._size[slot] = size
        self._last[slot] = self._clock
        if len(self._slot_of) > self._max_keys:
            self._lower_threshold()

    @staticmethod
    def _bin(distance: float) -> int:
        return min(int(np.log2(max(distance, 1.0)) * _BINS_PER_OCTAVE), _BINS_PER_OCTAVE * _OCTAVES - 1)

    def _lower_threshold(self) -> None:
        """Keep the smallest 7/8 of tracked hashes: T drops to the largest of them plus one."""
        used = np.flatnonzero(self._last >= 0)
        keep = len(used) * 7 // 8
        ordered = np.sort(self._hash[used])
        self._threshold = int(ordered[keep])
        for slot in used[self._hash[used] >= np.uint64(self._threshold)].tolist():
            del self._slot_of[int(self._hash[slot])]
            self._last[slot] = -1
            self._size[slot] = 0
            self._free.append(slot)

    def hit_ratio(self, capacity_bytes: float) -> float | None:
        """Estimated LRU hit ratio at this capacity; None before any reference."""
        if self._total <= 0:
            return None
        fits = int(np.log2(max(capacity_bytes, 1.0)) * _BINS_PER_OCTAVE)
        return float(self._hist[: fits + 1].sum() / self._total)
