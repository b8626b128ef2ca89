"""What stalls and hub bytes cost: the price table and flags, the correlator's cost series, the report's cost section
and its spoke sizing in stall seconds and dollars, each against figures worked out by hand."""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from stallwatch import catalogue as c
from stallwatch import prices
from stallwatch.correlator.hold import WindowHold
from stallwatch.correlator.metrics import CorrelatorMetrics
from stallwatch.correlator.pipeline import CorrelatorPipeline
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.correlator.windowfile import WindowFileWriter
from stallwatch.exporters import agent  # noqa: F401  # registers the collectors, the correlator's flags with them
from stallwatch.exporters.collector import registered
from stallwatch.exporters.config import build_parser as agent_parser
from stallwatch.exporters.gpu import GpuCollector
from stallwatch.exporters.gpu_directory import GpuDirectory
from stallwatch.exporters.nvml_fake import FakeGpu, FakeNVML
from stallwatch.report.command import build_parser
from stallwatch.report.cost import sizing, smallest_under
from stallwatch.report.render import render_html
from stallwatch.report.run import Run, Series
from stallwatch.report.windows import run_from_windows
from tests.scenarios.generator import JobSpec, Scenario, generate
from tests.test_report_windows import record, rows, shown

MB = 1 << 20
# Round figures, so the hand computations below read easily: $7.20 a GPU-hour is $0.002 a GPU-second.
PRICES = prices.chosen(gpu_dollars_per_hour=7.2, egress_dollars_per_gb=0.05)


def test_the_table_gives_dated_list_prices_and_a_flag_replaces_one() -> None:
    listed = prices.chosen("A100-80GB", "internet")
    assert (listed.gpu_dollars_per_hour, listed.egress_dollars_per_gb) == (3.4309, 0.09)
    assert listed.gpu_read_on == "2026-11-09" and listed.egress_read_on == "2026-12-05"
    assert prices.Prices() == prices.chosen("H100", "same_continent")
    assert (PRICES.gpu_read_on, PRICES.egress_read_on) == (prices.SET_BY_FLAG, prices.SET_BY_FLAG)
    assert PRICES.gpu_cost(1800) == pytest.approx(3.6)  # half an hour of one GPU at $7.20
    assert PRICES.egress_cost(3e9) == pytest.approx(0.15)  # 3 GB at $0.05
    parser = argparse.ArgumentParser()
    prices.add_arguments(parser.add_argument_group())
    set_by_flag = prices.from_options(parser.parse_args(["--prices.gpu-type", "L4", "--prices.egress-dollars-per-gb",
                                                         "0.12"]))
    assert set_by_flag == prices.Prices("L4", "same_continent", 0.8048, 0.12, "2026-11-09", prices.SET_BY_FLAG)
    for wrong in (["--prices.gpu-type", "K80"], ["--prices.egress-dollars-per-gb", "-1"],
                  ["--prices.gpu-dollars-per-hour", "nan"]):
        with pytest.raises(SystemExit):
            parser.parse_args(wrong)


def test_the_report_takes_the_price_flags_and_no_longer_a_price_per_gb() -> None:
    parser = build_parser(0.0)
    options = parser.parse_args(["--windows", "w.jsonl", "--prices.region-pair", "inter_continent",
                                 "--input-bound-target", "0.1"])
    assert prices.from_options(options).egress_dollars_per_gb == 0.08 and options.input_bound_target == 0.1
    with pytest.raises(SystemExit):
        parser.parse_args(["--windows", "w.jsonl", "--price-per-gb", "0.02"])


def test_the_agent_takes_the_same_price_flags() -> None:
    options = agent_parser(registered()).parse_args(["--prices.gpu-type", "A100-40GB", "--prices.region-pair",
                                                     "same_region"])
    assert prices.from_options(options) == prices.chosen("A100-40GB", "same_region")


