"""The `stallwatch` command: one entry point, a subcommand per job."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# Subcommand -> (module whose `main(argv) -> int` runs it, one line of help). Modules load on use, so
# `stallwatch agent` never imports matplotlib and `stallwatch report` never imports NVML.
COMMANDS: dict[str, tuple[str, str]] = {
    "agent": ("stallwatch.exporters.agent", "run the node agent that serves /metrics"),
    "check": ("stallwatch.check", "say whether a training job's events reach the agent, and under which names"),
    "correlate": ("stallwatch.correlator.replay", "run the correlator over a recorded event file"),
    "demo": ("stallwatch.demo.run", "run a hub, a spoke, a training job and the agent on this machine"),
    "generate": ("stallwatch.mixin.generate", "write the generated artifacts (docs, dashboards, rules)"),
    "publish": ("stallwatch.publish", "push the generated dashboards to Grafana and rules to Prometheus"),
    "report": ("stallwatch.report.command", "write an HTML warm-up report of a run"),
    "run": ("stallwatch.client.run", "run a training command with its loaders instrumented and its reads captured"),
}


# Top-level modules that come with an optional extra, and the extra that brings them.
EXTRAS: dict[str, str] = {"grafana_foundation_sdk": "generate", "matplotlib": "report"}


def usage() -> str:
    lines = ["usage: stallwatch COMMAND [ARGS]   (stallwatch COMMAND --help for its options)",
             "       stallwatch --version", "", "commands:"]
    lines += [f"  {name:10} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if args else 2
    if args[0] == "--version":
        from stallwatch.build import version_text
        print(version_text("stallwatch"))
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"stallwatch: error: unknown command {args[0]!r} (try: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:  # report imports matplotlib only when it draws, so the call is guarded as well as the import
        module = importlib.import_module(command[0])
        return int(module.main(args[1:]))
    except ModuleNotFoundError as error:
        extra = EXTRAS.get((error.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"stallwatch {args[0]}: error: needs the {extra!r} extra: install the agent's wheel with it, "
              f"pip install 'dist/stallwatch-VERSION-py3-none-any.whl[{extra}]' (make dist builds it)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
