"""What a demo leaves behind: the report of its run, and a word on where its files are and how big."""

from __future__ import annotations

from pathlib import Path

from stallwatch.prices import Prices
from stallwatch.report.prometheus import run_from_prometheus
from stallwatch.report.render import render_html
from stallwatch.report.windows import run_from_windows


def write_report(path: Path, started: float, ended: float, prices: Prices, prometheus: str | None,
                 windows: Path | None = None, dataset_bytes: float | None = None) -> Path:
    """The run's report from Prometheus, else from the agent's window file; the demo knows its dataset's size."""
    if prometheus is not None:
        run = run_from_prometheus(prometheus, started, ended)
    elif windows is not None:
        run = run_from_windows(windows)
    else:
        raise ValueError("a report needs Prometheus or a window file")
    path.write_text(render_html(run, prices, dataset_bytes=dataset_bytes))
    return path


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def files_left(work: Path) -> str:
    """Where the demo's files stay, how much they take, and how to remove them."""
    return (f"files left in {work}: {folder_bytes(work) / 1e6:,.0f} MB (the dataset, the spoke's cache, Prometheus's "
            f"data, the logs, the report); rm -r {work} removes them")