def _two_jobs(metrics: CorrelatorMetrics, path: Path) -> Path:
    """Two jobs through one cold spoke (job 0 on GPUs 0 and 1, job 1 on GPU 2), correlated into `metrics` and a
    window file at `path`."""
    scenario = Scenario([JobSpec(0, steps=300, ranks=2), JobSpec(1, steps=200, first_gpu=2, dataset_items=200)],
                        cache_bytes=2000 * MB, seed=3)
    writer = WindowFileWriter(path)
    hold = WindowHold(5.0, [metrics.publish, writer.write], wall_offset=lambda: 0)
    CorrelatorPipeline(CorrelatorSettings(cache_capacity_bytes=scenario.cache_bytes),
                       listeners=[hold.add, metrics.observe]).run(generate(scenario).batches)
    hold.flush()
    writer.close()
    return path


def test_the_correlator_prices_each_jobs_gpu_idle_and_hub_bytes(tmp_path: Path) -> None:
    """Two jobs through one cold spoke: each job's cost series are its window rows' GPU idle by
    cause times $0.002 a second and its hub bytes times $0.05 a GB, under the labels training_job and cause."""
    metrics = CorrelatorMetrics(prices=PRICES, wall_offset=lambda: 0)
    path = _two_jobs(metrics, tmp_path / "windows.jsonl")
    idle: dict[tuple[str, str], float] = defaultdict(float)
    hub: dict[str, float] = defaultdict(float)
    for row in rows(path):
        for g in row["gpus"]:
            for cause, seconds in g["idle_s"].items():
                idle[(g["job"], cause)] += seconds
        for j in row["jobs"]:
            hub[j["job"]] += j["hub_bytes"]
    families = {family.name: family for family in metrics.collect()}
    gpu_cost = families[c.STALL_GPU_COST.name.removesuffix("_total")]
    egress_cost = families[c.EGRESS_COST.name.removesuffix("_total")]
    # The latest sample of each series (earlier ones are the windows published since a scrape).
    got_gpu = {(s.labels[c.JOB_LABEL], s.labels["cause"]): s.value for s in gpu_cost.samples}
    got_egress = {s.labels[c.JOB_LABEL]: s.value for s in egress_cost.samples}
    assert {tuple(s.labels) for s in gpu_cost.samples} == {(c.JOB_LABEL, "cause")}
    assert set(got_gpu) == {(job, cause) for job in ("0", "1") for cause in c.CAUSES}
    for key, seconds in idle.items():
        assert got_gpu[key] == pytest.approx(seconds * 0.002, abs=1e-9), key
    assert got_gpu[("0", "remote_fetch")] > 0 and got_gpu[("1", "remote_fetch")] > 0  # the cold epochs' misses
    assert set(got_egress) == {"0", "1"}
    for job, hub_bytes in hub.items():
        assert got_egress[job] == pytest.approx(hub_bytes / 1e9 * 0.05), job
    assert got_egress["1"] == pytest.approx(200 * MB / 1e9 * 0.05, rel=0.05)  # job 1's items, each missed once
    price_samples = [(s.name, s.labels, s.value) for name in (c.GPU_PRICE.name, c.EGRESS_PRICE.name)
                     for s in families[name].samples]
    assert [(name, labels) for name, labels, _ in price_samples] == [
        (c.GPU_PRICE.name, {"gpu_type": "H100"}), (c.EGRESS_PRICE.name, {"region_pair": "same_continent"})]
    assert [value for _, _, value in price_samples] == pytest.approx([0.002, 5e-11], rel=1e-9)


def by_hand_run() -> Run:
    """Half an hour: 150 stall-seconds (100 remote_fetch, 50 preprocess) and 600 s of compute; GPU idle 80 s in the
    remote fetches and 40 s in preprocessing; 1.8 GB from the hub; a spoke at half its hits now at 1x."""
    run = Run(0.0, 1800.0, compute_seconds=600.0, spoke_reads=1000.0, whatif_keys=100.0,
              whatif={"0.5": 0.2, "1": 0.5, "2": 0.9, "4": 0.95})
    run.stall_seconds.update(remote_fetch=100.0, preprocess=50.0)
    run.gpu_stall_idle_seconds.update(remote_fetch=80.0, preprocess=40.0)
    run.hub_bytes_per_second = Series(np.array([0.0]), np.array([1e6]), np.array([1800.0]))
    return run


