"""The gpu collector against a fake NVML that behaves like pynvml: values, units, dips, failures."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pynvml
import pytest
from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.eventbatch import EventBatch
from stallwatch.exporters.gpu import GpuCollector, error_label
from stallwatch.exporters.nvml_fake import ComputeTrace, DriverSampling, FakeGpu, FakeNVML, constant, steps
from stallwatch.harness import wait_for


class Clock:
    """The node's clocks, driven by the test: monotonic seconds (calling it) and the wall clock a fixed
    `wall_minus_monotonic` ahead, which the fake NVML stamps its samples with."""

    def __init__(self, now: float = 5_000.0, wall_minus_monotonic: float = 1_700_000_000.0) -> None:
        self.now = now
        self.wall_minus_monotonic = wall_minus_monotonic

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self.wall_minus_monotonic

    def wall_offset_ns(self) -> int:
        return round(self.wall_minus_monotonic * 1e9)

    def advance(self, seconds: float) -> None:
        self.now += seconds


Make = Callable[..., tuple[FakeNVML, GpuCollector, list[EventBatch]]]


@pytest.fixture
def make() -> Iterator[Make]:
    """A collector on fake GPUs that reads only the test's clock and starts no poll thread; closed after."""
    made: list[GpuCollector] = []

    def build(gpus: list[FakeGpu], clock: Clock, sampling: DriverSampling | None = None,
              interval: float = 0.5) -> tuple[FakeNVML, GpuCollector, list[EventBatch]]:
        nvml = FakeNVML(gpus, clock=clock.wall, sample_period=0.1, pcie_latency=0.0, sampling=sampling)
        batches: list[EventBatch] = []
        collector = GpuCollector(nvml, start=False, clock=clock, wall_offset=clock.wall_offset_ns,
                                 sink=batches.append, interval=interval)
        made.append(collector)
        return nvml, collector, batches

    yield build
    for collector in made:
        collector.close()


