"""The one mapping from the events' clock (CLOCK_MONOTONIC ns, shared by every process on the node) to unix time.

Published samples and recorded windows carry wall-clock times so that they line up with NVML and spoke series
scraped live. The offset is read when a result is published, so a stepped wall clock moves the next results
with it; a replayed event file uses the offset recorded when the file was written (eventfile.py).
"""

from __future__ import annotations

import time


def wall_offset_ns() -> int:
    """Now, CLOCK_REALTIME minus CLOCK_MONOTONIC: what turns an event's time into unix ns."""
    return time.time_ns() - time.monotonic_ns()


def unix_seconds(monotonic_ns: int, offset_ns: int) -> float:
    """An event time (monotonic ns) as unix seconds, given the offset read with `wall_offset_ns`."""
    return (monotonic_ns + offset_ns) / 1e9
