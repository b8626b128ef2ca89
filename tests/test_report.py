"""`stallwatch report` without servers: its times, filters, flag errors, window-file source and header.

The report against real Prometheus servers (TLS and basic auth, a real run read from both sources) is
in test_report_live.py."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from stallwatch import catalogue as c
from stallwatch.correlator.hold import WindowHold
from stallwatch.correlator.windowfile import WindowFileWriter
from stallwatch.report.api import Access
from stallwatch.report.command import main
from stallwatch.report.prometheus import gpu_utilization_query, phase_spans
from stallwatch.report.render import render_html
from stallwatch.report.run import Run, Series
from stallwatch.report.scope import Scope
from stallwatch.report.times import glue_relative_times, parse_time
from stallwatch.report.windows import run_from_windows
from tests.scenarios.generator import JobSpec, Scenario
from tests.scenarios.run import correlate

NOW = datetime(2026, 12, 3, 9, 30, tzinfo=UTC).timestamp()
EIGHT = datetime(2026, 12, 3, 8, 0, tzinfo=UTC).timestamp()
MB = 1 << 20
WALL_OFFSET_NS = int(EIGHT * 1e9)  # the scenario's clock on the wall clock


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-12-03T08:00:00Z", EIGHT),
    ("2026-12-03T08:00:00", EIGHT),  # naive: UTC
    ("2026-12-03 08:00:00", EIGHT),
    ("2026-12-03T09:00:00+01:00", EIGHT),
    ("2026-12-03T03:00:00-05:00", EIGHT),
    ("2026-12-03T08:00:00.500Z", EIGHT + 0.5),
    (str(int(EIGHT)), EIGHT),
    (f"{EIGHT + 0.25}", EIGHT + 0.25),
    ("now", NOW),
    ("-15m", NOW - 900),
    ("-2h", NOW - 7200),
    ("-90s", NOW - 90),
    ("-1.5h", NOW - 5400),
    ("-1d", NOW - 86400),
])
def test_times_iso_unix_and_relative(text: str, expected: float) -> None:
    assert parse_time(text, NOW) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["yesterday", "", "-15", "15m", "-15y", "now-15m", "nan", "inf", "-5",
                                  "2026-13-03T08:00:00Z", "08:00"])
def test_anything_else_is_not_a_time(text: str) -> None:
    with pytest.raises(ValueError, match=r"is not a time: give ISO 8601 .*unix seconds, or -15m"):
        parse_time(text, NOW)


def test_a_relative_time_after_its_flag_is_that_flags_value() -> None:
    assert glue_relative_times(["--start", "-15m", "--end", "now", "--job", "-2h"]) == [
        "--start=-15m", "--end", "now", "--job", "-2h"]


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("stallwatch report: error: ")
    return err


@pytest.mark.parametrize(("argv", "said"), [
    (["--prometheus", "http://p", "--start", "yesterday"], "argument --start: 'yesterday' is not a time"),
    (["--prometheus", "http://p", "--end", "12/03/2026"], "argument --end: '12/03/2026' is not a time"),
    (["--prometheus", "http://p", "--start", "now", "--end", "-1h"], "is not before --end"),
    (["--prometheus", "http://p", "--basic-auth-user", "u"], "--basic-auth-user and --basic-auth-password-file go"),
    (["--prometheus", "http://p", "--basic-auth-password-file", "f"], "go together"),
    (["--prometheus", "http://p", "--basic-auth-user", "u", "--basic-auth-password-file", "f",
      "--bearer-token-file", "t"], "not both"),
    (["--prometheus", "https://p", "--ca-file", "ca", "--insecure-skip-tls-verify"], "not both"),
    (["--prometheus", "http://p", "--basic-auth-password", "pw"], "unrecognized arguments"),  # no password flag
    (["--windows", "w.jsonl", "--node", "n1"], "a window file is one node's record"),
    (["--windows", "w.jsonl", "--ca-file", "ca"], "for --prometheus"),
    (["--job", "j"], "one of the arguments --prometheus --windows is required"),
    (["--prometheus", "prometheus:9090"], "'prometheus:9090' is not a URL: give http://HOST:PORT"),
])
def test_bad_flags_are_one_line_and_exit_2(argv: list[str], said: str, capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    assert said in one_line_error([*argv, "--out", str(tmp_path / "r.html")], capsys)
    assert not (tmp_path / "r.html").exists()


def test_filters_become_label_matchers_of_the_metrics_that_have_them() -> None:
    scope = Scope(job="llama", node='gpu-"7"')
    assert scope.select(c.STALL_SECONDS) == f'{c.STALL_SECONDS.name}{{training_job="llama", node="gpu-\\"7\\""}}'
    assert scope.select(c.SPOKE_BYTES) == f'{c.SPOKE_BYTES.name}{{node="gpu-\\"7\\""}}'  # the node's spoke
    assert scope.select(c.STEP_COMPUTE, "_count").startswith(f'{c.STEP_COMPUTE.name}_count{{training_job="llama"')
    assert Scope().select(c.GPU_UTILIZATION) == c.GPU_UTILIZATION.name
    # A job's GPUs are those the correlator saw its ranks on, at any time of the run.
    query = gpu_utilization_query(Scope(job="llama"), 15, 600)
    assert f'{c.GPU_STALL_IDLE_SECONDS.name}{{training_job="llama"}}[615s] @ end()' in query
    assert query.startswith(f"avg(avg_over_time({c.GPU_UTILIZATION.name}[15s]) and on (instance, gpu) group by")
    assert "and on" not in gpu_utilization_query(Scope(node="n1"), 15, 600)


def test_credentials_come_from_files(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "token").write_text("tok-123\n")
    basic = Access("report", tmp_path / "pw").headers()
    assert basic == {"Authorization": "Basic cmVwb3J0OnMzY3JldA=="}  # report:s3cret
    assert Access(bearer_token_file=tmp_path / "token").headers() == {"Authorization": "Bearer tok-123"}
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RuntimeError, match=r"password file .* is empty"):
        Access("report", tmp_path / "empty").headers()
    with pytest.raises(RuntimeError, match=r"cannot read the bearer token file .*: No such file"):
        Access(bearer_token_file=tmp_path / "missing").headers()


def test_phases_from_prometheus_span_the_windows_their_stamps_close() -> None:
    """Windows [100, 105), [105, 110)... published with their ends as timestamps: a step sees the latest
    stamp at or before it. Cold for two windows, then steady: the spans are the windows' own."""
    grid = np.arange(100.0, 131.0)
    stamps = np.where(grid >= 105, np.floor(grid / 5) * 5, np.nan)
    stamps = stamps[~np.isnan(stamps)]
    steps = grid[grid >= 105]
    cold = np.where(steps < 115, 1.0, 0.0)
    gauges = [({"phase": "cold"}, Series(steps, cold)), ({"phase": "steady"}, Series(steps, 1 - cold))]
    assert phase_spans(gauges, Series(steps, stamps)) == [(100, 110, "cold"), (110, 130, "steady")]
    assert phase_spans([], Series.empty()) == []


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real correlator's window file of two jobs on one node: job 0 one rank, job 1 two ranks."""
    scenario = Scenario([JobSpec(0, steps=300, first_gpu=0), JobSpec(1, steps=300, ranks=2, first_gpu=1)],
                        cache_bytes=2000 * MB, seed=3)
    path = tmp_path_factory.mktemp("windows") / "windows.jsonl"
    writer = WindowFileWriter(path)
    hold = WindowHold(5.0, [writer.write], wall_offset=lambda: WALL_OFFSET_NS)  # as the agent publishes them
    for window in correlate(scenario).windows:
        hold.add(window)
    hold.flush()
    writer.close()
    return path