def test_sizing_scales_the_remote_fetches_by_the_miss_ratio_per_hour() -> None:
    """At 2x the misses are (1 - 0.9) / (1 - 0.5) = 0.2 of now's: stalls 50 + 100 x 0.2 = 70 s in the half hour,
    140 s an hour; input-bound 70 / 670; GPU idle 40 + 80 x 0.2 = 56 s, $0.112 a half hour; hub 0.36 GB, $0.018.
    At 1x the job is exactly 20 % input-bound (150 / 750), not under: 2x is the smallest under 20 %."""
    run = by_hand_run()
    assert run.hub_bytes == pytest.approx(1.8e9)
    rows_by_factor = {row.factor: row for row in sizing(run, PRICES, gpu_known=True)}
    assert list(rows_by_factor) == ["0.5", "1", "2", "4"]
    now, double = rows_by_factor["1"], rows_by_factor["2"]
    assert now.stall_seconds == pytest.approx(300.0) and now.input_bound_ratio == pytest.approx(0.2)
    assert now.gpu_dollars == pytest.approx(120 * 0.002 * 2) and now.egress_dollars == pytest.approx(1.8 * 0.05 * 2)
    assert double.stall_seconds == pytest.approx(140.0)
    assert double.input_bound_ratio == pytest.approx(70 / 670)
    assert double.gpu_dollars == pytest.approx(0.224) and double.egress_dollars == pytest.approx(0.036)
    assert rows_by_factor["0.5"].stall_seconds == pytest.approx(2 * (50 + 100 * 0.8 / 0.5))
    assert smallest_under(list(rows_by_factor.values()), 0.2) is double
    assert smallest_under(list(rows_by_factor.values()), 0.05) is None
    assert sizing(run, PRICES, gpu_known=False)[0].gpu_dollars is None
    page = render_html(run, PRICES, 0.2)
    assert "under 20 % input-bound (--input-bound-target): 2&times; the spoke" in shown(page, "sizing")
    assert "<td>2&times;</td><td>90.0 %</td><td>140.0 s</td><td>10.4 %</td><td>$0.2240</td><td>$0.0360</td>" in page
    assert shown(page, "cost-gpu") == "$0.2400" and shown(page, "cost-egress") == "$0.0900"
    said = shown(render_html(run, PRICES, 0.05), "sizing")
    assert "none of these capacities: even at 4&times; the job stays 9.1 % input-bound" in said


def test_with_the_epochs_length_the_sizing_is_per_epoch_at_the_runs_pace(tmp_path: Path) -> None:
    """Two ranks, 10 steps a second between them over the half hour, epochs of 500 steps a rank: an epoch takes
    500 / 5 = 100 s, so each figure per epoch is the hour's times 100 / 3600. A recorded run of a job whose
    trainers report their epoch's length (the scenario's 100 steps) carries it into the report."""
    run = by_hand_run()
    hourly = {row.factor: row for row in sizing(run, PRICES, gpu_known=True)}
    run.ranks, run.epoch_steps = 2, 500
    run.steps_per_second = Series(np.array([0.0]), np.array([10.0]), np.array([1800.0]))
    assert run.epoch_seconds == pytest.approx(100.0)
    for row in sizing(run, PRICES, gpu_known=True):
        assert row.stall_seconds == pytest.approx(hourly[row.factor].stall_seconds * 100 / 3600)
        assert row.egress_dollars == pytest.approx(hourly[row.factor].egress_dollars * 100 / 3600)
        assert row.input_bound_ratio == hourly[row.factor].input_bound_ratio
    page = render_html(run, PRICES, 0.2)
    assert "per epoch (500 steps, as the job's loaders report: 100.0 s at the run's pace" in page
    assert "<th>stall seconds per epoch</th>" in page
    scenario = Scenario([JobSpec(0, steps=300, epoch_known=True)], cache_bytes=2000 * MB, seed=2)
    recorded = run_from_windows(record(scenario, tmp_path / "windows.jsonl"))
    assert recorded.epoch_steps == 100 and "<th>stall seconds per epoch</th>" in render_html(recorded, PRICES)


