"""Exact LRU reuse distances in bytes of a reference sequence, on whole arrays.

A reference to a key hits an LRU cache of C bytes when the key's own size plus the bytes of the
distinct other keys used since its previous reference fit in C (an LRU cache holds the most recent
keys that fit: its content at any capacity is a prefix of the recency order). For reference i whose
previous reference to the same key is p, the distinct others are the references j in (p, i) that
are their key's last one before i, that is whose next reference comes after i. So

    distance(i) = size(i) + sum of size(j) for p < j < i  -  sum of size(j) for j > p, next(j) < i,

and the last sum is a two-dimensional dominance sum over the points (j, next(j)), one per reuse,
computed for all references at once: for a window's thousand or so sampled reuses in blocks (pairs compared
within a block, earlier blocks summed by value), past that by a bottom-up merge sort (O(n log^2 n)); no Python
per event either way. Where the correlator's C kernels are built (native.py), by a Fenwick tree in C instead.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from stallwatch.correlator import native
from stallwatch.correlator.intervals import F64, I64

_BLOCK = 64  # positions compared pairwise within a block (measured fastest at a window's ~900 sampled reuses)
_BLOCKED_UP_TO = 1280  # points up to which `earlier_and_larger` works in blocks (its table grows as the square)


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
    if native.kernels is not None:  # by a Fenwick tree over the values, in C
        native.kernels.earlier_and_larger(np.ascontiguousarray(values, dtype=np.int64),
                                          np.ascontiguousarray(weights, dtype=np.float64), out)
        return out
    if m <= _BLOCKED_UP_TO:
        return _in_blocks(values, weights)
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


def _in_blocks(values: I64, weights: F64) -> F64:
    """`earlier_and_larger` for a few thousand points at most, in a dozen array operations (the merge passes
    take about twenty each): pairs within a block of `_BLOCK` positions compared all at once, and the
    weight of every earlier block's positions summed over the values above, per block, on one table of
    blocks x values. Sums of whole byte counts: exact in any order."""
    m = values.size
    blocks = -(-m // _BLOCK)
    by_value = np.argsort(values)
    rank = np.empty(m, dtype=np.int64)
    rank[by_value] = np.arange(m)
    block_of = np.arange(m) // _BLOCK
    # earlier[k, r]: the point of the r-th smallest value lies in a block before k.
    earlier = block_of[by_value] < np.arange(blocks)[:, None]
    above = np.cumsum((earlier * weights[by_value])[:, ::-1], axis=1)[:, ::-1]  # [k, r]: values from the r-th up
    out = np.zeros(blocks * _BLOCK)
    out[:m] = np.concatenate((above[:, 1:], np.zeros((blocks, 1))), axis=1)[block_of, rank]
    padding = blocks * _BLOCK - m  # padded points: value -1 (below every value), weight 0
    grid = np.concatenate((values, np.full(padding, -1, dtype=values.dtype))).reshape(blocks, _BLOCK)
    grid_weights = np.concatenate((weights, np.zeros(padding))).reshape(blocks, _BLOCK)
    larger = (grid[:, None, :] > grid[:, :, None]) & np.tri(_BLOCK, _BLOCK, -1, dtype=bool)  # [k, q, r]
    # einsum's own loop, not a matrix product: no float copy of the table, and no call into BLAS, whose threads
    # then spin on the other cores for a while (CPU the agent would be charged for)
    out += np.einsum("kqr,kr->kq", larger, grid_weights).reshape(-1)
    return out[:m]
