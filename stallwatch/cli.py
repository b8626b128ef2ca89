"""The `stallwatch` command: one entry point, a subcommand per job."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

USAGE = """usage: stallwatch COMMAND [ARGS]

commands:
  agent      run the node agent that serves /metrics (stallwatch agent --help)
  correlate  run the correlator over a recorded event file (stallwatch correlate --help)
  generate   write the generated artifacts: docs/metrics.md (stallwatch generate --help)
"""


def _agent(argv: Sequence[str]) -> int:
    from stallwatch.exporters.agent import main

    return main(argv)


def _correlate(argv: Sequence[str]) -> int:
    from stallwatch.correlator.offline import main

    return main(argv)


def _generate(argv: Sequence[str]) -> int:
    from stallwatch.generate import main

    return main(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "agent": _agent, "correlate": _correlate, "generate": _generate,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"stallwatch: error: unknown command {args[0]!r} (try: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
