"""The warm-up forecast: its arithmetic by hand, its answers where there is none or it is "never", and its error
against the scenario generator's ground truth over seeds (docs/attribution.md has the table)."""

from __future__ import annotations

import html
import math
from pathlib import Path

import pytest

from stallwatch.correlator.forecast import NEVER, Forecast, WarmupForecast
from stallwatch.correlator.hold import Publication
from stallwatch.correlator.metrics import CorrelatorMetrics
from stallwatch.report.render import render_html
from stallwatch.report.windows import run_from_windows
from tests.scenarios.forecast import CASES, SEEDS, forecast_errors
from tests.scenarios.generator import BASE_NS, JobSpec, Scenario
from tests.scenarios.run import correlate
from tests.test_report_windows import record, shown

MB = 1 << 20
SECOND = 10**9


def _fed(windows: list[tuple[int, int, int]], dataset: int | None = None, capacity: int | None = None,
         item: int = MB, idle: float = 0.0, ranks: int = 1, steps: int = 0,
         first_pass: list[tuple[float, int]] | None = None) -> WarmupForecast:
    """A forecast fed one-second windows of (reads, hits, hub bytes) of a job of `ranks` ranks taking `steps` steps
    a window, reads of `item` bytes each; `first_pass`: the job's progress reported in each window."""
    forecast = WarmupForecast(0.9, 10.0, dataset, capacity)
    for i, (reads, hits, hub_bytes) in enumerate(windows):
        forecast.add(i * SECOND, (i + 1) * SECOND, reads, hits, reads * item, hub_bytes, idle, ranks, steps,
                     None if first_pass is None else first_pass[i])
    return forecast


def test_one_pass_ends_when_the_dataset_is_fetched_at_the_pace_of_now() -> None:
    # 5 MB a second, every read a miss, 0.5 s of GPU idle a second: 25 of 100 MB fetched after 5 s.
    forecast = _fed([(5, 0, 5 * MB)] * 5, dataset=100 * MB, idle=0.5).forecast(5.0)
    assert forecast is not None
    assert forecast.time_to_steady_s == pytest.approx(5.0 + 75 / 5)  # 75 MB left at 5 MB/s
    assert forecast.hub_bytes == pytest.approx(75 * MB)
    assert forecast.idle_gpu_seconds == pytest.approx(2.5 / 25 * 75)  # idle per MB so far x MB to come


def test_ranks_that_hit_each_others_fetches_follow_the_power_law_by_hand() -> None:
    # 1000 MB; windows of 100 one-MB reads whose hits follow 1 - h = (1 - f)^a with a = 0.5 (two ranks).
    windows, fetched = [], 0
    for _ in range(6):
        hits = round(100 * (1 - math.sqrt(1 - (fetched + 50 * MB) / (1000 * MB))))
        windows.append((100, hits, (100 - hits) * MB))
        fetched += (100 - hits) * MB
    got = _fed(windows, dataset=1000 * MB, ranks=2).forecast(6.0)
    # a as the forecast reads it: each window's -ln(1 - h) over -ln(1 - f) at its middle, weighted by reads.
    held, scale, hit_scale = 0.0, 0.0, 0.0
    for reads, hits, hub in windows:
        f = (held + hub / 2) / (1000 * MB)
        if f >= 0.05:
            scale += reads * -math.log(1 - f)
            hit_scale += reads * -math.log(1 - hits / reads)
        held += hub
    a = hit_scale / scale
    f, target = held / (1000 * MB), 1 - 0.1 ** (1 / a)
    left = 1000 / (100 * (1 - a)) * ((1 - f) ** (1 - a) - (1 - target) ** (1 - a))  # W / (r (1 - a)) (...)
    assert 0.4 < a < 0.6
    assert got is not None and got.time_to_steady_s == pytest.approx(6.0 + left)
    assert got.hub_bytes == pytest.approx((target - f) * 1000 * MB)


