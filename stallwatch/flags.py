"""Flag value types shared by the agent's and the offline command's parsers.

A bad value raises `argparse.ArgumentTypeError`, which argparse reports as a one-line error. Every
number is finite and bounded: NaN, infinities and absurd magnitudes are refused where they are typed,
not found later as a spinning thread or a traceback.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# No interval, timeout, window or retention of the agent means anything past a week; the bound also
# keeps every duration far inside int64 nanoseconds.
MAX_SECONDS = 7 * 86400.0
# No count (events queued or buffered, jobs, ranks) past a billion would fit the agent's memory anyway.
MAX_COUNT = 10**9
MAX_BYTES = 2**62  # byte sizes stay int64


def cut(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, so a message never carries a whole hostile value."""
    return text if len(text) <= limit else text[:limit] + "..."


def shown(value: object, limit: int = 40) -> str:
    """A value as a message may quote it: its repr, cut to `limit` characters."""
    return cut(repr(value), limit)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {shown(text)}")
    return value


def bounded_float(low: float, high: float, *, above: bool = False) -> Callable[[str], float]:
    """Flag type: a finite number in [low, high], or in (low, high] when `above` (argparse reports
    the message as a one-line error)."""
    interval = f"{'(' if above else '['}{low:g}, {high:g}]"

    def number(text: str) -> float:
        value = _finite(text)
        if value < low or (above and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"must be in {interval}, got {shown(text)}")
        return value

    return number


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """Flag type: an integer in [low, high]."""

    def integer(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            what = "a positive integer" if low == 1 else "an integer"
            raise argparse.ArgumentTypeError(f"must be {what} in [{low}, {high:_}], got {shown(text)}")
        return value

    return integer


positive_float = bounded_float(0, MAX_SECONDS, above=True)  # a duration in seconds
non_negative_float = bounded_float(0, MAX_SECONDS)  # a duration in seconds, 0 allowed
positive_int = bounded_int(1, MAX_COUNT)
ratio = bounded_float(0, 1)


def byte_size(text: str) -> int:
    """Flag type: a number of bytes (`1e12` allowed), at least 1 and at most 2**62."""
    value = _finite(text)
    if not 1 <= value <= MAX_BYTES:
        raise argparse.ArgumentTypeError(f"must be a number of bytes in [1, 2**62], got {shown(text)}")
    return int(value)
