"""Attribution of a real PyTorch DataLoader's stalls, through the real client and agent, against the
harness's own timing of every read, every decode and every batch's handover.

The dataset records its reads through the client (`ReadSpan`, with the verdict a spoke header would
give) and also notes, for the truth, when each read and each decode ran; its collate function notes
when it finished the batch (the handover). The trainer notes each wait itself. Per stall the truth
is then: the awaited batch's missed reads `remote_fetch`, its other reads `cache_read`, the rest of
its worker's time on it until the handover `preprocess`, after the handover `delivery` (pickling,
the result queue, unpickling), before its first read `other`. The agent records the events it
receives to a file, which the offline correlator replays; every cause must be within 5 % of its
truth or 0.5 s, whichever is larger.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader, Dataset

from stallwatch.catalogue import CAUSES, RECEIVER_EVENTS
from stallwatch.client import ReadSpan, transport, wire
from stallwatch.client.torch import instrument
from stallwatch.correlator.attribution import CACHE, DELIVERY, OTHER, PREPROCESS, REMOTE
from stallwatch.correlator.eventfile import read_events
from stallwatch.correlator.pipeline import CorrelatorPipeline
from stallwatch.correlator.results import WindowResult
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.harness import AgentProcess, scrape, stop_agent, total, wait_for

pytestmark = pytest.mark.slow
Span = tuple[int, int]


@dataclass(frozen=True)
class Load:
    """What reading and decoding one item costs, and how large a batch is to hand over."""

    miss_s: float  # a read that goes to the hub, in the first epoch
    hit_s: float  # a read the spoke serves, in later epochs
    decode_s: float
    item_bytes: int


class TimedDataset(Dataset[dict[str, Any]]):
    """One read per item (recorded by the client and noted for the truth), then decoding. An item read
    before, by any worker of any epoch (a marker file in `spoke`), is a spoke hit."""

    def __init__(self, items: int, load: Load, spoke: Path) -> None:
        self.items, self.load, self.spoke = items, load, spoke

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> dict[str, Any]:
        load, clock = self.load, time.monotonic_ns
        marker = self.spoke / str(index)
        miss = not marker.exists()
        marker.touch()
        with ReadSpan(f"https://hub/items/{index}") as span:
            start = clock()
            time.sleep(load.miss_s if miss else load.hit_s)
            span.bytes, span.verdict = load.item_bytes, wire.VERDICT_MISS if miss else wire.VERDICT_HIT
            end = clock()
        time.sleep(load.decode_s)
        return {"payload": bytes(load.item_bytes), "read": (start, end, miss)}


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The batch as plain bytes (pickled through the worker's result queue) and its truth."""
    batch: dict[str, Any] = {"payload": [s["payload"] for s in samples], "reads": [s["read"] for s in samples]}
    batch["handover"] = time.monotonic_ns()
    return batch


def union(spans: list[Span]) -> int:
    covered, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            covered, reach = covered + end - start, end
        elif end > reach:
            covered, reach = covered + end - reach, end
    return covered


def true_split(wait: Span, reads: list[tuple[int, int, bool]], handover: int) -> np.ndarray:
    start, end = wait
    ready = min(max(handover, start), end)

    def clip(spans: list[Span]) -> list[Span]:
        return [(min(max(s, start), ready), min(max(e, start), ready)) for s, e in spans]

    missed = union(clip([(s, e) for s, e, miss in reads if miss]))
    covered = union(clip([(s, e) for s, e, _ in reads]))
    busy = ready - min(max(min(s for s, _, _ in reads), start), ready)
    split = np.zeros(len(CAUSES))
    split[[REMOTE, CACHE, PREPROCESS, DELIVERY]] = missed, covered - missed, busy - covered, end - ready
    split[OTHER] = (end - start) - split.sum()
    return split / 1e9


def train(loader: DataLoader[Any], epochs: int, compute_s: float) -> np.ndarray:
    """Iterate like a training loop, noting each wait; the truth of the stalls, summed per cause."""
    truth = np.zeros(len(CAUSES))
    for _ in range(epochs):
        batches = iter(loader)
        while True:
            wait_start = time.monotonic_ns()
            batch = next(batches, None)
            wait_end = time.monotonic_ns()
            if batch is None:
                break
            if wait_end - wait_start > 1_000_000:  # the correlator's stall threshold
                truth += true_split((wait_start, wait_end), batch["reads"], batch["handover"])
            time.sleep(compute_s)
    return truth


def received(agent: AgentProcess) -> tuple[float, float]:
    """The steps and the reads the agent has accepted."""
    samples = scrape(agent.url)
    return total(samples, RECEIVER_EVENTS.name, kind="step"), total(samples, RECEIVER_EVENTS.name, kind="read")


def attributed(events: Path) -> np.ndarray:
    windows: list[WindowResult] = []
    CorrelatorPipeline(CorrelatorSettings(), listeners=[windows.append]).run(read_events(events))
    # A stall cut at a window boundary comes back with the later window, its earlier pieces in `earlier`.
    return sum((np.array(r.stall_s) for w in windows for part in (w, *w.earlier) for r in part.ranks),
               np.zeros(len(CAUSES)))


SCENARIOS: dict[str, tuple[Load, dict[str, Any], int, float]] = {
    # local data, no decoding, large batches: the stall is the batch's trip from its worker
    "delivery": (Load(0.0005, 0.0005, 0.0, 4 << 20), {"num_workers": 2, "batch_size": 8}, 2, 0.002),
    "cold then warm": (Load(0.03, 0.002, 0.004, 512 << 10), {"num_workers": 4, "batch_size": 8}, 3, 0.01),
    "decode-bound": (Load(0.002, 0.002, 0.03, 256 << 10), {"num_workers": 2, "batch_size": 8}, 2, 0.01),
    "no workers": (Load(0.02, 0.002, 0.005, 512 << 10), {"num_workers": 0, "batch_size": 8}, 2, 0.01),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_cause_of_a_real_loader_is_within_five_percent_of_its_truth(
        name: str, agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    load, options, epochs, compute_s = SCENARIOS[name]
    socket_path = os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")
    events = tmp_path / "events.bin"
    agent = agent_factory("--events.socket", socket_path, "--no-collector.gpu", "--no-collector.host",
                          "--correlator.record-events", str(events))
    transport.configure(socket_path)
    try:
        (tmp_path / "spoke").mkdir()
        dataset = TimedDataset(96, load, tmp_path / "spoke")
        loader = instrument(DataLoader(dataset, collate_fn=collate, **options), job=name, rank=0)
        truth = train(loader, epochs, compute_s)
    finally:
        transport.sender().close()
    steps, reads = epochs * len(loader), epochs * len(dataset)
    wait_for("every step and read at the agent", lambda: received(agent) == (steps, reads), 30, agent.process,
             agent.log)
    stop_agent(agent)
    got = attributed(events)
    assert got.sum() == pytest.approx(truth.sum(), rel=0.05, abs=0.5)
    for cause, have, want in zip(CAUSES, got, truth, strict=True):
        assert abs(have - want) <= max(0.05 * want, 0.5), f"{cause}: {have:.2f} s attributed, truth {want:.2f} s"
    if name == "delivery":
        assert truth[DELIVERY] > 0.5 * truth.sum() and got[PREPROCESS] < 0.5
