"""The report's `--start/--end`: ISO 8601, unix seconds, or relative to now (`-15m`, `-2h`, `now`)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from datetime import UTC, datetime

from stallwatch.mixin.config import UNIT_SECONDS

RELATIVE = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
TIME_FLAGS = ("--start", "--end")
FORMS = "ISO 8601 (2026-12-03T08:00:00Z; no offset means UTC), unix seconds, or -15m, -2h, -1d, now"


def parse_time(text: str, now: float) -> float:
    """Unix seconds of `text`; ValueError naming the accepted forms otherwise."""
    text = text.strip()
    if text == "now":
        return now
    relative = RELATIVE.match(text)
    if relative:
        return now - float(relative[1]) * UNIT_SECONDS[relative[2]]
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds) and seconds >= 0:
            return seconds
        raise ValueError(f"{text!r} is not a time: give {FORMS}")
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a time: give {FORMS}") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def glue_relative_times(argv: Sequence[str]) -> list[str]:
    """`--start -15m` as `--start=-15m`: argparse would take `-15m` for an unknown option."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in TIME_FLAGS and RELATIVE.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out