def total_steps(run: Run) -> float:
    """Steps in the run: each window's rate times its length."""
    series = run.steps_per_second
    return float(np.nansum(series.v * (series.end - series.t)))


def test_a_job_filter_keeps_that_jobs_rows(two_jobs: Path) -> None:
    everything, first, second = (run_from_windows(two_jobs, job) for job in (None, "0", "1"))
    assert total_steps(everything) == 900
    assert (total_steps(first), total_steps(second)) == (300, 600)
    assert (first.job, second.job) == ("0", "1")
    assert first.phases and first.phases[0][2] == "cold"
    assert 0 < first.stall_seconds["remote_fetch"] < everything.stall_seconds["remote_fetch"]
    with pytest.raises(ValueError, match=r"no windows of job 'llama' \(jobs: 0, 1\)"):
        run_from_windows(two_jobs, "llama")


def test_over_several_jobs_the_phases_are_left_to_each_job(two_jobs: Path) -> None:
    """Job 1's phases after job 0's would read as one run's: without --job the report names the jobs instead."""
    everything, first = run_from_windows(two_jobs), run_from_windows(two_jobs, "0")
    assert everything.phases == [] and everything.several_jobs == ("0", "1")
    assert everything.time_to_steady_seconds is None
    assert first.phases and first.several_jobs == ()
    assert "Phases as recognised: one per job (0, 1): pass --job to see one" in render_html(everything)


