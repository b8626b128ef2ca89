"""`stallwatch correlate FILE`: the agent's correlator pipeline over a recorded event file.

Writes one JSON line per published window (to stdout, or `--record-windows PATH`), as the agent's
window file would (through the same window hold, at the wall-clock times the file recorded), then a
per-rank summary of stall seconds by cause on stderr. The file is what `stallwatch agent
--correlator.record-events` writes (format in eventfile.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from collections.abc import Sequence

from stallwatch.catalogue import CAUSES
from stallwatch.correlator import settings
from stallwatch.correlator.eventfile import EventFileError, read_events, recorded_wall_offset
from stallwatch.correlator.hold import Publication, WindowHold
from stallwatch.correlator.pipeline import CorrelatorPipeline
from stallwatch.correlator.windowfile import WindowFileWriter


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallwatch correlate", description=__doc__.splitlines()[0])
    parser.add_argument("file", metavar="FILE", help="event file recorded by the agent")
    settings.add_arguments(parser.add_argument_group("correlator"), "")
    parser.add_argument("--no-spoke", dest="spoke", action="store_false",
                        help="the recording node had no spoke collector: reads with no verdict are direct_read")
    options = parser.parse_args(argv)
    totals: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0] * len(CAUSES))

    def summarise(publication: Publication) -> None:
        for row in publication.result.ranks:
            totals[(row.job, row.rank)] = [a + b for a, b in zip(totals[(row.job, row.rank)], row.stall_s,
                                                                 strict=True)]

    try:
        offset = recorded_wall_offset(options.file)
    except (OSError, EventFileError) as error:
        print(f"stallwatch correlate: error: {error}", file=sys.stderr)
        return 1
    if offset is None:
        print("stallwatch correlate: the file records no wall-clock offset (version 1): window times are the "
              "node's monotonic clock", file=sys.stderr)
    window_file = WindowFileWriter(options.correlator_record_windows or sys.stdout)
    chosen = dataclasses.replace(settings.from_options(options), spoke=options.spoke)
    hold = WindowHold(chosen.retention_s, [window_file.write, summarise], wall_offset=lambda: offset or 0)
    correlator = CorrelatorPipeline(chosen, listeners=[hold.add])
    try:
        correlator.run(read_events(options.file))
        hold.flush()
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