def test_without_the_dataset_size_the_working_set_is_fitted_from_the_reuse_of_two_ranks() -> None:
    # Hits h against fill F say W = F / (1 - (1 - h)^2) for two ranks: 20 MB held, h = 0.36 -> W = 33.9 MB.
    forecast = _fed([(50, 0, 20 * MB), (50, 18, 0), (50, 18, 0)], ranks=2).forecast(3.0)
    assert forecast is not None
    working_set = 20 * MB / (1 - 0.64**2)  # both windows with hits were at F = 20 MB
    assert forecast.hub_bytes == pytest.approx((0.99 - 20 * MB / working_set) * working_set)


def test_the_first_pass_ends_after_the_epochs_steps_left_at_the_pace_of_now() -> None:
    # One rank, 2 steps a second of 100 an epoch, 5 MB a second all missed: a quarter through, 25 MB fetched.
    progress = [(0.05 * (i + 1), 100) for i in range(5)]
    forecast = _fed([(5, 0, 5 * MB)] * 5, idle=0.5, steps=2, first_pass=progress).forecast(5.0)
    assert forecast is not None
    assert forecast.time_to_steady_s == pytest.approx(5.0 + 0.75 * 100 / 2)  # 75 steps left at 2 a second
    assert forecast.hub_bytes == pytest.approx(75 * MB)  # W = F / p = 100 MB
    assert forecast.idle_gpu_seconds == pytest.approx(2.5 / 25 * 75)
    # Two ranks that each take a whole pass and hit each other's fetches: half through, F = W (1 - 0.5^2); steady
    # at p* = 1 - 0.1 = 0.9, the 40 steps left of 100 at 2 steps a second a rank (4 for the job).
    both = _fed([(10, 2, 8 * MB)] * 5, ranks=2, steps=4, first_pass=[(0.5, 100)] * 5).forecast(5.0)
    assert both is not None
    working_set = 40 * MB / 0.75
    assert both.time_to_steady_s == pytest.approx(5.0 + 0.4 * 100 / 2)
    assert both.hub_bytes == pytest.approx(((1 - 0.1**2) - 0.75) * working_set)
    # Once the pass is over, steady is due; fetching a third more again than the pass did, never.
    over = [(0.25 * (i + 1), 100) for i in range(4)] + [(1.0, 100)] * 6
    assert _fed([(5, 0, 5 * MB)] * 4 + [(5, 5, 0)] * 2, steps=2, first_pass=over[:6]).forecast(6.0) == Forecast(
        6.0, 0.0, 0.0)
    assert _fed([(5, 0, 5 * MB)] * 10, steps=2, first_pass=over).forecast(10.0) == Forecast(NEVER, NEVER, NEVER)


def test_nothing_is_forecast_before_reuse_or_the_size_is_known() -> None:
    assert _fed([(5, 0, 5 * MB)] * 5).forecast(5.0) is None  # a pass reads nothing twice
    assert _fed([(5, 0, 5 * MB)] * 4 + [(5, 3, 2 * MB)], ranks=2).forecast(5.0) is None  # 3 hits say little


def test_a_working_set_the_spoke_cannot_hold_or_one_fetched_again_is_never_steady() -> None:
    too_big = _fed([(5, 0, 5 * MB)], dataset=100 * MB, capacity=80 * MB).forecast(1.0)
    fetched_past_the_spoke = _fed([(5, 0, 5 * MB)] * 20, capacity=80 * MB).forecast(20.0)
    fetched_again = _fed([(5, 0, 5 * MB)] * 30, dataset=100 * MB).forecast(30.0)  # 150 MB of 100
    for forecast in (too_big, fetched_past_the_spoke, fetched_again):
        assert forecast is not None and forecast.time_to_steady_s == NEVER


