"""Stage or stream: the arithmetic of copying a dataset next to the GPUs against streaming it through the spoke,
checked against figures worked out by hand, and the report's paragraph for a cold-then-warm run, a thrashing run
and a run that never reads anything twice, checked against the window rows it was read from."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stallwatch import prices
from stallwatch.report.command import main
from stallwatch.report.render import render_html
from stallwatch.report.run import Run, Series
from stallwatch.report.stage import Verdict, weigh
from tests.scenarios.generator import JobSpec, Scenario
from tests.test_report_windows import record, rows, shown

MB = 1 << 20
# $7.20 a GPU-hour is $0.002 a GPU-second; $0.05 a GB.
PRICES = prices.chosen(gpu_dollars_per_hour=7.2, egress_dollars_per_gb=0.05)
PRICE_FLAGS = ["--prices.gpu-dollars-per-hour", "7.2", "--prices.egress-dollars-per-gb", "0.05"]


def spans(*held: tuple[float, float, float]) -> Series:
    """A series from (start, end, value) spans."""
    t, end, v = (np.array(column, dtype=np.float64) for column in zip(*held, strict=True))
    return Series(t, v, end)


def by_hand_run(steady: bool = True) -> Run:
    """An hour of a job on 4 GPUs. The hub sends 100 MB/s for the first 900 s (90 GB, all before steady was
    recognised at 900 s), nothing to 2700 s, then 20 MB/s (18 GB): 108 GB over 1800 s of fetching, 60 MB/s.
    The GPUs idle in remote fetches 1 GPU-second a second to 900 s (900), then 0.5 from 2700 s (450). The
    correlator's warm-up: 1000 GPU-seconds idle in stalls and 90 GB until steady."""
    run = Run(0.0, 3600.0, job="train", spoke_reads=1000.0, job_gpus=4, job_started=0.0)
    run.hub_bytes_per_second = spans((0, 900, 100e6), (900, 2700, 0.0), (2700, 3600, 20e6))
    run.remote_fetch_gpu_idle = spans((0, 900, 1.0), (900, 2700, 0.0), (2700, 3600, 0.5))
    run.hit_ratio = spans((0, 900, 0.3), (900, 3600, 0.95))
    if steady:
        run.time_to_steady_seconds, run.warmup_idle_gpu_seconds, run.warmup_hub_bytes = 600.0, 1000.0, 90e9
        run.phases = [(0.0, 900.0, "cold"), (900.0, 3600.0, "steady")]
    else:
        run.phases = [(0.0, 3600.0, "cold")]
    return run


def test_a_span_across_since_counts_in_part() -> None:
    assert spans((0, 10, 2.0), (10, 20, np.nan)).integral(4.0) == pytest.approx(12.0)
    assert spans((0, 10, 2.0)).integral() == pytest.approx(20.0)


def test_the_copy_against_the_warmup_and_the_residual_by_hand() -> None:
    """D = the 90 GB read until warm; copy = 90 GB / 60 MB/s = 1500 s with 4 GPUs: 6000 GPU-s, $12, plus $4.50
    egress: $16.50. Warm-up: 1000 GPU-s ($2) + 90 GB ($4.50) = $6.50, 250 s per GPU. From 900 s (steady
    recognised) to 3600 s: 450 GPU-s ($0.90) + 18 GB ($0.90) in 0.75 h: $2.40 an hour. Break-even past the
    warm-up: (16.5 - 6.5) / 2.4 = 4.17 h."""
    weighed = weigh(by_hand_run(), PRICES)
    assert weighed.verdict is Verdict.STREAM_WINS_UNTIL and weighed.missing == ()
    assert weighed.gpus == 4 and weighed.hub_bytes_per_second == pytest.approx(60e6)
    assert weighed.copy is not None and not weighed.copy.given
    assert weighed.copy.dataset_bytes == 90e9 and weighed.copy.seconds == pytest.approx(1500.0)
    assert weighed.copy.gpu_dollars == pytest.approx(12.0) and weighed.copy.egress_dollars == pytest.approx(4.5)
    assert weighed.copy.dollars == pytest.approx(16.5)
    assert weighed.warmup is not None
    assert weighed.warmup.dollars == pytest.approx(6.5) and weighed.warmup.seconds_per_gpu == pytest.approx(250.0)
    assert weighed.residual is not None and weighed.residual.seconds == pytest.approx(2700.0)
    assert weighed.residual.idle_gpu_seconds == pytest.approx(450.0)
    assert weighed.residual.hub_bytes == pytest.approx(18e9)
    assert weighed.residual.dollars_per_hour == pytest.approx(2.4)
    assert weighed.break_even_hours == pytest.approx(10 / 2.4)
    # A GB adds 4 GPUs x 1e9 / 60e6 s x $0.002 + $0.05 = $0.18333 to the copy.
    assert weighed.copy_dollars_per_gb == pytest.approx(4 / 60 * 2 + 0.05)
    said = shown(render_html(by_hand_run(), PRICES), "stage-or-stream")
    assert ("Streaming through the spoke cost $6.5000 in its warm-up (1,000.0 GPU-seconds idle in stalls until "
            "steady, 250.0 s per GPU, and 90.000 GB from the hub) and $2.4000 an hour since (450.0 GPU-seconds idle "
            "in remote fetches and 18.000 GB from the hub in the 45.0 min after steady).") in said
    assert ("Staging would have cost $16.5000 up front: a copy of 90.000 GB (the data the job read until its cache "
            "was warm) at 60.0 MB/s (the hub's mean throughput over the spans in which reads missed the spoke) with "
            "4 GPUs reserved takes 25.0 min ($12.0000), plus $4.5000 of egress.") in said
    assert said.endswith("Streaming wins unless the job runs longer than 4.2 h past its warm-up.")


