"""One time axis, tested for real: a stall scripted at a known wall-clock time appears at that time in
Prometheus, in the GPU's series and in the correlator's.

A small training loop, instrumented by the client, reads through a real PyTorch DataLoader (worker
processes) and appends each step's compute span to the trace the agent's fake GPU follows, as the
demo's trainer does; a real agent receives its events and a real Prometheus scrapes the agent every
second. Running steadily, the dataset's `__getitem__` blocks for `STALL_S` from a set wall-clock
time, so the trainer waits from T0 (its prefetched batches used up) until T1, and the GPU idles
exactly then. The trainer's own clock gives T0 and T1. Prometheus is then asked over the run where
the stall lies:

- the GPU: where its utilization falls and rises again (half way between the scrapes either side);
- the correlator: where its cumulative stall seconds and GPU-idle seconds booked the stall. A counter
  published with its event time holds, at each sample's time, what happened until then: the interval
  in which it first rises by more than noise ends where the stall has lasted that increase, and the
  first interval after that not stalled throughout ends its increase after the interval's start.

Each edge must be within 1 s of the trainer's, and the seconds booked within 0.5 s of its wait; the GPU's
edges within that and the fake driver's longest silence more (a stretch of missing samples: the agent's
gauge holds the last sample until the next one comes). The correlator's window length is not assumed:
samples may come as often or as rarely as windows close, as long as a window boundary falls inside the
stall.

The same run checks the warm-up phase: its reads miss at first and hit after, so the job goes from
cold to steady (and leaves steady while it stalls); every phase sample in Prometheus must be the
phase of the window the correlator recorded as ending at that sample's time, within 1 s.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from stallwatch import catalogue as c
from stallwatch.client import ReadSpan, transport, wire
from stallwatch.client.torch import instrument
from stallwatch.demo.stack import query, start_prometheus
from stallwatch.exporters.nvml_fake import SAMPLE_PERIOD_S, ComputeTrace, DriverSampling
from stallwatch.harness import start_agent, stop_agent
from tests.conftest import require_binary

JOB = "aligned"
STEP_S = 0.05  # emulated compute per step
COLD_S = 2.0  # reads miss for this long from the start, then hit
STEADY_BEFORE_S = 6.0  # training before the stall
STALL_S = 6.0  # how long __getitem__ blocks
SETTLE_S = 30.0  # at most this long after the stall for the correlator's series to reach Prometheus
RESOLUTION_S = 0.5  # query_range step
TOLERANCE_S = 1.0  # the alignment asked for
# The driver's longest silence: `gap_samples` missing samples in a row (gap_samples + 1 periods between the
# samples either side), one more missing either side, and a sample's jitter.
DRIVER_SILENCE_S = (DriverSampling.gap_samples + 1 + 2 + DriverSampling.jitter) * SAMPLE_PERIOD_S
NOISE_S = 0.4  # stall seconds a steady interval may book (waits above the 1 ms threshold on a busy node)
IDLE_RATIO = 0.05  # utilization at or below this is idle

Sample = tuple[float, float]  # (Unix seconds, value)
STALL = f'{c.STALL_SECONDS.name}{{{c.JOB_LABEL}="{JOB}"}}'
GPU_IDLE = f'{c.GPU_STALL_IDLE_SECONDS.name}{{{c.JOB_LABEL}="{JOB}"}}'


class ScriptedDataset(Dataset[torch.Tensor]):
    """Cheap items, each one recorded read: a miss before `warm_at`, a hit after. Every item asked for
    in [block_at, block_at + STALL_S) waits until its end (outside its read: the spoke is not slow)."""

    def __init__(self, warm_at: float, block_at: float) -> None:
        self.warm_at, self.block_at = warm_at, block_at

    def __len__(self) -> int:
        return 1_000_000  # one epoch outlasts the run

    def __getitem__(self, index: int) -> torch.Tensor:
        now = time.time()
        if self.block_at <= now < self.block_at + STALL_S:
            time.sleep(self.block_at + STALL_S - now)
        with ReadSpan(f"https://hub/items/{index}") as span:
            span.bytes, span.verdict = 64, wire.VERDICT_MISS if now < self.warm_at else wire.VERDICT_HIT
        return torch.full((16,), float(index))


@dataclass(frozen=True)
class Run:
    prometheus: str
    windows: Path  # the correlator's record of every window it closed
    started: float
    ended: float
    waits: list[tuple[float, float]]  # every wait of the trainer's for a batch, as (start, end)

    @property
    def wait(self) -> tuple[float, float]:
        """The trainer's longest wait for a batch: (T0, T1)."""
        return max(self.waits, key=lambda wait: wait[1] - wait[0])

    @property
    def stalled_s(self) -> float:
        return self.wait[1] - self.wait[0]


