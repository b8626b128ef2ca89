"""The client overhead benchmark's method: its round order, drift cancelling, confidence interval, CPU
clock, verdict, and one short run of its real DataLoader pipeline (benchmarks/client_overhead.py)."""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import pytest

from benchmarks.client_overhead import (
    BATCH,
    INSTRUMENTED,
    PLAIN,
    Epoch,
    Round,
    Run,
    client_cost_per_batch,
    cpu_seconds,
    jpeg_images,
    median_of_runs,
    pipeline_rounds,
    pipeline_runs,
    round_change,
    round_order,
    spread,
    verdict,
)
from stallwatch.client import transport
from stallwatch.harness import wait_for
from tests.test_client_open import Datagrams


def test_rounds_balance_places_and_predecessors() -> None:
    cycle = [side for number in range(2) for side in round_order(number)]  # the order repeats every 2 rounds
    for number in range(4):
        assert sorted(round_order(number)) == [PLAIN, PLAIN, INSTRUMENTED, INSTRUMENTED]
        assert round_order(number) == round_order(number + 2)
    for side in (PLAIN, INSTRUMENTED):
        places = [place for number in range(2) for place, tag in enumerate(round_order(number)) if tag == side]
        assert sorted(places) == [0, 1, 2, 3]  # outer and inner places alike
        after_other = sum(1 for place, this in enumerate(cycle) if this == side and cycle[place - 1] != side)
        assert after_other == 3  # of its 4 epochs in a cycle, for either side


@pytest.mark.parametrize("number", [0, 1])
def test_round_change_cancels_a_linear_drift(number: int) -> None:
    """The machine slows by 10 % an epoch through the round; the instrumented side costs 1 % more."""
    epochs = []
    for place, side in enumerate(round_order(number)):
        cost = 1.01 if side == INSTRUMENTED else 1.0
        seconds = 0.05 * cost * (1 + 0.1 * place)
        epochs.append((side, Epoch(seconds, 0.08 * cost, 0.03 * cost, 0.04 * cost, 0.02 * cost)))
    change = round_change(epochs)
    assert change.throughput == pytest.approx(100 * (1 / 1.01 - 1))
    assert change.cpu_per_sample == pytest.approx(1.0)


def test_round_change_without_difference_is_zero() -> None:
    epochs = [(side, Epoch(0.04 + 0.001 * place, 0.07, 0.03, 0.03, 0.02)) for place, side in enumerate(round_order(0))]
    assert round_change(epochs) == pytest.approx((0.0, 0.0))


def test_spread_interval_holds_the_median_and_narrows_with_more_rounds() -> None:
    generator = random.Random(1)
    few = [generator.gauss(0.3, 5) for _ in range(50)]
    many = [generator.gauss(0.3, 5) for _ in range(2000)]
    for values in (few, many):
        result = spread(values)
        assert result.low <= result.median <= result.high
        assert result.smallest <= result.first_quartile <= result.median <= result.third_quartile <= result.largest
        assert spread(values) == result  # seeded: the same rounds give the same interval
    assert spread(many).high - spread(many).low < (spread(few).high - spread(few).low) / 3
    assert spread(many).low < 0.3 < spread(many).high


def test_cpu_seconds_counts_this_process_finely() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    used = cpu_seconds(os.getpid()) - before
    assert 0.03 < used < 5


def runs_of(changes: list[list[Round]], cpu_seconds_a_sample: float, samples: int) -> list[Run]:
    plain = [Epoch(1.0, cpu_seconds_a_sample * samples, 0.5, 0.5, 0.4)] * 3
    return [Run(rounds, plain, plain) for rounds in changes]


def test_the_median_of_the_runs_sets_a_biased_run_aside() -> None:
    steady = [[Round(change + offset, 0.0) for offset in (-2.0, 0.0, 2.5)] for change in (-0.3, 0.1, 0.2, -0.1)]
    biased = [Round(5.0 + offset, 0.0) for offset in (-0.5, 0.0, 0.5)] * 4  # more rounds, all far off
    assert median_of_runs(runs_of([*steady, biased], 400e-6, 1024), field=0) == pytest.approx(0.1)


