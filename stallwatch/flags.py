"""Flag value types shared by the agent's and the offline command's parsers.

A bad value raises `argparse.ArgumentTypeError`, which argparse reports as a one-line error.
"""

from __future__ import annotations

import argparse


def positive_float(text: str) -> float:
    """A number > 0."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