@pytest.mark.parametrize("seed", SEEDS[:4])
@pytest.mark.parametrize("case", list(CASES))
def test_a_third_into_the_warm_up_the_forecast_is_within_a_quarter_of_the_actual(case: str, seed: int) -> None:
    errors = forecast_errors(CASES[case], seed)
    assert abs(errors.at_third) <= 0.25, f"{errors.at_third:+.1%} of {errors.actual_s:.1f} s"
    assert errors.worst_after <= 0.25


@pytest.mark.parametrize(("spec", "cache_bytes"), [
    (JobSpec(0, steps=800), 400 * MB // 2),  # thrash: the spoke holds half the working set
    (JobSpec(0, steps=600, new_item_fraction=1.0), 800 * MB),  # nothing read twice
    (JobSpec(0, steps=800, epoch_known=True), 400 * MB // 2),
    (JobSpec(0, steps=600, new_item_fraction=1.0, epoch_known=True), 800 * MB),
], ids=["thrash", "no-reuse", "thrash-epoch-progress", "no-reuse-epoch-progress"])
def test_a_job_that_cannot_get_steady_is_told_never_once_it_has_fetched_more_than_the_spoke_holds(
        spec: JobSpec, cache_bytes: int) -> None:
    outcome = correlate(Scenario([spec], cache_bytes=cache_bytes, seed=2))
    rows = [((w.end_ns - BASE_NS) / 1e9, j) for w in outcome.windows for j in w.jobs if j.job == 0]
    past_the_spoke_s = next(t for t, j in rows if j.warmup_hub_bytes > cache_bytes)
    never = [t for t, j in rows if j.forecast is not None and j.forecast.time_to_steady_s == NEVER]
    assert rows[-1][1].time_to_steady_s is None
    assert never and never[0] <= past_the_spoke_s and never[-1] == rows[-1][0]


def test_the_forecast_is_published_and_never_reads_as_plus_infinity() -> None:
    outcome = correlate(Scenario([JobSpec(0, steps=400)], cache_bytes=400 * MB // 2, seed=1))
    metrics = CorrelatorMetrics(job_names=lambda job: f"job-{job}", expire_after_s=None)
    for window in outcome.windows:
        metrics.observe(window)
        metrics.publish(Publication(window, 0))
    samples = {(s.name, s.labels.get("training_job")): s.value for family in metrics.collect() for s in family.samples}
    assert samples[("stallwatch_warmup_forecast_time_to_steady_seconds", "job-0")] == math.inf


def test_the_report_says_what_the_forecast_said_a_third_of_the_way_in(tmp_path: Path) -> None:
    scenario = Scenario([JobSpec(0, steps=1200)], cache_bytes=800 * MB, seed=1)
    run = run_from_windows(record(scenario, tmp_path / "windows.jsonl", dataset_bytes=400 * MB))
    assert run.time_to_steady_seconds is not None and run.job_started is not None
    said = html.unescape(shown(render_html(run), "forecast"))
    told = run.forecast_time_to_steady
    at_third = told.v[told.t >= run.job_started + run.time_to_steady_seconds / 3][0]
    assert f"A third of the way in ({run.time_to_steady_seconds / 3:,.1f} s)" in said
    assert f"said steady {at_third:,.1f} s after the job's start" in said
    assert abs(at_third - run.time_to_steady_seconds) <= 0.25 * run.time_to_steady_seconds


def test_the_report_of_a_thrashing_run_says_never_steady_and_one_without_a_forecast_says_why(tmp_path: Path) -> None:
    thrash = Scenario([JobSpec(0, steps=600)], cache_bytes=400 * MB // 2, seed=1)
    said = shown(render_html(run_from_windows(record(thrash, tmp_path / "thrash.jsonl"))), "forecast")
    assert "says never steady, since" in said
    one_pass = Scenario([JobSpec(0, steps=60)], cache_bytes=800 * MB, seed=1)  # no second pass, no size given
    said = shown(render_html(run_from_windows(record(one_pass, tmp_path / "short.jsonl"))), "forecast")
    assert said.startswith("No forecast of the time to steady")
