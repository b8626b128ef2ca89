"""The one mapping from the events' clock (CLOCK_MONOTONIC ns, shared by every process on the node) to unix time.

The correlator uses it to publish, the spoke collectors to move a log's wall times onto the events' clock, the
events collector to compare a client's clocks with ours; each may pass its own clocks (tests drive them).

Published samples and recorded windows carry wall-clock times so that they line up with NVML and spoke series
scraped live. The offset is read when a result is published, so a stepped wall clock moves the next results
with it; a replayed event file uses the offset recorded when the file was written (eventfile.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wall_offset_ns(tries: int = 3, wall_ns: Callable[[], int] = time.time_ns,
                   monotonic_ns: Callable[[], int] = time.monotonic_ns) -> int:
    """Now, CLOCK_REALTIME minus CLOCK_MONOTONIC: what turns an event's time into unix ns. The wall clock is read
    between two monotonic reads, a few times, and the tightest bracket wins: on a busy node the thread can be
    preempted between two clock reads, which would put every published sample tens of ms off."""
    best_gap, offset = None, 0
    for _ in range(tries):
        before = monotonic_ns()
        wall = wall_ns()
        after = monotonic_ns()
        if best_gap is None or after - before < best_gap:
            best_gap, offset = after - before, wall - (before + after) // 2
    return offset


def unix_seconds(monotonic_ns: int, offset_ns: int) -> float:
    """An event time (monotonic ns) as unix seconds, given the offset read with `wall_offset_ns`."""
    return (monotonic_ns + offset_ns) / 1e9
