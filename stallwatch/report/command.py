"""`stallwatch report`: one self-contained HTML page (PNG figures inline) about a run's warm-up.

It answers the question a platform team asks before moving a cluster away from its data: how long
until the cache made remote data as fast as local, what that cost in idle GPU time and cross-region
bytes, where the stalls came from, and what a bigger or smaller spoke would buy.

Sources: a Prometheus server (`--prometheus URL`, query_range over the run) or the correlator's
recorded windows (`--windows FILE`, JSON lines).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from stallwatch.report.prometheus import run_from_prometheus
from stallwatch.report.render import render_html
from stallwatch.report.windows import run_from_windows


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallwatch report", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prometheus", metavar="URL", help="read the run from this Prometheus")
    source.add_argument("--windows", type=Path, metavar="FILE", help="read the run from the correlator's "
                        "recorded windows (the agent's --correlator.record-windows FILE)")
    parser.add_argument("--start", type=float, help="run start, unix seconds (default: 15 minutes ago)")
    parser.add_argument("--end", type=float, help="run end, unix seconds (default: now)")
    parser.add_argument("--price-per-gb", type=float, default=0.02,
                        help="cross-region transfer price in $/GB (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("stallwatch-report.html"), help="(default: %(default)s)")
    options = parser.parse_args(argv)
    import matplotlib  # noqa: F401  # the figures need it: without the extra, fail before reading the run

    end = options.end or time.time()
    start = options.start or end - 900
    try:
        run = (run_from_windows(options.windows) if options.windows
               else run_from_prometheus(options.prometheus, start, end))
    except (OSError, RuntimeError, ValueError) as error:
        print(f"stallwatch report: error: {error}", file=sys.stderr)
        return 1
    options.out.write_text(render_html(run, options.price_per_gb))
    print(f"report: {options.out}")
    return 0
