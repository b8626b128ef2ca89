"""`stallwatch correlate FILE`: the agent's correlator pipeline over a recorded event file.

Writes one JSON line per closed window (to stdout, or `--record-windows PATH`), then a per-rank
summary of stall seconds by cause on stderr. The file is what `stallwatch agent --correlator.record-events`
writes (format in eventfile.py).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence

from stallwatch.catalogue import CAUSES
from stallwatch.correlator import settings
from stallwatch.correlator.eventfile import EventFileError, read_events
from stallwatch.correlator.pipeline import CorrelatorPipeline
from stallwatch.correlator.results import WindowResult
from stallwatch.correlator.windowfile import WindowFileWriter


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallwatch correlate", description=__doc__.splitlines()[0])
    parser.add_argument("file", metavar="FILE", help="event file recorded by the agent")
    settings.add_arguments(parser.add_argument_group("correlator"), "")
    options = parser.parse_args(argv)
    window_file = WindowFileWriter(options.correlator_record_windows or sys.stdout)
    totals: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0] * len(CAUSES))

    def summarise(result: WindowResult) -> None:
        for row in result.ranks:
            totals[(row.job, row.rank)] = [a + b for a, b in zip(totals[(row.job, row.rank)], row.stall_s,
                                                                 strict=True)]

    correlator = CorrelatorPipeline(settings.from_options(options), listeners=[window_file.write, summarise])
    try:
        correlator.run(read_events(options.file))
    except (OSError, EventFileError) as error:
        print(f"stallwatch correlate: error: {error}", file=sys.stderr)
        return 1
    finally:
        window_file.close()
    for (job, rank), seconds in sorted(totals.items()):
        split = ", ".join(f"{cause} {value:.3f}" for cause, value in zip(CAUSES, seconds, strict=True))
        print(f"job {job} rank {rank}: stall s: {split}", file=sys.stderr)
    late, shed = dict(correlator.windows.late), dict(correlator.windows.shed)
    if late or correlator.malformed or shed:
        print(f"late events: {late}; malformed: {dict(correlator.malformed)}; shed at the buffer cap: {shed}",
              file=sys.stderr)
    return 0
