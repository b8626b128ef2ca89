"""`stallwatch report --windows` on files it must refuse or read in bounded memory: one line and exit 1 for
what the agent does not write, memory that grows with the windows and not with the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.scenarios.generator import JobSpec, Scenario
from tests.test_report_windows import MB, record

pytestmark = pytest.mark.slow


def report(windows: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stallwatch", "report", "--windows", str(windows), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


def peak_rss_mib(code: str) -> float:
    """The largest resident size of a child Python running `code`, in MiB."""
    measure = ("import resource, subprocess, sys\n"
               f"subprocess.run([sys.executable, '-c', {code!r}], check=True)\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", measure], capture_output=True, text=True, check=True, timeout=300)
    return int(done.stdout.split()[-1]) / 1024


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """A real window file's rows: a cold-then-warm job on a node with GPUs."""
    path = record(Scenario([JobSpec(0, steps=300)], cache_bytes=800 * MB, seed=3),
                  tmp_path_factory.mktemp("real") / "windows.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def busiest(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda row: len(row["ranks"]) + len(row["jobs"]))


def test_a_job_with_steps_and_no_reads_is_reported(tmp_path: Path, real: list[dict[str, Any]]) -> None:
    """As the agent writes it for a job that reads nothing it can see: `hit_ratio` null, no reads."""
    for row in real:
        for job in row["jobs"]:
            job.update(hit_ratio=None, reads=0, hub_bytes=0)
    windows = tmp_path / "windows.jsonl"
    windows.write_text("".join(json.dumps(row) + "\n" for row in real))
    done = report(windows, tmp_path / "report.html")
    assert done.returncode == 0, done.stderr
    assert "no read crossed a spoke" in (tmp_path / "report.html").read_text()


def _hostile(real: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], str]]:
    row = busiest(real)

    def changed(path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
        copy = json.loads(json.dumps(row))
        target = copy
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return copy

    return {
        "text steps": (changed(("ranks", 0, "steps"), "many"), "steps is \"many\""),
        "nan start": (changed(("start_s",), float("nan")), "start_s is NaN"),
        "end before start": (changed(("end_s",), row["start_s"] - 1), "is not after start_s"),
        "ranks an object": (changed(("ranks",), {"job": "x"}), "ranks is not a list of rows"),
        "2^62 steps": (changed(("ranks", 0, "steps"), 2**62), "steps is 4611686018427387904"),
        "negative compute": (changed(("ranks", 0, "compute_s"), -5), "compute_s is -5"),
        "stall a list": (changed(("ranks", 0, "stall_s"), [1, 2]), "stall_s is not an object"),
        "hit ratio 1.5": (changed(("jobs", 0, "hit_ratio"), 1.5), "hit_ratio is 1.5"),
        "unknown phase": (changed(("jobs", 0, "phase"), "lukewarm"), "phase is \"lukewarm\""),
        "job a number": (changed(("jobs", 0, "job"), 7), "has no job name"),
        "what-if a list": (changed(("whatif_hit_ratio",), [0.5]), "whatif_hit_ratio is not an object"),
    }


@pytest.mark.parametrize("case", ["text steps", "nan start", "end before start", "ranks an object", "2^62 steps",
                                  "negative compute", "stall a list", "hit ratio 1.5", "unknown phase",
                                  "job a number", "what-if a list"])
def test_a_row_the_agent_does_not_write_is_one_line_naming_it(tmp_path: Path, real: list[dict[str, Any]],
                                                              case: str) -> None:
    bad, said = _hostile(real)[case]
    windows = tmp_path / "windows.jsonl"
    windows.write_text("".join(json.dumps(row) + "\n" for row in real[:3]) + json.dumps(bad) + "\n")
    done = report(windows, tmp_path / "report.html")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"stallwatch report: error: {windows}:4: not a window row (") and said in line, line


def test_a_large_window_file_is_read_in_memory_bounded_by_its_windows(tmp_path: Path,
                                                                     real: list[dict[str, Any]]) -> None:
    """60 MB of windows (the busiest real one, shifted along): read a line at a time, each folded into its
    window's sums, so less memory than the file's size (~0.5 KiB a window here: 42 MiB for 83,823); before,
    the whole file and every row were held at once: 548 MiB above the interpreter's own, 5.8 s."""
    row = busiest(real)
    span = row["end_s"] - row["start_s"]
    windows = tmp_path / "windows.jsonl"
    with windows.open("w") as file:
        written, n = 0, 0
        while written < 60 * MB:
            line = json.dumps({**row, "start_s": row["start_s"] + n * span, "end_s": row["end_s"] + n * span}) + "\n"
            written += file.write(line)
            n += 1
    baseline = peak_rss_mib("import numpy, stallwatch.report.windows")
    peak = peak_rss_mib(f"from pathlib import Path; from stallwatch.report.windows import run_from_windows\n"
                        f"run = run_from_windows(Path({str(windows)!r}))\nassert run.steps_per_second.t.size == {n}")
    assert peak - baseline < 60, f"{peak:.0f} MiB at its peak for {n:,} windows ({baseline:.0f} MiB to start)"


def test_a_line_of_hundreds_of_megabytes_is_refused_before_it_is_held(tmp_path: Path) -> None:
    windows = tmp_path / "windows.jsonl"
    with windows.open("w") as file:
        file.write('{"start_s": 1, "end_s": 2, "ranks": [], "gpus": [], "jobs": [], "whatif_hit_ratio": {}, "x": "')
        for _ in range(200):
            file.write("a" * MB)
        file.write('"}\n')
    baseline = peak_rss_mib("import numpy, stallwatch.report.windows")
    code = (f"from pathlib import Path; from stallwatch.report.windows import WindowFileError, run_from_windows\n"
            f"try:\n    run_from_windows(Path({str(windows)!r}))\nexcept WindowFileError as error:\n"
            f"    assert 'longer than 4 MiB' in str(error), error\nelse:\n    raise AssertionError('read')")
    assert peak_rss_mib(code) - baseline < 40
