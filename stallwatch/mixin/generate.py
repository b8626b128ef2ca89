"""`stallwatch generate`: every generated artifact, from one table.

Each entry maps a path under the project root to the function that renders it. `make generate`
writes them all; `--check` (and a test) fails when a committed copy differs from a fresh render.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from stallwatch.mixin import alerts, dashboards, metrics_doc, rules, runbooks

ARTIFACTS: dict[str, Callable[[], str]] = {
    "docs/metrics.md": metrics_doc.render_metrics_reference,
    "alerts/recording-rules.yaml": rules.render_recording_rules,
    "alerts/alerting-rules.yaml": alerts.render_alerting_rules,
    "docs/runbooks.md": runbooks.render_runbooks,
    **dashboards.ARTIFACTS,
    "docs/dashboards.md": dashboards.render_docs,
}

# The Helm chart ships its own copy of every dashboard and rule file (templates read them with
# `.Files.Glob`): derived from the table, so a new dashboard or rule file reaches the chart by itself.
CHART_COPIES = {"dashboards/": "helm/stallwatch/files/dashboards/", "alerts/": "helm/stallwatch/files/rules/"}


def chart_copies(artifacts: Mapping[str, Callable[[], str]]) -> dict[str, Callable[[], str]]:
    return {
        chart + relative.removeprefix(source): render
        for relative, render in artifacts.items()
        for source, chart in CHART_COPIES.items()
        if relative.startswith(source)
    }


ARTIFACTS |= chart_copies(ARTIFACTS)


def stale(root: Path) -> list[str]:
    """Paths whose committed copy differs from a fresh render."""
    out = []
    for relative, render in ARTIFACTS.items():
        path = root / relative
        if not path.exists() or path.read_text() != render():
            out.append(relative)
    return out


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallwatch generate", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="project root (default: current directory)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any artifact is stale")
    options = parser.parse_args(argv)
    if options.check:
        outdated = stale(options.root)
        for relative in outdated:
            print(f"stale: {relative} (run: make generate)", file=sys.stderr)
        return 1 if outdated else 0
    for relative, render in ARTIFACTS.items():
        path = options.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render())
        print(f"wrote {relative}")
    return 0
