"""Vectorised interval arithmetic: equality and overlap joins, per-group union lengths.

Every function works on whole NumPy columns at once; none loops over events in Python. Times are
int64 nanoseconds. A "group" is a small integer per row (e.g. the index of the stall an interval was
clipped to); results come back as one value per group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from stallwatch.correlator import native

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


# Packed keys stay below this, so no product or sum of them wraps around.
_KEY_LIMIT = 2**62


def composite_key(*parts: npt.NDArray[np.integer]) -> I64:
    """Pack integer columns into one sortable int64 (lexicographic order). Columns of small range are packed
    as they are; when the packed range would pass 2^62 (a forged batch number of 2^62, ranks far apart) the
    key so far and the column are replaced by their ranks among the rows, which keeps the order and fits."""
    key = np.zeros(parts[0].size, dtype=np.int64)
    key_span = 1
    for part in parts:
        values = part.astype(np.int64)
        low = int(values.min()) if values.size else 0
        span = int(values.max()) - low + 1 if values.size else 1  # Python ints: exact however far apart
        if key_span * span >= _KEY_LIMIT:
            key, key_span = _ranks(key), int(key.size)
            values = _ranks(values)
            span = int(values.max()) + 1
        else:
            values = values - low
        key = key * span + values
        key_span *= span
    return key


def _ranks(values: I64) -> I64:
    """Each value's place among the distinct values: the same order, in a range no larger than the rows."""
    ranked: I64 = np.unique(values, return_inverse=True)[1].reshape(-1).astype(np.int64)
    return ranked


def distinct_ids(values: npt.NDArray[np.integer]) -> list[int]:
    """The distinct values of a column of small ids (interned jobs, ranks), in order: counted in a table of
    their range, no sort, where the range is small (`np.unique` of a window's reads costs several times more)."""
    if values.size == 0:
        return []
    low, high = int(values.min()), int(values.max())
    if low == high:
        return [low]
    if high - low > 4 * values.size + 64:
        return list(np.unique(values).tolist())
    counts = np.bincount(np.subtract(values, low, dtype=np.intp), minlength=high - low + 1)
    return (np.flatnonzero(counts) + low).tolist()


def distinct_rows(*columns: npt.NDArray[np.integer]) -> tuple[I64, I64]:
    """The first row of each distinct combination of the columns (in key order), and each row's group index."""
    if columns[0].size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    _, first, group = np.unique(composite_key(*columns), return_index=True, return_inverse=True)
    return first.astype(np.int64), group.reshape(-1).astype(np.int64)


def equal_join(left_key: I64, right_key: I64) -> tuple[I64, I64]:
    """All (i, j) with left_key[i] == right_key[j], for left keys that are distinct (e.g. one step
    per (job, rank, batch)). Only the left side, the small one, is sorted; the right is probed."""
    if left_key.size == 0 or right_key.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    low = int(min(left_key.min(), right_key.min()))
    span = int(max(left_key.max(), right_key.max())) - low + 1
    if span <= 4 * (left_key.size + right_key.size):
        # Dense keys (packed job, rank, batch): a lookup table beats a binary search per probe.
        table = np.full(span, -1, dtype=np.int64)
        table[left_key - low] = np.arange(left_key.size)
        found = table[right_key - low]
        right = np.flatnonzero(found >= 0)
        return found[right], right
    order = np.argsort(left_key)
    sorted_keys = left_key[order]
    position = np.minimum(np.searchsorted(sorted_keys, right_key), sorted_keys.size - 1)
    right = np.flatnonzero(sorted_keys[position] == right_key)
    return order[position[right]], right


def equal_join_columns(left: Sequence[I64], right: Sequence[npt.NDArray[np.integer]]) -> tuple[I64, I64]:
    """All (i, j) whose columns are all equal, for left rows that are distinct and few (a window's stalls)
    and right rows that are many (its reads). Right rows outside the left's range in any column cannot
    match: they are dropped before any key is built (column by column: put the most selective first), and
    the rest are probed in a table of the left's keys, when that table is small; else the packed keys go
    to `equal_join`."""
    empty = np.zeros(0, dtype=np.int64)
    if left[0].size == 0 or right[0].size == 0:
        return empty, empty
    lows = [int(column.min()) for column in left]
    spans = [int(column.max()) - low + 1 for column, low in zip(left, lows, strict=True)]
    if math.prod(spans) > 8 * left[0].size + 64:  # sparse keys: a table would be mostly empty
        packed = composite_key(*(np.concatenate((a, b)) for a, b in zip(left, right, strict=True)))
        return equal_join(packed[:left[0].size], packed[left[0].size:])
    left_key = np.zeros(left[0].size, dtype=np.int64)
    for a, low, span in zip(left, lows, spans, strict=True):
        left_key = left_key * span + (a - low)
    table = np.full(math.prod(spans), -1, dtype=np.int64)
    table[left_key] = np.arange(left_key.size)
    if native.kernels is not None:  # one pass over the right rows: the rest is NumPy's version of that pass
        left_of, right_of = np.empty(right[0].size, dtype=np.int64), np.empty(right[0].size, dtype=np.int64)
        pairs = native.kernels.equal_join_table(table, np.array(lows, dtype=np.int64), np.array(spans, dtype=np.int64),
                                                tuple(np.ascontiguousarray(column) for column in right), left_of,
                                                right_of)
        return left_of[:pairs], right_of[:pairs]
    rows = np.flatnonzero((right[0] >= lows[0]) & (right[0] < lows[0] + spans[0]))
    right_key = right[0][rows].astype(np.int64) - lows[0]
    for column, low, span in zip(right[1:], lows[1:], spans[1:], strict=True):  # on the rows left: few
        values = column[rows].astype(np.int64)  # each column gathered once, for its test and for the key
        values -= low
        inside = (values >= 0) & (values < span)
        if not inside.all():
            rows, right_key, values = rows[inside], right_key[inside], values[inside]
        right_key *= span  # in place: the right side is long
        right_key += values
    found = table[right_key]
    hit = np.flatnonzero(found >= 0)
    return (found, rows) if hit.size == found.size else (found[hit], rows[hit])


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
    """Per group, the length covered by the union of its intervals (each start <= end)."""
    if group.size == 0:
        return np.zeros(n_groups, dtype=np.int64)
    shifted_start, shifted_end = _shift_groups_apart(group, start, end)
    order = np.argsort(shifted_start)
    return sorted_union_length(group[order], shifted_start[order], shifted_end[order], n_groups)


