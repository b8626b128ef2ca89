"""Vectorised interval arithmetic: equality and overlap joins, per-group union lengths.

Every function works on whole NumPy columns at once; none loops over events in Python. Times are
int64 nanoseconds. A "group" is a small integer per row (e.g. the index of the stall an interval was
clipped to); results come back as one value per group.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


def ragged_pairs(lo: I64, hi: I64) -> tuple[I64, I64]:
    """For rows i with index ranges [lo[i], hi[i]), every (i, j) with j in the range, as two arrays."""
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    left = np.repeat(np.arange(lo.size, dtype=np.int64), counts)
    if total == 0:
        return left, np.zeros(0, dtype=np.int64)
    # j = lo[i] + (position of the pair within its row): a running index reset at each row start.
    row_starts = np.cumsum(counts) - counts
    right = np.arange(total, dtype=np.int64) - np.repeat(row_starts, counts) + np.repeat(lo, counts)
    return left, right


def composite_key(*parts: npt.NDArray[np.integer]) -> I64:
    """Pack integer columns of small range into one sortable int64 (lexicographic order)."""
    key = np.zeros(parts[0].size, dtype=np.int64)
    for part in parts:
        values = part.astype(np.int64)
        if values.size:
            values = values - values.min()
        span = int(values.max()) + 1 if values.size else 1
        key = key * span + values
    return key


def equal_join(left_key: I64, right_key: I64) -> tuple[I64, I64]:
    """All (i, j) with left_key[i] == right_key[j]; j indexes right in its original order."""
    order = np.argsort(right_key, kind="stable")
    sorted_keys = right_key[order]
    lo = np.searchsorted(sorted_keys, left_key, side="left")
    hi = np.searchsorted(sorted_keys, left_key, side="right")
    left, position = ragged_pairs(lo, hi)
    return left, order[position]


def overlap_join(
    left_group: I64, left_start: I64, left_end: I64, right_group: I64, right_start: I64, right_end: I64
) -> tuple[I64, I64]:
    """All (i, j) with equal group and intervals overlapping (start < other end, end > other start)."""
    if left_group.size == 0 or right_group.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    longest = int((right_end - right_start).max())
    # Sort the right side by (group, start); an overlapping j has start in [left_start - longest, left_end).
    order = np.lexsort((right_start, right_group))
    groups, starts = right_group[order], right_start[order]
    span = int(max(starts.max(), left_end.max()) - min(starts.min(), left_start.min() - longest)) + 2
    base = int(min(starts.min(), left_start.min() - longest))
    packed = groups * span + (starts - base)
    lo = np.searchsorted(packed, left_group * span + (left_start - longest - base), side="left")
    hi = np.searchsorted(packed, left_group * span + (left_end - base), side="left")
    left, position = ragged_pairs(lo, hi)
    right = order[position]
    keep = right_end[right] > left_start[left]
    return left[keep], right[keep]


def union_length(group: I64, start: I64, end: I64, n_groups: int) -> I64:
    """Per group, the length covered by the union of its intervals (each start <= end).

    Sorted by (group, start), an interval adds only what lies past the furthest end seen so far in
    its group; groups are kept apart by restarting that running maximum at each group boundary.
    """
    if group.size == 0:
        return np.zeros(n_groups, dtype=np.int64)
    order = np.lexsort((start, group))
    g, s, e = group[order], start[order], end[order]
    # Offset each group onto its own stretch of a shared timeline so one running maximum serves all.
    lowest = int(s.min())
    width = int((e - lowest).max()) + 1
    shift = g * width - lowest
    s_shifted, e_shifted = s + shift, e + shift
    reach = np.maximum.accumulate(e_shifted)
    before = np.concatenate(([np.iinfo(np.int64).min], reach[:-1]))
    added = np.maximum(e_shifted - np.maximum(s_shifted, before), 0)
    return np.bincount(g, weights=added, minlength=n_groups).astype(np.int64)