def range_query(prometheus: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": start, "end": end, "step": RESOLUTION_S})
    with urllib.request.urlopen(url, timeout=10) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def series_samples(run: Run, selector: str) -> dict[str, list[Sample]]:
    """Each series' samples as scraped, at their own timestamps: query_range of the series and of
    `timestamp()` of it, one (timestamp, value) per distinct timestamp; keyed by the series' labels."""

    def labels(series: dict[str, Any]) -> str:  # timestamp() drops the metric name
        return json.dumps({k: v for k, v in series["metric"].items() if k != "__name__"}, sort_keys=True)

    begin, end = run.started - 5, run.ended
    values = {labels(s): dict(s["values"]) for s in range_query(run.prometheus, selector, begin, end)}
    stamps = {labels(s): s["values"] for s in range_query(run.prometheus, f"timestamp({selector})", begin, end)}
    return {key: sorted({float(stamp): float(values[key][t]) for t, stamp in stamps[key]}.items())
            for key in values}


def summed(series: dict[str, list[Sample]]) -> list[Sample]:
    """The sum of cumulative series at every timestamp any of them has a sample (each at its latest)."""
    stamps = sorted({t for samples in series.values() for t, _ in samples})
    return [(at, sum(next((v for t, v in reversed(samples) if t <= at), 0.0) for samples in series.values()))
            for at in stamps]


@dataclass(frozen=True)
class Span:
    start: float
    end: float
    seconds: float


def booked_stall(samples: list[Sample]) -> Span:
    """Where a cumulative series of stall seconds books the one long stall it holds (module docstring)."""
    intervals = [(t0, t1, v1 - v0) for (t0, v0), (t1, v1) in itertools.pairwise(samples)]
    first = next((i for i, (_, _, added) in enumerate(intervals) if added > NOISE_S), None)
    assert first is not None, f"no stall booked: {samples}"
    last = next((i for i in range(first + 1, len(intervals))
                 if intervals[i][2] < intervals[i][1] - intervals[i][0] - NOISE_S), None)
    assert last is not None, f"the stall's end was never booked: {samples}"
    return Span(intervals[first][1] - intervals[first][2], intervals[last][0] + intervals[last][2],
                sum(added for _, _, added in intervals[first:last + 1]))


def idle_span(samples: list[Sample]) -> Span:
    """The longest run of idle utilization samples, its edges half way to the busy samples either side."""
    runs = [list(group) for idle, group in itertools.groupby(range(len(samples)),
                                                             key=lambda i: samples[i][1] <= IDLE_RATIO) if idle]
    assert runs, f"the GPU never idled: {samples}"
    longest = max(runs, key=lambda run: samples[run[-1]][0] - samples[run[0]][0])
    first, last = longest[0], longest[-1]
    assert first > 0 and last < len(samples) - 1, f"the idle run is at an end of the series: {samples}"
    start, end = (samples[first - 1][0] + samples[first][0]) / 2, (samples[last][0] + samples[last + 1][0]) / 2
    return Span(start, end, end - start)


def train(loader: Any, trace: Path, block_at: float,
          settled: Callable[[tuple[float, float]], bool]) -> tuple[float, list[tuple[float, float]]]:
    """Steady steps, the scripted stall, then steps until `settled(longest wait)` (asked once a second, on a
    thread of its own: the queries take longer than a step on a busy machine, and the GPU would idle through
    them, moving the idle span's end); when training started, and every wait for a batch."""
    started = time.time()
    longest = (0.0, 0.0)
    waits: list[tuple[float, float]] = []
    done = threading.Event()  # settled, or training over

    def ask() -> None:
        while not done.wait(1.0):
            if longest[1] > block_at + STALL_S and settled(longest):  # the scripted wait is over
                done.set()
                return

    asking = threading.Thread(target=ask, name="settled", daemon=True)
    asking.start()
    batches = iter(loader)
    try:
        while not done.is_set() and time.time() < block_at + STALL_S + SETTLE_S:
            wait_start = time.time()
            next(batches)
            step_start = time.time()
            ComputeTrace.append_span(trace, step_start, step_start + STEP_S)
            waits.append((wait_start, step_start))
            if step_start - wait_start > longest[1] - longest[0]:
                longest = (wait_start, step_start)
            time.sleep(max(0.0, step_start + STEP_S - time.time()))
    finally:
        done.set()
        asking.join()
    del batches  # its workers stop
    return started, waits


def settled(prometheus: str, wait: tuple[float, float]) -> bool:
    """Both correlator series hold the stall, and samples from after its end."""
    for selector in (STALL, GPU_IDLE):
        total = query(prometheus, f"sum({selector})")["data"]["result"]
        newest = query(prometheus, f"max(timestamp({selector}))")["data"]["result"]
        if (not total or float(total[0]["value"][1]) < wait[1] - wait[0] - 0.5
                or float(newest[0]["value"][1]) < wait[1] + 1):
            return False
    return True


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    prometheus_bin = require_binary("prometheus", "prometheus")
    work = tmp_path_factory.mktemp("alignment")
    socket_path = os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")
    trace, windows = work / "compute.trace", work / "windows.jsonl"
    trace.touch()
    agent = start_agent(["--events.socket", socket_path, "--gpu.fake-devices", "1", "--gpu.fake-trace", str(trace),
                         "--gpu.interval", "0.1", "--no-collector.host", "--correlator.record-windows", str(windows)],
                        work / "agent.log")
    try:
        prom = start_prometheus(prometheus_bin, work / "prometheus", [agent.base.removeprefix("http://")], [])
        try:
            transport.configure(socket_path)
            try:
                now = time.time()
                dataset = ScriptedDataset(warm_at=now + COLD_S, block_at=now + STEADY_BEFORE_S)
                loader = instrument(DataLoader(dataset, batch_size=4, num_workers=2, prefetch_factor=2),
                                    job=JOB, rank=0, gpu=0)
                started, waits = train(loader, trace, dataset.block_at, lambda wait: settled(prom.url, wait))
            finally:
                transport.sender().close()
            time.sleep(2.0)  # the last scrapes
            yield Run(prom.url, windows, started, time.time(), waits)
        finally:
            prom.close()
    finally:
        stop_agent(agent)


@pytest.mark.slow
def test_a_scripted_stall_lines_up_in_prometheus_from_the_gpu_and_the_correlator(run: Run) -> None:
    t0, t1 = run.wait
    assert run.stalled_s == pytest.approx(STALL_S, abs=1.0), run  # the script ran as planned
    utilization = series_samples(run, f'{c.GPU_UTILIZATION.name}{{gpu="0"}}')
    assert len(utilization) == 1, utilization
    counters = {name: summed(series_samples(run, selector)) for name, selector in (("stall", STALL),
                                                                                   ("gpu idle", GPU_IDLE))}
    spans = {"gpu": idle_span(next(iter(utilization.values())))} | {
        name: booked_stall(samples) for name, samples in counters.items()}
    report = ", ".join(f"{name} {span.start - t0:+.2f} s / {span.end - t1:+.2f} s / {span.seconds:.2f} s"
                       for name, span in spans.items())
    for name, samples in counters.items():
        report += f"; {name} seconds from T0: " + " ".join(f"{t - t0:+.1f}:{v:.2f}" for t, v in samples)
    report += "; gpu utilization from T0: " + " ".join(
        f"{t - t0:+.2f}:{v:.0f}" for t, v in next(iter(utilization.values())) if t0 - 3 <= t <= t1 + 3)
    report += "; the trainer's waits over 20 ms from T0: " + " ".join(
        f"{start - t0:+.2f}..{end - t0:+.2f}" for start, end in run.waits
        if end - start > 0.02 and t0 - 3 <= end <= t1 + 3)
    print(f"\nstart / end offsets from the trainer's wait, seconds ({run.stalled_s:.2f} s): {report}")
    for name, span in spans.items():
        tolerance = TOLERANCE_S + (DRIVER_SILENCE_S if name == "gpu" else 0.0)
        assert abs(span.start - t0) <= tolerance and abs(span.end - t1) <= tolerance, f"{name} is off: {report}"
    for name in counters:  # the counters' own seconds; the GPU's edges are only known to a scrape interval
        assert spans[name].seconds == pytest.approx(run.stalled_s, abs=0.5), f"{name} booked wrong: {report}"


@pytest.mark.slow
def test_warmup_phase_samples_are_the_phases_of_the_windows_ending_then(run: Run) -> None:
    by_phase = {json.loads(key)["phase"]: samples
                for key, samples in series_samples(run, f'{c.WARMUP_PHASE.name}{{{c.JOB_LABEL}="{JOB}"}}').items()}
    stamps = sorted({t for samples in by_phase.values() for t, _ in samples})
    shown = [(at, next((p for p, samples in by_phase.items() if dict(samples).get(at) == 1), "none")) for at in stamps]
    phases = {phase for _, phase in shown}
    assert c.PHASES[2] in phases and len(phases) > 1, shown  # it reached steady from another phase
    ends = [(window["end_s"], job["phase"]) for window in map(json.loads, run.windows.read_text().splitlines())
            for job in window["jobs"] if job["job"] == JOB]  # Unix seconds
    off = []
    for at, phase in shown:
        end, window_phase = min(ends, key=lambda window: abs(window[0] - at))
        if abs(end - at) > TOLERANCE_S or window_phase != phase:
            off.append(f"{phase} at {at - run.started:.2f} s: nearest window ends at {end - run.started:.2f} s, "
                       f"{window_phase}")
    assert not off, f"{len(off)} of {len(shown)} phase samples off: " + "; ".join(off[:8])


def windowed(stall: tuple[float, float], window_s: float, late_s: float, every: int = 1) -> list[Sample]:
    """A cumulative stall counter as a correlator publishing every `every`-th window's end would, stamped
    `late_s` after it, over 40 s: the stall's seconds so far and 10 ms of steady waits a window."""
    ends = [window_s * k for k in range(1, int(40 / window_s) + 1)][::every]
    return [(end + late_s, min(max(end - stall[0], 0.0), stall[1] - stall[0]) + 0.01 * end / window_s)
            for end in ends]


@pytest.mark.parametrize("window_s", [1.0, 2.0, 5.0])
@pytest.mark.parametrize("every", [1, 2])
def test_the_booked_stall_is_found_at_any_window_length_and_lateness_shows(window_s: float, every: int) -> None:
    for t0 in (10.05, 10.5, 12.95):
        stall = (t0, t0 + STALL_S)
        on_time = booked_stall(windowed(stall, window_s, 0.0, every))
        assert on_time.start == pytest.approx(t0, abs=0.1) and on_time.end == pytest.approx(t0 + STALL_S, abs=0.1)
        assert on_time.seconds == pytest.approx(STALL_S, abs=0.2)
        late = booked_stall(windowed(stall, window_s, 5.0, every))  # stamped at scrape time, a lateness late
        assert late.start - t0 == pytest.approx(5.0, abs=0.1) and late.end - stall[1] == pytest.approx(5.0, abs=0.1)