def test_the_clients_cost_a_batch_is_its_cpu_change_of_the_plain_batchs_cpu() -> None:
    runs = runs_of([[Round(-1.0, change) for change in (0.5, 1.0, 9.0)],  # run medians +1 %, +0.8 %, +3 %
                    [Round(-1.0, change) for change in (0.8, 0.2, 4.0)],
                    [Round(-1.0, change) for change in (3.0, 2.0, 7.0)]], 30e-6, samples=2048)
    assert client_cost_per_batch(runs, samples=2048) == pytest.approx(0.01 * 30 * BATCH)  # µs


@pytest.mark.parametrize(("throughput", "met"), [(-0.49, True), (0.3, True), (-0.51, False), (0.6, False)])
def test_the_target_is_judged_on_the_real_pipeline_only(throughput: float, met: bool) -> None:
    changes = [[Round(throughput + offset, 1.0) for offset in (-2.0, 0.0, 3.0)],
               [Round(throughput + offset, 1.0) for offset in (-5.0, 0.0, 3.0)],
               [Round(9.0, 1.0)]]  # the third run's median is far off: the runs' median is still `throughput`
    judged = verdict("jpeg", runs_of(changes, 400e-6, 1024), 1024)
    assert ("met" in judged) is met and ("MISSED" in judged) is not met and f"{throughput:+.2f} %" in judged
    synthetic = verdict("matmul", runs_of(changes, 30e-6, 2048), 2048)
    assert "no target" in synthetic and "MISSED" not in synthetic
    # +1 % of a 1.92 ms batch is 19.2 µs, within 0.5 % of batches of 3.84 ms (60 µs a sample) or more
    assert "19.2 µs" in synthetic and "3.8 ms" in synthetic and "60 µs a sample" in synthetic


@pytest.mark.parametrize(("control", "decode"), [(False, "matmul"), (True, "matmul"), (False, "jpeg"),
                                                (False, "jpeg-files")])
def test_pipeline_runs_real_loaders_and_pairs_every_epoch(control: bool, decode: str) -> None:
    rounds, plain, compared = pipeline_rounds(rounds=3, warmup=1, samples=256, control=control, decode=decode,
                                              rebuild_every=2)  # a second pair of loaders for the third round
    assert len(rounds) == 3 and len(plain) == len(compared) == 6
    for epoch in plain + compared:
        assert epoch.seconds > epoch.step_seconds > 0 and epoch.cpu_seconds >= epoch.trainer_cpu_seconds > 0
        assert epoch.trainer_cpu_seconds >= epoch.main_thread_cpu_seconds > 0
    assert all(math.isfinite(value) for change in rounds for value in change)


def test_the_files_pipeline_captures_the_instrumented_loaders_reads_alone(tmp_path: Path) -> None:
    """`jpeg-files`: each sample's file read through `open()`, captured in the instrumented loader's workers
    only, every byte of it (the plain loader's reads would double the bytes)."""
    received = Datagrams(str(tmp_path / "events.sock"))
    transport.configure(str(tmp_path / "events.sock"))
    try:
        pipeline_rounds(rounds=1, warmup=0, samples=128, decode="jpeg-files", rebuild_every=1)
        every_file_twice = 2 * sum(map(len, jpeg_images()))  # 128 samples an epoch, 64 files
        instrumented_epochs = 2
        wait_for("the captured reads", lambda: sum(row["bytes"] for row in received.rows("reads"))
                 >= instrumented_epochs * every_file_twice, 20)
        assert sum(row["bytes"] for row in received.rows("reads")) == instrumented_epochs * every_file_twice
    finally:
        transport.sender().close()
        received.close()


def test_each_run_is_a_fresh_process_whose_rounds_come_back(tmp_path: Path) -> None:
    runs = pipeline_runs(runs=2, rounds=2, warmup=1, samples=256, control=False, decode="matmul", rebuild_every=2,
                         events=str(tmp_path / "no-agent.sock"))  # no agent there: the reads are dropped
    assert len(runs) == 2
    for run in runs:
        assert len(run.rounds) == 2 and len(run.plain) == len(run.compared) == 4
        assert all(isinstance(epoch, Epoch) and epoch.seconds > epoch.step_seconds > 0 for epoch in run.plain)
        assert all(isinstance(change, Round) and math.isfinite(change.throughput) for change in run.rounds)