def _shift_groups_apart(group: I64, start: I64, end: I64) -> tuple[I64, I64]:
    """Offset each group onto its own stretch of one timeline, so (group, start) order is start order."""
    lowest = int(start.min())
    width = int((end - lowest).max()) + 1
    shift = group * width - lowest
    return start + shift, end + shift


def covered_and_subsets(group: I64, start: I64, end: I64, subsets: tuple[npt.NDArray[np.bool_], ...],
                        n_groups: int) -> tuple[I64, tuple[I64, ...], I64]:
    """Per group, union lengths of all intervals and of each `subsets` mask's, and its earliest start (int64's
    maximum for a group without intervals), all from one ordering of the rows.

    The rows are put in group order by a radix sort of the group numbers (a tenth of a sort by start). A
    worker's reads come in the order they ended, so within a group they are then mostly in end order already:
    the union is taken on the mirrored timeline (end order read backwards is start order there), and only rows
    in neither order are sorted by start."""
    if native.kernels is not None:  # the same in one pass of C, its rows in the same orders
        cover, subset_cover, first = (np.empty(n_groups, dtype=np.int64),
                                      np.empty((len(subsets), n_groups), dtype=np.int64),
                                      np.empty(n_groups, dtype=np.int64))
        masks = np.stack(subsets).view(np.uint8) if subsets else np.zeros(0, dtype=np.uint8)
        native.kernels.covered_and_subsets(_int64(group), _int64(start), _int64(end), masks.reshape(-1),
                                           len(subsets), cover, subset_cover.reshape(-1), first)
        return cover, tuple(subset_cover), first
    first = np.full(n_groups, np.iinfo(np.int64).max, dtype=np.int64)
    if group.size == 0:
        return np.zeros(n_groups, dtype=np.int64), tuple(np.zeros(n_groups, dtype=np.int64) for _ in subsets), first
    shifted_start, shifted_end = _shift_groups_apart(group, start, end)
    order = np.argsort(group.astype(np.uint16) if n_groups <= 2**16 else group, kind="stable")
    g, s, e = group[order], shifted_start[order], shifted_end[order]
    leads = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1])))  # each group's first row
    # A group's shift is the same on all its rows: its earliest start is its least shifted start less the shift.
    first[g[leads]] = np.minimum.reduceat(s, leads) - (s[leads] - start[order[leads]])
    chosen = tuple(subset[order] for subset in subsets)
    if not bool((s[1:] >= s[:-1]).all()):
        if bool((e[1:] >= e[:-1]).all()):  # groups are disjoint stretches: this is end order within each
            g, s, e, chosen = g[::-1], -e[::-1], -s[::-1], tuple(c[::-1] for c in chosen)
            leads = (g.size - np.append(leads[1:], g.size))[::-1]  # the groups' stretches, mirrored
        else:  # by start, the groups keep their stretches, and their rows
            by_start = np.argsort(s, kind="stable")  # runs of sorted starts: faster stable
            g, s, e, chosen = g[by_start], s[by_start], e[by_start], tuple(c[by_start] for c in chosen)
    return (sorted_union_length(g, s, e, n_groups, leads),
            tuple(sorted_union_length(g[rows], s[rows], e[rows], n_groups)  # places: a scattered mask selects slowly
                  for rows in map(np.flatnonzero, chosen)), first)


def _int64(column: npt.NDArray[np.integer]) -> I64:
    return np.ascontiguousarray(column, dtype=np.int64)


def sorted_union_length(group: I64, start: I64, end: I64, n_groups: int, leads: I64 | None = None) -> I64:
    """`union_length` for intervals already shifted apart by group and sorted by start.

    An interval adds only what lies past the furthest end seen so far; since groups occupy disjoint
    stretches of the timeline, that running maximum never carries from one group into the next.
    """
    lengths = np.zeros(n_groups, dtype=np.int64)
    if group.size == 0:
        return lengths
    added = end.copy()
    added[0] -= start[0]
    added[1:] -= np.maximum(start[1:], np.maximum.accumulate(end)[:-1])
    np.maximum(added, 0, out=added)
    if leads is None:  # each group's first row, unless the caller knows them: the groups are in order
        leads = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    lengths[group[leads]] = np.add.reduceat(added, leads)
    return lengths
