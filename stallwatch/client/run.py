"""`stallwatch run [OPTIONS] -- COMMAND [ARGS]`: run a training command with the client in it, unchanged.

Every Python process the command starts (the script, torchrun's ranks, loader workers) has its
DataLoaders instrumented and its dataset reads captured (`bootstrap`), as `opentelemetry-instrument`
does for its spans: the command runs in this process's place (exec), with PYTHONPATH leading to
`startup/sitecustomize.py` and the settings below in its environment. A training image with only the
client installed runs it as `python -m stallwatch.client.run`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from stallwatch.client import bootstrap, capture, remote


def environment(env: Mapping[str, str], spoke_mounts: Sequence[str], capture_reads: bool,
                spoke_urls: Sequence[str] = ()) -> dict[str, str]:
    """`env` with what instruments the processes started in it."""
    changed = dict(env, **{bootstrap.INSTRUMENT_ENV: "1"})
    changed["PYTHONPATH"] = os.pathsep.join(filter(None, [bootstrap.STARTUP_FOLDER, env.get("PYTHONPATH")]))
    if spoke_mounts:
        changed[capture.SPOKE_MOUNTS_ENV] = os.pathsep.join(filter(None, [*spoke_mounts,
                                                                         env.get(capture.SPOKE_MOUNTS_ENV)]))
    if spoke_urls:
        changed[remote.SPOKE_URLS_ENV] = " ".join(filter(None, [*spoke_urls, env.get(remote.SPOKE_URLS_ENV)]))
    if not capture_reads:
        changed[capture.CAPTURE_ENV] = "0"
    return changed


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stallwatch run",
        description="Run a training command with its DataLoaders instrumented and its dataset reads captured.",
        epilog="example: stallwatch run --spoke-mount /mnt/juicefs -- torchrun --nproc-per-node 8 train.py")
    parser.add_argument("--spoke-mount", action="append", default=[], metavar="PATH",
                        help="a spoke's mount point: reads under it are spoke reads, others direct_read "
                             f"(repeatable; adds to ${capture.SPOKE_MOUNTS_ENV})")
    parser.add_argument("--spoke-url", action="append", default=[], metavar="URL",
                        help="a spoke's URL: HTTP and object-store reads under it are spoke reads, others "
                             f"direct_read unless the reply names its cache's verdict (repeatable; adds to "
                             f"${remote.SPOKE_URLS_ENV})")
    parser.add_argument("--no-capture-reads", dest="capture_reads", action="store_false",
                        help="instrument the loaders only; record no read the dataset does not record itself")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    return parser


def main(argv: Sequence[str]) -> int:
    options = parser().parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser().error("no command to run (stallwatch run [OPTIONS] -- COMMAND [ARGS])")
    env = environment(os.environ, options.spoke_mount, options.capture_reads, options.spoke_url)
    try:
        os.execvpe(command[0], command, env)
    except OSError as error:
        print(f"stallwatch run: error: {command[0]}: {error.strerror}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