def test_a_small_dataset_stages_from_the_start_and_a_quiet_steady_state_streams_at_any_length() -> None:
    """30 GB: a 500 s copy, $4 + $1.50 = $5.50, under the warm-up's $6.50. With nothing fetched after steady,
    streaming's residual is $0 an hour: no job is long enough for the 90 GB copy."""
    small = weigh(by_hand_run(), PRICES, dataset_bytes=30e9)
    assert small.verdict is Verdict.STAGE_WINS and small.copy is not None and small.copy.given
    assert small.copy.dollars == pytest.approx(5.5)
    page = render_html(by_hand_run(), PRICES, dataset_bytes=30e9)
    assert "a copy of 30.000 GB (the dataset)" in page
    assert "Staging wins from the start: the copy costs no more than streaming's warm-up alone." in page
    quiet = by_hand_run()
    quiet.hub_bytes_per_second = spans((0, 900, 100e6), (900, 3600, 0.0))
    quiet.remote_fetch_gpu_idle = spans((0, 900, 1.0), (900, 3600, 0.0))
    weighed = weigh(quiet, PRICES)
    assert weighed.verdict is Verdict.STREAM_WINS and weighed.break_even_hours is None
    assert weighed.hub_bytes_per_second == pytest.approx(100e6)  # the fetching spans only
    assert shown(render_html(quiet, PRICES), "stage-or-stream").endswith(
        "Streaming wins at any length: its steady state costs nothing more.")


def test_a_run_never_steady_pays_its_residual_from_the_start() -> None:
    """No warm-up: from 0 s, 1350 GPU-s ($2.70) and 108 GB ($5.40) in the hour, $8.10 an hour. Without a size
    there is no copy to price, only its $0.18333 a GB: an hour of streaming stages 44.2 GB. With 90 GB, the
    $16.50 copy is paid for after 16.5 / 8.1 = 2.04 h."""
    unknown = weigh(by_hand_run(steady=False), PRICES)
    assert unknown.verdict is Verdict.NOT_KNOWN and unknown.warmup is None and unknown.copy is None
    assert unknown.missing == ("the dataset's size (the job never got warm, so what it read until then is no "
                               "measure of it; --dataset-size gives it)",)
    assert unknown.residual is not None and unknown.residual.dollars_per_hour == pytest.approx(8.1)
    assert unknown.break_even_bytes_per_hour == pytest.approx(8.1 / (4 / 60 * 2 + 0.05) * 1e9)
    staged = weigh(by_hand_run(steady=False), PRICES, dataset_bytes=90e9)
    assert staged.verdict is Verdict.STREAM_WINS_UNTIL and staged.break_even_hours == pytest.approx(16.5 / 8.1)
    said = shown(render_html(by_hand_run(steady=False), PRICES, dataset_bytes=90e9), "stage-or-stream")
    assert "The job never got steady" in said and "$8.1000 an hour from its start" in said
    assert "Staging wins for any job longer than 2.0 h; streaming only for a shorter one." in said
    assert "Staging wins for a dataset under 44.182 GB per hour the job runs" in said
    # With the epoch's length (4 ranks, 8 steps a second between them over the hour: 2 a rank; 1,800-step epochs
    # take 900 s) the break-even is in epochs too: 2.04 h is 8.1 epochs.
    epochs = by_hand_run(steady=False)
    epochs.ranks, epochs.epoch_steps = 4, 1800
    epochs.steps_per_second = Series(np.array([0.0]), np.array([8.0]), np.array([3600.0]))
    said = shown(render_html(epochs, PRICES, dataset_bytes=90e9), "stage-or-stream")
    assert f"longer than 2.0 h ({16.5 / 8.1 * 3600 / 900:,.1f} epochs at the run's pace)" in said


