"""Exact LRU reuse distances in bytes of a reference sequence, on whole arrays.

A reference to a key hits an LRU cache of C bytes when the key's own size plus the bytes of the
distinct other keys used since its previous reference fit in C (an LRU cache holds the most recent
keys that fit: its content at any capacity is a prefix of the recency order). For reference i whose
previous reference to the same key is p, the distinct others are the references j in (p, i) that
are their key's last one before i, that is whose next reference comes after i. So

    distance(i) = size(i) + sum of size(j) for p < j < i  -  sum of size(j) for j > p, next(j) < i,

and the last sum is a two-dimensional dominance sum over the points (j, next(j)), one per reuse,
computed for all references at once by a bottom-up merge sort (O(n log^2 n), no Python per event).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from stallwatch.correlator.intervals import F64, I64

_DENSE_UP_TO = 256  # reuses up to which `earlier_and_larger` compares all pairs (measured faster below ~400)


def reuse_distances(keys: npt.NDArray[np.integer], sizes: I64) -> F64:
    """Per reference, the bytes an LRU cache must hold for it to hit; inf for a key's first reference."""
    return distances_from_previous(previous_references(keys), sizes)


def previous_references(keys: npt.NDArray[np.integer]) -> I64:
    """Per reference, the index of the previous reference to the same key; -1 for a key's first."""
    n = keys.size
    previous = np.full(n, -1, dtype=np.int64)
    if n < 2:
        return previous
    order = np.lexsort((np.arange(n), keys))
    repeat = np.flatnonzero(keys[order][1:] == keys[order][:-1]) + 1
    previous[order[repeat]] = order[repeat - 1]
    return previous


def distances_from_previous(previous: I64, sizes: I64) -> F64:
    """`reuse_distances` given each reference's previous one (-1 for none): a caller that knows them (the
    what-if's tracked keys, one reference each) need not sort its whole sequence again."""
    distance = np.full(previous.size, np.inf)
    reuse = np.flatnonzero(previous >= 0)  # references with a previous one, in time order
    if reuse.size == 0:
        return distance
    before = previous[reuse]
    weights = sizes.astype(np.float64)
    used = np.concatenate(([0.0], np.cumsum(weights)))
    # Points (j, next(j)) in order of next(j): the one for j = previous[i] comes exactly at i.
    nested = earlier_and_larger(before, weights[before])
    distance[reuse] = weights[reuse] + used[reuse] - used[before + 1] - nested
    return distance


def earlier_and_larger(values: I64, weights: F64) -> F64:
    """Per position q, the summed weights of the positions r < q with values[r] > values[q].

    Values are distinct and non-negative.
    """
    m = values.size
    out = np.zeros(m, dtype=np.float64)
    if m < 2:
        return out
    if m <= _DENSE_UP_TO:
        # A window's sampled reuses are a hundred or so: one comparison matrix costs less than the merge
        # passes' dozens of small array operations each (sums of whole byte counts: exact either way).
        dense: F64 = np.tril(values[None, :] > values[:, None], -1) @ weights
        return dense
    span = np.int64(values.max() + 1)
    arranged = np.arange(m, dtype=np.int64)  # positions, each block of `width` sorted by value
    width = 1
    while width < m:
        # Merge neighbouring blocks; each right-half position gains the left-half weight above it.
        merged = arranged[np.argsort(arranged // (2 * width) * span + values[arranged], kind="stable")]
        left = (merged // width) % 2 == 0
        left_weight = np.where(left, weights[merged], 0.0)
        block = merged // (2 * width)
        starts = np.flatnonzero(np.concatenate(([True], block[1:] != block[:-1])))
        lengths = np.diff(np.append(starts, m))
        running = np.cumsum(left_weight)
        passed = running - np.repeat(np.concatenate(([0.0], running))[starts], lengths)
        above = np.repeat(np.add.reduceat(left_weight, starts), lengths) - passed
        out[merged[~left]] += above[~left]
        arranged = merged
        width *= 2
    return out