def samples(collector: GpuCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in collector.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(readings: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return readings[(name, tuple(sorted(labels.items())))]


def has(readings: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> bool:
    return (name, tuple(sorted(labels.items()))) in readings


def test_reads_every_field_in_base_units(make: Make) -> None:
    clock = Clock()
    _, collector, _ = make([FakeGpu(utilization=constant(80), pids=(4242, 4343)), FakeGpu()], clock)
    collector.poll()
    clock.advance(1.0)
    collector.poll()
    r = samples(collector)
    c = catalogue
    assert value(r, c.GPU_DEVICES.name) == 2
    assert value(r, c.GPU_UP.name, gpu="0") == 1
    assert value(r, c.GPU_UTILIZATION.name, gpu="0") == pytest.approx(0.80)
    assert value(r, c.GPU_POWER.name, gpu="0") == pytest.approx((90_000 + 610_000 * 0.8) / 1000, rel=1e-3)
    assert value(r, c.GPU_SM_CLOCK.name, gpu="0") == 1980e6
    assert value(r, c.GPU_MEMORY_CLOCK.name, gpu="0") == 2619e6
    assert value(r, c.GPU_MEMORY_TOTAL.name, gpu="0") == 143_771 * 1024 * 1024
    assert value(r, c.GPU_TEMPERATURE.name, gpu="0") == 35 + 32
    # energy: watts x seconds between the two reads, reported in joules
    assert value(r, c.GPU_ENERGY.name, gpu="0") == pytest.approx(578.0, rel=1e-2)
    assert value(r, c.GPU_PCIE_THROUGHPUT.name, gpu="0", direction="rx") == 9_600_000 * 1024
    assert value(r, c.GPU_PROCESSES.name, gpu="0") == 2
    assert value(r, c.GPU_CLOCKS_EVENT_REASON.name, gpu="0", reason="gpu_idle") == 0
    info = [k for k in r if k[0] == c.GPU_INFO.name]
    assert len(info) == 2 and dict(info[0][1])["name"] == "NVIDIA H200"


def test_a_200ms_dip_between_polls_is_seen(make: Make) -> None:
    clock = Clock()
    start = clock.now
    # busy, then 200 ms at 0 %, then busy again, all between two one-second polls
    _, collector, batches = make([FakeGpu(utilization=steps((1.4, 100), (0.2, 0)))], clock, interval=1.0)
    collector.poll()
    clock.advance(1.0)
    collector.poll()
    clock.advance(1.0)
    collector.poll()
    r = samples(collector)
    assert value(r, catalogue.GPU_UTILIZATION.name, gpu="0") == 1.0  # the instantaneous rate misses it
    assert value(r, catalogue.GPU_IDLE_SECONDS.name, gpu="0") == pytest.approx(0.2, abs=0.01)
    assert value(r, catalogue.GPU_UTILIZATION_SAMPLES.name, gpu="0") == 21  # 0.0 .. 2.0 every 100 ms
    joined = [b for b in batches if b.kind == "gpu_util"]
    utils = [float(u) for b in joined for u in b.columns["util"]]
    assert utils.count(0.0) == 2 and len(utils) == 21
    # Each read once, at the driver's instant on the node's monotonic clock (NVML stamps them on the wall clock).
    stamps = [int(t) for b in joined for t in b.columns["ts_ns"]]
    assert stamps == pytest.approx([round((start + k * 0.1) * 1e9) for k in range(21)], abs=1_000)


def test_idle_seconds_are_the_gpus_idle_time_when_samples_mix_compute_and_idle(make: Make) -> None:
    """An input-bound job (60 ms of compute, then 140 ms waiting for data) under a driver that samples every
    100 ms, irregularly, each sample the mean since the one before: nearly every sample mixes compute and
    idle, and the counter still adds up to the time the GPU ran nothing."""
    clock = Clock()
    begin, run = clock.wall(), 60.0
    compute = [(begin + t, begin + t + 0.06) for t in np.arange(0.0, run, 0.2)]
    _, collector, batches = make([FakeGpu(trace=ComputeTrace.of_spans(compute))], clock, sampling=DriverSampling())
    while clock.wall() < begin + run:
        collector.poll()
        clock.advance(0.5)
    utils = np.concatenate([b.columns["util"] for b in batches])
    last = float(batches[-1].columns["ts_ns"][-1]) / 1e9 + clock.wall_minus_monotonic
    assert np.mean((utils > 0.05) & (utils < 0.9)) > 0.8  # mixed samples, as the real-loader runs showed
    busy = sum(min(end, last) - start for start, end in compute if start < last)
    idle = (last - begin) - 0.97 * busy  # the fake GPU computes at 97 %: 3 % of a span is idle too
    assert value(samples(collector), catalogue.GPU_IDLE_SECONDS.name, gpu="0") == pytest.approx(idle, rel=0.02)


def test_minimum_of_each_poll_window(make: Make) -> None:
    clock = Clock()
    _, collector, _ = make([FakeGpu(utilization=steps((1.4, 100), (0.2, 0)))], clock)
    collector.poll()
    clock.advance(1.0)
    collector.poll()
    assert value(samples(collector), catalogue.GPU_UTILIZATION_MIN.name, gpu="0") == 1.0
    clock.advance(0.01)  # within the driver's sample period: no new sample, and the series stays in the scrape
    collector.poll()
    assert value(samples(collector), catalogue.GPU_UTILIZATION_MIN.name, gpu="0") == 1.0
    clock.advance(1.0)
    collector.poll()
    assert value(samples(collector), catalogue.GPU_UTILIZATION_MIN.name, gpu="0") == 0.0


def test_not_supported_degrades_one_metric_and_is_counted_once(make: Make) -> None:
    clock = Clock()
    nvml, collector, _ = make(
        [FakeGpu(unsupported=frozenset({"nvmlDeviceGetPowerUsage", "nvmlDeviceGetSamples"})), FakeGpu()], clock
    )
    for _ in range(3):
        collector.poll()
        clock.advance(0.5)
    r = samples(collector)
    assert not has(r, catalogue.GPU_POWER.name, gpu="0")
    assert has(r, catalogue.GPU_POWER.name, gpu="1")
    assert has(r, catalogue.GPU_UTILIZATION.name, gpu="0")
    errors = catalogue.GPU_NVML_ERRORS.name
    assert value(r, errors, gpu="0", call="nvmlDeviceGetPowerUsage", error="not_supported") == 1
    assert value(r, errors, gpu="0", call="nvmlDeviceGetSamples", error="not_supported") == 1
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 3 + 1  # gpu 1 three times, gpu 0 once


def test_lost_gpu_goes_down_the_others_keep_serving(make: Make) -> None:
    clock = Clock()
    _, collector, _ = make([FakeGpu(lost_at=1.0), FakeGpu()], clock)
    collector.poll()
    clock.advance(1.5)
    collector.poll()
    r = samples(collector)
    assert value(r, catalogue.GPU_UP.name, gpu="0") == 0
    assert not has(r, catalogue.GPU_UTILIZATION.name, gpu="0")
    assert value(r, catalogue.GPU_UP.name, gpu="1") == 1
    assert value(r, catalogue.GPU_UTILIZATION.name, gpu="1") == 1.0
    errors = catalogue.GPU_NVML_ERRORS.name
    assert value(r, errors, gpu="0", call="nvmlDeviceGetUtilizationRates", error="gpu_is_lost") == 1


def test_no_gpu_is_said_once_and_the_collector_still_answers(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    nvml = FakeNVML([], clock=clock.wall, library_present=False)
    collector = GpuCollector(nvml, start=False, clock=clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            collector.poll()
            clock.advance(60)
    said = [r.message for r in caplog.records if "no GPU" in r.message]
    assert len(said) == 1, said
    r = samples(collector)
    assert value(r, catalogue.GPU_DEVICES.name) == 0
    assert value(r, catalogue.GPU_NVML_ERRORS.name, gpu="", call="nvmlInit", error="library_not_found") >= 1


def test_driver_gone_mid_run_marks_every_gpu_down_then_recovers(make: Make) -> None:
    clock = Clock()
    nvml, collector, _ = make([FakeGpu(), FakeGpu()], clock)
    collector.poll()
    nvml.unload_driver()
    clock.advance(1)
    collector.poll()
    r = samples(collector)
    assert value(r, catalogue.GPU_UP.name, gpu="0") == 0 and value(r, catalogue.GPU_UP.name, gpu="1") == 0
    assert value(r, catalogue.GPU_NVML_ERRORS.name, gpu="0", call="nvmlDeviceGetUtilizationRates",
                 error="driver_not_loaded") == 1
    nvml._driver_loaded = True  # the driver comes back
    clock.advance(31)
    collector.poll()
    collector.poll()
    assert value(samples(collector), catalogue.GPU_UP.name, gpu="1") == 1
    collector.close()


def test_xid_events_are_counted_per_gpu_and_code(make: Make) -> None:
    # NVML's event wait blocks on its own thread, which the first read starts: wait for what it counts.
    _, collector, _ = make([FakeGpu(), FakeGpu(xids=((0.0, 79), (0.0, 48)))], Clock())
    collector.poll()
    name = catalogue.GPU_XID_ERRORS.name
    wait_for("both XIDs of GPU 1", lambda: has(samples(collector), name, gpu="1", xid="79")
             and has(samples(collector), name, gpu="1", xid="48"), 10)
    r = samples(collector)
    assert value(r, name, gpu="1", xid="79") == 1 and value(r, name, gpu="1", xid="48") == 1
    assert not any(k[0] == name and dict(k[1])["gpu"] == "0" for k in r)


def test_error_labels_are_short_and_bounded() -> None:
    assert error_label(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) == "gpu_is_lost"
    assert error_label(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)) == "not_supported"
    assert error_label(pynvml.NVMLError(12345)) == "code_12345"


def test_a_broken_collect_never_reaches_the_scrape(make: Make) -> None:
    from stallwatch.exporters.collector import ScrapeCollector

    class Broken:
        def collect(self) -> list[Metric]:
            raise RuntimeError("boom")

        def close(self) -> None:
            pass

    clock = Clock()
    _, gpu, _ = make([FakeGpu()], clock)
    gpu.poll()
    families = list(ScrapeCollector({"broken": Broken(), "gpu": gpu}).collect())
    success = {s.labels["collector"]: s.value for f in families if f.name == catalogue.SCRAPE_COLLECTOR_SUCCESS.name
               for s in f.samples}
    assert success == {"broken": 0.0, "gpu": 1.0}
    assert any(f.name == catalogue.GPU_UTILIZATION.name for f in families)


def test_a_fake_gpu_can_follow_the_compute_spans_of_a_real_process(make: Make, tmp_path: Path) -> None:
    clock = Clock()
    trace_file = tmp_path / "gpu.trace"
    _, collector, batches = make([FakeGpu(trace=ComputeTrace(trace_file))], clock)
    start = clock.wall()
    ComputeTrace.append_span(trace_file, start + 0.0, start + 0.5)  # busy 0.5 s, idle 0.5 s, busy 0.5 s
    ComputeTrace.append_span(trace_file, start + 1.0, start + 1.5)
    collector.poll()
    clock.advance(1.45)
    collector.poll()
    utils = [round(float(u), 2) for b in batches for u in b.columns["util"]]
    assert utils == [0.97] * 5 + [0.0] * 5 + [0.97] * 5
    # idle 0.5 s, and 3 % of the 1.0 s the GPU computes at 97 %
    assert value(samples(collector), catalogue.GPU_IDLE_SECONDS.name, gpu="0") == pytest.approx(0.53, abs=0.005)