def test_what_the_run_cannot_give_is_named_never_printed_as_nan() -> None:
    no_gpus = by_hand_run()
    no_gpus.job_gpus = None
    weighed = weigh(no_gpus, PRICES)
    assert weighed.verdict is Verdict.NOT_KNOWN and weighed.copy is None
    said = shown(render_html(no_gpus, PRICES), "stage-or-stream")
    assert "Not enough to weigh the two: not known, how many GPUs the job holds" in said
    assert "Streaming through the spoke cost $6.5000 in its warm-up" in said  # what is known is still said
    assert "nan" not in said and "n/a" not in said
    no_spoke = Run(0.0, 60.0)
    assert weigh(no_spoke, PRICES).verdict is Verdict.NOTHING_TO_STAGE
    assert shown(render_html(no_spoke), "stage-or-stream") == (
        "Stage or stream: no read crossed a spoke: there is nothing to stage.")
    several = by_hand_run()
    several.several_jobs = ("a", "b")
    assert "pass --job" in shown(render_html(several), "stage-or-stream")


def by_window(path: Path) -> list[dict[str, Any]]:
    """The file's windows in time order, each line of a window merged: its bounds, the job's hub bytes,
    remote_fetch GPU idle and phase, and the warm-up figures as published."""
    merged: dict[float, dict[str, Any]] = defaultdict(lambda: {"hub": 0.0, "idle": 0.0, "phase": None, "gpus": set()})
    for row in rows(path):
        window = merged[row["start_s"]]
        window["start"], window["end"] = row["start_s"], row["end_s"]
        window["idle"] += sum(g["idle_s"]["remote_fetch"] for g in row["gpus"])
        window["gpus"] |= {g["gpu"] for g in row["gpus"]}
        for job in row["jobs"]:
            window["hub"] += job["hub_bytes"]
            window["phase"] = job["phase"]
            if job["time_to_steady_s"] is not None:
                window["warmup"] = (job["warmup_idle_gpu_s"], job["warmup_hub_bytes"])
    return [merged[start] for start in sorted(merged)]


def fetch_rate(windows: list[dict[str, Any]]) -> float:
    fetching = [w for w in windows if w["hub"] > 0]
    return sum(w["hub"] for w in fetching) / sum(w["end"] - w["start"] for w in fetching)


def report(path: Path, out: Path, *flags: str) -> str:
    assert main(["--windows", str(path), "--out", str(out), *PRICE_FLAGS, *flags]) == 0
    return shown(out.read_text(), "stage-or-stream")