def test_start_and_end_keep_the_windows_that_overlap_them(two_jobs: Path) -> None:
    whole = run_from_windows(two_jobs)
    middle = (whole.start + whole.end) / 2
    later = run_from_windows(two_jobs, start=middle)
    assert later.start <= middle < later.start + 10 and later.end == whole.end
    earlier = run_from_windows(two_jobs, end=middle)
    assert earlier.start == whole.start and middle <= earlier.end < middle + 10
    with pytest.raises(ValueError, match="no window between --start and --end"):
        run_from_windows(two_jobs, start=whole.end + 1)


def test_the_header_prints_wall_clock_times_and_phase_spans() -> None:
    run = Run(EIGHT, EIGHT + 900, job="llama", node="gpu-7")
    run.phases = [(EIGHT + 3, EIGHT + 20, "cold"), (EIGHT + 20, EIGHT + 900, "steady")]
    page = render_html(run)
    assert "Run from 2026-12-03 08:00:00 to 08:15:00 UTC (900 s), job llama, node gpu-7." in page
    assert "Phases as recognised: cold 08:00:03&ndash;08:00:20, steady 08:00:20&ndash;08:15:00" in page
    overnight = render_html(Run(EIGHT - 9 * 3600, EIGHT))
    assert "Run from 2026-12-02 23:00:00 to 2026-12-03 08:00:00 UTC (32,400 s)." in overnight


def test_the_lines_of_one_window_are_merged_whatever_their_order(two_jobs: Path, tmp_path: Path) -> None:
    """A job held back for a stall goes out on a line of its own, later: here every window's job 1 comes
    after all of job 0, its what-if on that late line."""
    rows = [json.loads(line) for line in two_jobs.read_text().splitlines()]

    def part(row: dict[str, object], job: str, whatif: bool) -> str:
        return json.dumps({**row, "ranks": [r for r in row["ranks"] if r["job"] == job],  # type: ignore[attr-defined]
                           "jobs": [j for j in row["jobs"] if j["job"] == job],  # type: ignore[attr-defined]
                           "gpus": [g for g in row["gpus"] if g["job"] == job],  # type: ignore[attr-defined]
                           "whatif_hit_ratio": row["whatif_hit_ratio"] if whatif else {}})

    split = tmp_path / "split.jsonl"
    split.write_text("\n".join([part(row, "0", False) for row in rows] + [part(row, "1", True) for row in rows]))
    for job in (None, "0", "1"):
        whole, parts = run_from_windows(two_jobs, job), run_from_windows(split, job)
        assert parts.phases == whole.phases and parts.whatif == whole.whatif
        assert (parts.start, parts.end) == (whole.start, whole.end)
        assert total_steps(parts) == total_steps(whole)
        assert parts.stall_seconds == whole.stall_seconds
        assert parts.gpu_stall_idle_seconds == whole.gpu_stall_idle_seconds


@pytest.mark.parametrize(("source", "said"), [
    ("windows", "Failed reads: not in this window file"),
    ("prometheus", f"Failed reads: not known: Prometheus holds no {c.DATASET_FAILED_READS.name} of the run"),
])
def test_failed_reads_not_counted_are_said_not_known_in_the_sources_own_words(source: str, said: str) -> None:
    html = render_html(Run(1.7e9, 1.7e9 + 60, source))
    assert said in html
    assert "none: every read got its bytes" in render_html(Run(1.7e9, 1.7e9 + 60, source, failed_reads=0.0))
