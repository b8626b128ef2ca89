"""`stallwatch report`: one self-contained HTML page (PNG figures inline) about a run's warm-up.

It answers the question a platform team asks before moving a cluster away from its data: how long
until the cache made remote data as fast as local, what that cost in idle GPU time and cross-region
bytes, whether copying the dataset next to the GPUs first would have cost less, where the stalls came
from, and what a bigger or smaller spoke would buy.

Sources: a Prometheus server (`--prometheus URL`, query_range over the run) or the correlator's
recorded windows (`--windows FILE`, JSON lines).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from stallwatch import prices
from stallwatch.flags import MAX_BYTES, bounded_float, ratio
from stallwatch.report.api import Access
from stallwatch.report.prometheus import run_from_prometheus
from stallwatch.report.render import INPUT_BOUND_TARGET, render_html
from stallwatch.report.scope import NODE_LABEL, Scope
from stallwatch.report.times import FORMS, glue_relative_times, parse_time
from stallwatch.report.windows import run_from_windows

DESCRIPTION = ("Write one self-contained HTML page (PNG figures inline) about a run's warm-up, read from a "
               "Prometheus or from the correlator's recorded windows. Times are printed in UTC.")
EPILOG = f"""times: {FORMS}.
examples:
  stallwatch report --prometheus https://prom:9090 --job llama --start -2h --ca-file ca.crt \\
      --basic-auth-user report --basic-auth-password-file ~/.prom-pass
  stallwatch report --windows windows.jsonl --job llama
"""


def _time_flag(now: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            return parse_time(text, now)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # the message alone: the usage block buries it
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _prometheus_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL: give http://HOST:PORT or https://HOST:PORT")
    return text


def build_parser(now: float) -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="stallwatch report", description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prometheus", type=_prometheus_url, metavar="URL",
                        help="read the run from this Prometheus (http or https)")
    source.add_argument("--windows", type=Path, metavar="FILE", help="read the run from the correlator's "
                        "recorded windows (the agent's --correlator.record-windows FILE)")
    scope = parser.add_argument_group("what the report covers")
    scope.add_argument("--job", metavar="NAME", help="only this training job (the training_job label)")
    scope.add_argument("--node", metavar="NAME", help=f"only this node (the {NODE_LABEL!r} label the scrape adds; "
                       "--prometheus only: a window file is one node's)")
    scope.add_argument("--dataset-size", type=bounded_float(0, MAX_BYTES, above=True), metavar="BYTES",
                       help="the size of the job's dataset, for weighing a copy of it next to the GPUs against "
                       "streaming it (default: the bytes the job read from the hub until its cache was warm)")
    time_type = _time_flag(now)
    scope.add_argument("--start", type=time_type, metavar="TIME",
                       help="run start (default: 15 minutes before --end; with --windows, the file's first window)")
    scope.add_argument("--end", type=time_type, metavar="TIME",
                       help="run end (default: now; with --windows, the file's last window)")
    access = parser.add_argument_group("reaching a Prometheus behind authentication or TLS")
    access.add_argument("--basic-auth-user", metavar="USER", help="basic auth user name")
    access.add_argument("--basic-auth-password-file", type=Path, metavar="FILE",
                        help="file holding the basic auth password (never on the command line)")
    access.add_argument("--bearer-token-file", type=Path, metavar="FILE", help="file holding a bearer token")
    access.add_argument("--ca-file", type=Path, metavar="FILE", help="CA certificate(s) to trust for https")
    access.add_argument("--insecure-skip-tls-verify", action="store_true",
                        help="accept any certificate (a test server's self-signed one)")
    prices.add_arguments(parser.add_argument_group("what idle GPUs and hub bytes cost"))
    output = parser.add_argument_group("output")
    output.add_argument("--input-bound-target", type=ratio, default=INPUT_BOUND_TARGET, metavar="RATIO",
                        help="the input-bound share the smallest sufficient spoke keeps the job under (default: "
                        "%(default)s, the input-bound alert's)")
    output.add_argument("--out", type=Path, default=Path("stallwatch-report.html"), metavar="FILE",
                        help="the HTML page to write (default: %(default)s)")
    return parser


def main(argv: Sequence[str]) -> int:
    now = time.time()
    parser = build_parser(now)
    options = parser.parse_args(glue_relative_times(argv))
    access = Access(options.basic_auth_user, options.basic_auth_password_file, options.bearer_token_file,
                    options.ca_file, options.insecure_skip_tls_verify)
    if options.windows and options.node is not None:
        parser.error("--node: a window file is one node's record and does not name its node; "
                     "choose that node's file, or read several nodes with --prometheus")
    if options.windows and (access.has_credentials or options.ca_file or options.insecure_skip_tls_verify):
        parser.error("credentials and TLS flags are for --prometheus")
    if (problem := access.problem()) is not None:
        parser.error(problem)
    end = now if options.end is None else options.end
    start = end - 900 if options.start is None else options.start
    if start >= end:
        parser.error(f"--start ({_iso(start)}) is not before --end ({_iso(end)})")
    import matplotlib  # noqa: F401  # the figures need it: without the extra, fail before reading the run

    try:
        run = (run_from_windows(options.windows, options.job, options.start, options.end) if options.windows
               else run_from_prometheus(options.prometheus, start, end, Scope(options.job, options.node), access))
    except (OSError, RuntimeError, ValueError) as error:
        print(f"stallwatch report: error: {error}", file=sys.stderr)
        return 1
    options.out.write_text(render_html(run, prices.from_options(options), options.input_bound_target,
                                       options.dataset_size))
    print(f"report: {options.out}")
    return 0