def test_a_cold_then_warm_run_streams(tmp_path: Path) -> None:
    """Two ranks read a 400 MB dataset through a spoke that holds it all: the warm-up fetches it once, then every
    read hits. Staging would copy the same bytes with both GPUs idle through the copy, which costs more than the
    stream's stalls did; once warm, the stream costs nothing more, so streaming wins at any length."""
    path = record(Scenario([JobSpec(0, steps=500, ranks=2)], cache_bytes=2000 * MB, seed=11),
                  tmp_path / "windows.jsonl")
    windows = by_window(path)
    idle, hub = next(w["warmup"] for w in reversed(windows) if "warmup" in w)
    gpus = len(set().union(*(w["gpus"] for w in windows)))
    rate = fetch_rate(windows)
    warmup = idle * 0.002 + hub / 1e9 * 0.05
    copy = hub / rate
    stage = gpus * copy * 0.002 + hub / 1e9 * 0.05
    steady = next(i for i, w in enumerate(windows) if w["phase"] == "steady")
    assert gpus == 2 and hub >= 400 * MB and stage > warmup
    assert sum(w["hub"] + w["idle"] for w in windows[steady:]) == 0  # warm: nothing fetched, no fetch stall
    said = report(path, tmp_path / "report.html")
    assert (f"Streaming through the spoke cost ${warmup:,.4f} in its warm-up ({idle:,.1f} GPU-seconds idle in stalls "
            f"until steady, {idle / gpus:,.1f} s per GPU, and {hub / 1e9:,.3f} GB from the hub) and $0.0000 an hour "
            "since") in said
    assert (f"Staging would have cost ${stage:,.4f} up front: a copy of {hub / 1e9:,.3f} GB (the data the job read "
            f"until its cache was warm) at {rate / 1e6:,.1f} MB/s") in said
    assert f"with 2 GPUs reserved takes {copy:,.1f} s (${gpus * copy * 0.002:,.4f})" in said
    assert said.endswith("Streaming wins at any length: its steady state costs nothing more.")
    page = (tmp_path / "report.html").read_text()
    assert page.index('id="stalls"') < page.index('id="stage-or-stream"') < page.index("<h2>Warm-up</h2>")
    assert "a copy of 4.000 GB (the dataset)" in report(path, tmp_path / "big.html", "--dataset-size", "4e9")


def test_a_thrashing_run_never_steady_keeps_paying(tmp_path: Path) -> None:
    """A 120 MB spoke under a 400 MB dataset: most reads miss all run long and the job never gets steady, so the
    stream pays its remote fetches and hub bytes every hour. Staging the 400 MB once pays for itself in seconds."""
    path = record(Scenario([JobSpec(0, steps=600, workers=2, compute_s=0.02)], cache_bytes=120 * MB, seed=13),
                  tmp_path / "windows.jsonl")
    windows = by_window(path)
    assert all(w["phase"] != "steady" for w in windows)
    hours = (windows[-1]["end"] - windows[0]["start"]) / 3600
    idle, hub = sum(w["idle"] for w in windows), sum(w["hub"] for w in windows)
    per_hour = (idle * 0.002 + hub / 1e9 * 0.05) / hours
    rate = fetch_rate(windows)
    per_gb = 1e9 / rate * 0.002 + 0.05  # one GPU
    assert idle > 10 and hub > 1e9
    said = report(path, tmp_path / "report.html")
    assert said.startswith("Stage or stream: The job never got steady (its spoke never held what it read again), so "
                           f"streaming kept paying: ${per_hour:,.4f} an hour from its start ({idle:,.1f} GPU-seconds "
                           f"idle in remote fetches and {hub / 1e9:,.3f} GB from the hub")
    assert f"Staging costs ${per_gb:,.4f} a GB: a copy at {rate / 1e6:,.1f} MB/s" in said
    assert "Not enough to weigh the two: not known, the dataset's size (the job never got warm" in said
    assert f"Staging wins for a dataset under {per_hour / per_gb:,.3f} GB per hour the job runs" in said
    stage = 400 * MB / rate * 0.002 + 400 * MB / 1e9 * 0.05
    said = report(path, tmp_path / "staged.html", "--dataset-size", str(400 * MB))
    assert f"Staging would have cost ${stage:,.4f} up front: a copy of 0.419 GB (the dataset)" in said
    assert f"Staging wins for any job longer than {stage / per_hour * 3600:,.1f} s; streaming only for a shorter one." \
        in said


def test_a_run_without_reuse_gains_nothing_from_staging(tmp_path: Path) -> None:
    """Every read is of an item never read before: none hits, nor would at any capacity. A copy fetches the same
    bytes and waits for them all first; the paragraph says so and prices no copy."""
    path = record(Scenario([JobSpec(0, steps=200, new_item_fraction=1.0)], cache_bytes=2000 * MB, seed=7),
                  tmp_path / "windows.jsonl")
    assert all(job["hit_ratio"] in (0, None) for row in rows(path) for job in row["jobs"])
    hub = sum(w["hub"] for w in by_window(path))
    said = report(path, tmp_path / "report.html")
    assert said.startswith("Stage or stream: no read hit the spoke, nor would at any capacity its what-if tried: the "
                           "job read each byte once.")
    assert f"the same bytes the stream fetched ({hub / 1e9:,.3f} GB from the hub" in said
    assert said.endswith("Staging buys nothing the stream did not also pay.")
    assert "Staging would have cost" not in said and "wins" not in said