@pytest.fixture(scope="module")
def cold_then_warm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks read a 400 MB dataset through a spoke that holds it all: misses the first epoch, hits after."""
    scenario = Scenario([JobSpec(0, steps=500, ranks=2)], cache_bytes=2000 * MB, seed=11)
    return record(scenario, tmp_path_factory.mktemp("warm") / "windows.jsonl")


def test_the_cost_section_prices_the_runs_gpu_idle_and_hub_bytes(cold_then_warm: Path) -> None:
    windows = rows(cold_then_warm)
    idle = sum(sum(g["idle_s"].values()) for row in windows for g in row["gpus"])
    hub = sum(j["hub_bytes"] for row in windows for j in row["jobs"])
    assert idle > 1 and hub > 300 * MB
    page = render_html(run_from_windows(cold_then_warm, job="0"))
    assert shown(page, "cost-gpu") == f"${idle * 6.88 / 3600:,.4f}"  # the table's H100 and same-continent prices
    assert shown(page, "cost-egress") == f"${hub / 1e9 * 0.02:,.4f}"
    assert "Of job 0, over the run" in page
    said = shown(page, "prices")
    assert "a GPU-hour at $6.88 (H100, list price read 2026-11-09)" in said
    assert "a GB from the hub at $0.02 (same_continent, list price read 2026-12-05)" in said
    assert "a GPU-hour at $7.2 (H100, set by flag)" in shown(render_html(run_from_windows(cold_then_warm), PRICES),
                                                              "prices")


def sized(page: str) -> dict[str, list[str]]:
    """The what-if table's cells after the capacity's: hit ratio, stall seconds, input-bound, GPU $, hub $."""
    return {factor: re.findall(r"<td>([^<]*)</td>", cells)
            for factor, cells in re.findall(r"<tr><td>([0-9.]+)&times;</td>(.*?)</tr>", page)}


def test_a_warm_spoke_five_times_the_dataset_could_be_half_as_big(cold_then_warm: Path) -> None:
    """Once warm, the only misses are the first epoch's: no capacity that holds the 400 MB dataset saves them, so
    0.5x (1 GB) to 4x cost what 1x does, as measured; the smallest spoke under the target is half this one."""
    run = run_from_windows(cold_then_warm)
    ratio = run.input_bound_ratio
    assert ratio is not None
    page = render_html(run, input_bound_target=ratio + 0.05)
    table = sized(page)
    assert list(table) == ["0.5", "1.0", "2.0", "4.0"]
    assert table["1.0"][1] == f"{run.stall_total * 3600 / (run.end - run.start):,.1f} s"  # as measured, per hour
    assert table["1.0"][2] == f"{ratio * 100:.1f} %"
    assert table["0.5"][1:] == table["2.0"][1:] == table["4.0"][1:] == table["1.0"][1:]
    assert "0.5&times; the spoke's capacity now" in shown(page, "sizing")
    assert "none of these capacities" in shown(render_html(run, input_bound_target=ratio / 2), "sizing")


def test_a_thrashing_spoke_is_sized_up_to_the_capacity_that_holds_the_dataset(tmp_path: Path) -> None:
    """A 120 MB spoke under a 400 MB dataset, shuffled each epoch: the LRU holds under a third of what the job reads
    again, and misses most reads. At 4x (480 MB) the dataset fits and the later epochs hit: the stalls and dollars
    fall, and 4x is the smallest capacity under a target between the two."""
    scenario = Scenario([JobSpec(0, steps=600, workers=2, compute_s=0.02)], cache_bytes=120 * MB, seed=13)
    run = run_from_windows(record(scenario, tmp_path / "windows.jsonl"))
    assert run.whatif["1.0"] < 0.4 and run.whatif["4.0"] > 0.7
    rows_by_factor = {row.factor: row for row in sizing(run, prices.Prices(), gpu_known=True)}
    now, big = rows_by_factor["1.0"], rows_by_factor["4.0"]
    assert now.input_bound_ratio is not None and big.input_bound_ratio is not None
    assert big.stall_seconds < now.stall_seconds / 2 and big.input_bound_ratio < now.input_bound_ratio
    assert big.egress_dollars < now.egress_dollars / 2
    assert big.gpu_dollars is not None and now.gpu_dollars is not None and big.gpu_dollars < now.gpu_dollars
    target = (now.input_bound_ratio + big.input_bound_ratio) / 2
    assert smallest_under(list(rows_by_factor.values()), target) is big
    assert "4.0&times; the spoke" in shown(render_html(run, input_bound_target=target), "sizing")


def test_a_run_without_spoke_reads_says_it_cannot_size_a_spoke(tmp_path: Path) -> None:
    """Local reads on a node without GPUs: no what-if to size from, no GPU idle to price; said, not drawn as zeros."""
    scenario = Scenario([JobSpec(0, steps=200, verdicts="latency")], cache_bytes=2000 * MB, seed=5)
    run = run_from_windows(record(scenario, tmp_path / "windows.jsonl", gpus=False, spoke=False))
    assert sizing(run, PRICES, gpu_known=False) == []
    page = render_html(run, PRICES)
    assert 'id="sizing"' not in page and "no estimate: no read crossed a spoke" in shown(page, "whatif-none")
    assert shown(page, "cost-gpu") == "n/a" and "GPU idle not known" in page
    assert "none: no read crossed a spoke" in page and shown(page, "cost-egress") == "$0.0000"
    no_curve = by_hand_run()
    del no_curve.whatif["1"]
    assert sizing(no_curve, PRICES, gpu_known=True) == []
    assert "no estimate at the spoke&#x27;s own capacity (factor 1)" in shown(render_html(no_curve), "whatif-none")


@pytest.mark.parametrize(("nvml_name", "gpu_type"), [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", None), ("NVIDIA H200", None), ("", None),
])
def test_a_gpu_is_priced_at_the_type_nvml_names_it(nvml_name: str, gpu_type: str | None) -> None:
    assert prices.gpu_type_of(nvml_name) == gpu_type
    auto = prices.chosen()  # --prices.gpu-type auto, the default
    priced = auto.for_gpu(nvml_name)
    assert priced.gpu_type == (gpu_type or prices.DEFAULT_GPU_TYPE)
    assert priced.gpu_dollars_per_hour == prices.GPU_DOLLARS_PER_HOUR[priced.gpu_type].dollars
    # A type or a price given by flag holds whatever the GPU.
    assert prices.chosen("A100-40GB").for_gpu(nvml_name).gpu_type == "A100-40GB"
    assert prices.chosen(gpu_dollars_per_hour=1.0).for_gpu(nvml_name).gpu_dollars_per_hour == 1.0


def test_under_auto_the_correlator_prices_each_gpu_at_its_own_type(tmp_path: Path) -> None:
    """The gpu collector learns the names from NVML (the fake, as a real driver names an L4 and an A100 80GB); the
    correlator prices each job's idle at its GPU's type and publishes both prices."""
    directory = GpuDirectory()
    collector = GpuCollector(FakeNVML([FakeGpu(name="NVIDIA L4"), FakeGpu(name="NVIDIA L4"),
                                       FakeGpu(name="NVIDIA A100-SXM4-80GB")]), start=False, directory=directory)
    try:
        collector.poll()
    finally:
        collector.close()
    metrics = CorrelatorMetrics(prices=prices.chosen(), wall_offset=lambda: 0, gpu_names=directory.name_of)
    path = _two_jobs(metrics, tmp_path / "windows.jsonl")
    idle: dict[str, float] = defaultdict(float)
    for row in rows(path):
        for g in row["gpus"]:
            idle[g["job"]] += sum(g["idle_s"].values())
    families = {family.name: family for family in metrics.collect()}
    latest = {(s.labels[c.JOB_LABEL], s.labels["cause"]): s.value
              for s in families[c.STALL_GPU_COST.name.removesuffix("_total")].samples}
    for job, gpu_type in (("0", "L4"), ("1", "A100-80GB")):
        spent = sum(v for (j, _), v in latest.items() if j == job)
        assert spent == pytest.approx(idle[job] * prices.GPU_DOLLARS_PER_HOUR[gpu_type].dollars / 3600), job
    assert {s.labels["gpu_type"]: s.value for s in families[c.GPU_PRICE.name].samples} == pytest.approx(
        {t: prices.GPU_DOLLARS_PER_HOUR[t].dollars / 3600 for t in ("L4", "A100-80GB")})
