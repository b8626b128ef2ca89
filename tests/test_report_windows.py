"""The report's window mode on a real correlator's window files: each figure the quantity the correlator
published, over the windows' own spans; what a run cannot know (no GPU, no spoke) said, not drawn."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stallwatch import catalogue as c
from stallwatch.correlator.hold import WindowHold
from stallwatch.correlator.pipeline import CorrelatorPipeline
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.correlator.windowfile import WindowFileWriter
from stallwatch.report.render import _steps, render_html
from stallwatch.report.run import Run
from stallwatch.report.windows import run_from_windows
from tests.scenarios.generator import BASE_NS, JobSpec, Scenario, generate

MB = 1 << 20


def record(scenario: Scenario, path: Path, *, gpus: bool = True, **settings: object) -> Path:
    """The window file an agent would write for the scenario (wall clock = the scenario's clock); without
    `gpus`, the node has none: no NVML samples."""
    generated = generate(scenario)
    writer = WindowFileWriter(path)
    hold = WindowHold(5.0, [writer.write], wall_offset=lambda: 0)
    pipeline = CorrelatorPipeline(CorrelatorSettings(**{"cache_capacity_bytes": scenario.cache_bytes,  # type: ignore[arg-type]
                                                        **settings}), listeners=[hold.add])
    pipeline.run([batch for batch in generated.batches if gpus or batch.kind != "gpu_util"])
    hold.flush()
    writer.close()
    return path


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def shown(page: str, key: str) -> str:
    found = re.search(rf'id="{key}">([^<]*)<', page)
    assert found is not None, key
    return found.group(1)


def figures(page: str) -> list[str]:
    return re.findall(r'<img alt="([^"]+)"', page)


def test_a_gpu_less_spoke_less_run_says_what_it_cannot_know(tmp_path: Path) -> None:
    """Local reads (no spoke: every read direct) on a node without GPUs: no GPU utilization, hit ratio or hub
    throughput drawn, each said instead; the headline is the job's input-bound share and its stalls by cause."""
    scenario = Scenario([JobSpec(0, steps=400, verdicts="latency", preprocess_s=0.08)], cache_bytes=2000 * MB, seed=5)
    path = record(scenario, tmp_path / "windows.jsonl", gpus=False, spoke=False)
    run = run_from_windows(path)
    page = render_html(run)
    assert figures(page) == ["Step throughput", "Stall seconds by cause"]
    assert page.count("no read crossed a spoke in this run: no hit ratio, no hub bytes") == 2
    assert "GPU utilization" in page and "not known: the source does not say whether the node has GPUs" in page
    assert "no estimate: no read crossed a spoke" in shown(page, "whatif-none")
    # The headline: stall over stall plus compute, from the ranks' rows; every stalled second direct or CPU.
    ranks = [r for row in rows(path) for r in row["ranks"]]
    stall = sum(sum(r["stall_s"].values()) for r in ranks)
    compute = sum(r["compute_s"] for r in ranks)
    assert shown(page, "input-bound") == f"{stall / (stall + compute) * 100:.1f} %"
    assert run.stall_seconds["remote_fetch"] == run.stall_seconds["cache_read"] == 0
    assert run.stall_seconds["direct_read"] > 0 and run.stall_seconds["preprocess"] > 0
    # With the node's GPU count in the file (0), the report says there are none.
    path.write_text("".join(json.dumps({**row, "gpu_devices": 0}) + "\n" for row in rows(path)))
    assert f"no GPU on this node ({c.GPU_DEVICES.name} 0)" in render_html(run_from_windows(path))


@pytest.fixture(scope="module")
def cold_start(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Scenario]:
    """Two ranks reading through a cold spoke; after steady, the spoke loses its cache as the hub goes away for 20 s."""
    scenario = Scenario([JobSpec(0, steps=900, ranks=2)], cache_bytes=2000 * MB, outages=[(30.0, 50.0)],
                        evictions=[30.0], seed=7)
    return record(scenario, tmp_path_factory.mktemp("cold") / "windows.jsonl"), scenario


def test_stall_rates_are_per_rank_and_add_up_to_the_headline(cold_start: tuple[Path, Scenario]) -> None:
    run = run_from_windows(cold_start[0])
    assert run.ranks == 2
    stacked = np.sum([series.v for series in run.stall_by_cause.values()], axis=0)
    assert np.nanmax(stacked) <= 1.0 + 1e-9  # both ranks wait through the outage: one stall-second a second each
    assert np.nanmax(stacked) > 0.9
    for cause, series in run.stall_by_cause.items():
        drawn = float(np.nansum(series.v * (series.end - series.t))) * run.ranks
        assert drawn == pytest.approx(run.stall_seconds[cause], abs=1e-6)
    page = render_html(run)
    assert "averaged over the 2 ranks" in page and "stall seconds (summed over 2 ranks)" in page


def test_the_time_to_steady_is_the_correlators_and_marked_where_it_points(cold_start: tuple[Path, Scenario]) -> None:
    path, scenario = cold_start
    run = run_from_windows(path)
    published = [j["time_to_steady_s"] for row in rows(path) for j in row["jobs"]
                 if j["time_to_steady_s"] is not None]
    assert run.time_to_steady_seconds == published[0]
    # It counts from the job's first event, which lies in its first window.
    first_event = generate(scenario).truth.first_event_s[0] + BASE_NS / 1e9
    assert run.job_started is not None and run.steady_at is not None
    assert run.job_started <= first_event < run.job_started + 0.5
    recognised = next(start for start, _, phase in run.phases if phase == "steady")
    assert run.steady_at <= recognised  # proven warm from there, recognised once enough windows said so
    page = render_html(run)
    assert shown(page, "time-to-steady") == f"{run.time_to_steady_seconds:,.1f} s"
    assert "Phases as recognised:" in page
    steady_said = shown(page, "steady")
    assert "the dashed line" in steady_said and "steady recognised at" in steady_said


def test_the_warmup_idle_is_the_gpu_idle_in_stalls_until_steady(cold_start: tuple[Path, Scenario]) -> None:
    """The warm-up's idle GPU-seconds are the GPU idle of the stalls booked until the window that recognised
    steady: part of the run's GPU idle in stalls by cause (here most of it is the later outage's)."""
    path, _ = cold_start
    run = run_from_windows(path)
    lines = rows(path)
    recognised = next(i for i, row in enumerate(lines) for j in row["jobs"]
                      if j["time_to_steady_s"] is not None)
    until_steady = sum(sum(g["idle_s"].values()) for row in lines[:recognised + 1]
                       for g in row["gpus"])
    assert run.warmup_idle_gpu_seconds == pytest.approx(until_steady, abs=0.05)
    run_idle = sum(run.gpu_stall_idle_seconds.values())
    assert run.warmup_idle_gpu_seconds is not None and run.warmup_idle_gpu_seconds < run_idle
    assert run.gpu_stall_idle_seconds["remote_fetch"] > 30  # two GPUs idle through the 20 s outage
    page = render_html(run)
    assert "GPU idle in stalls until steady was recognised" in page and c.GPU_STALL_IDLE_SECONDS.name in page


def drawn_over(series_list: Sequence[tuple[np.ndarray, np.ndarray]], start: float, end: float) -> bool:
    """Whether any drawn line has a value between start and end."""
    return any(np.any(~np.isnan(y) & (x > start) & (x < end)) for x, y in series_list)


def test_nothing_is_drawn_across_the_idle_gap_between_jobs(tmp_path: Path) -> None:
    """Job 0, then job 1 a while after job 0 was taken for gone (120 s without a step): the windows in between
    hold no row of either, so no line crosses the gap (nor ramps across it)."""
    scenario = Scenario([JobSpec(0, steps=200), JobSpec(1, steps=200, start_s=160.0)], cache_bytes=2000 * MB, seed=2)
    path = record(scenario, tmp_path / "windows.jsonl")
    empty = [(row["start_s"], row["end_s"]) for row in rows(path)
             if not row["ranks"] and not row["jobs"]]
    gap_start = min(start for start, _ in empty if start > 100 + BASE_NS / 1e9)
    gap_end = max(end for _, end in empty if end < 160 + BASE_NS / 1e9)
    assert gap_end - gap_start > 5, "the jobs are apart"
    run = run_from_windows(path)
    lines = [_steps(series, 0.0) for series in (run.steps_per_second, *run.stall_by_cause.values())]
    assert not drawn_over(lines, gap_start, gap_end)
    assert drawn_over(lines, gap_start - 5, gap_start) and drawn_over(lines, gap_end, gap_end + 5)


def test_the_whatif_says_why_it_has_no_estimate(tmp_path: Path) -> None:
    scenario = Scenario([JobSpec(0, steps=200)], cache_bytes=2000 * MB, seed=4)
    without = run_from_windows(record(scenario, tmp_path / "w.jsonl", cache_capacity_bytes=None))
    said = shown(render_html(without), "whatif-none")
    assert "not given the spoke&#x27;s capacity (--correlator.cache-capacity)" in said
    assert f"tracks {scenario.jobs[0].dataset_items:,} keys" in said  # every item read: the curve saw them
    estimate = run_from_windows(record(scenario, tmp_path / "with.jsonl"))
    assert estimate.whatif and 'id="whatif-none"' not in render_html(estimate)
    assert 'id="whatif-none">no estimate: no read crossed a spoke' in render_html(Run(0, 1))
    assert 'id="whatif-none">no estimate: the correlator&#x27;s what-if saw no read' in render_html(
        Run(0, 1, spoke_reads=10))
