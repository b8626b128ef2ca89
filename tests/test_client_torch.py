"""A real PyTorch DataLoader with four workers, through the real client, into the agent."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from stallwatch.client import RecordedFile, transport
from stallwatch.client.keys import read_key
from stallwatch.client.torch import instrument
from stallwatch.eventbatch import EventBatch
from stallwatch.exporters.events import EventsCollector
from stallwatch.harness import scrape, start_agent, stop_agent, wait_for

pytestmark = pytest.mark.slow
READ_DELAY = 0.002
CHUNK = 1024


class SlowFile:
    """A real file whose every read first waits READ_DELAY: storage slower than this machine's disk."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("rb")

    def read(self, size: int = -1) -> bytes:
        time.sleep(READ_DELAY)
        return self._file.read(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


class FileDataset(Dataset[torch.Tensor]):
    """Reads each file in CHUNK-sized reads, each slowed by READ_DELAY; returns the sample's index."""

    def __init__(self, paths: list[Path], slow_every: int = 0) -> None:
        self.paths = paths
        self.slow_every = slow_every

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.slow_every and index % self.slow_every == 0:
            time.sleep(0.03)  # a straggler, so that batches finish out of order
        with RecordedFile(SlowFile(self.paths[index]), str(self.paths[index])) as file:  # type: ignore[arg-type]
            while file.read(CHUNK):
                pass
        return torch.tensor(index)


def read_offsets(size: int) -> list[int]:
    return [*range(0, size, CHUNK), size]  # the chunks with data, then the empty read that ends the loop


def reads_per_file(size: int) -> int:
    return len(read_offsets(size))


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    paths = []
    for index in range(32):
        path = tmp_path / "data" / f"sample-{index:03d}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(500 + 311 * index))
        paths.append(path)
    return paths


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[str]:
    socket_path = tmp_path / "run" / "events.sock"
    agent = start_agent(["--events.socket", str(socket_path), "--no-collector.gpu"], tmp_path / "agent.log", timeout=60)
    transport.configure(str(socket_path))
    try:
        yield agent.url
    finally:
        transport.sender().close()
        stop_agent(agent)


def test_loader_waits_and_worker_reads_reach_the_agent_per_rank(agent: str, files: list[Path]) -> None:
    measured: dict[int, dict[str, float]] = {}
    for rank, epochs in ((0, 1), (1, 2)):
        loader = instrument(DataLoader(FileDataset(files), batch_size=4, num_workers=4), job="e2e", rank=rank)
        steps, waited, computed = 0, 0.0, 0.0
        for _ in range(epochs):
            batches = iter(loader)
            while True:
                before = time.monotonic()
                try:
                    next(batches)
                except StopIteration:
                    break
                waited += time.monotonic() - before
                time.sleep(0.005)
                computed += 0.005
                steps += 1
        measured[rank] = {
            "steps": steps, "waited": waited, "computed": computed,
            "reads": epochs * sum(reads_per_file(p.stat().st_size) for p in files),
            "bytes": epochs * sum(p.stat().st_size for p in files),
        }

    def labels(rank: int, **extra: str) -> tuple[tuple[str, str], ...]:
        return tuple(sorted({"training_job": "e2e", "rank": str(rank), **extra}.items()))

    def everything_arrived() -> bool:
        metrics = scrape(agent)
        return all(
            metrics.get(("stallwatch_loader_wait_seconds_count", labels(rank))) == m["steps"]
            and metrics.get(("stallwatch_dataset_reads_total", labels(rank, verdict="unknown"))) == m["reads"]
            for rank, m in measured.items()
        )

    wait_for("every step and read at the agent", everything_arrived, 30)
    metrics = scrape(agent)
    for rank, m in measured.items():
        assert m["steps"] == 8 * (rank + 1)
        assert metrics[("stallwatch_step_compute_seconds_count", labels(rank))] == m["steps"]
        assert metrics[("stallwatch_dataset_read_bytes_total", labels(rank))] == m["bytes"]
        assert metrics[("stallwatch_dataset_read_duration_seconds_count", labels(rank))] == m["reads"]
        # The client's wait lies inside the test's own timing of next(); the reads include their delay.
        wait_sum = metrics[("stallwatch_loader_wait_seconds_sum", labels(rank))]
        assert 0.5 * m["waited"] <= wait_sum <= m["waited"]
        assert metrics[("stallwatch_step_compute_seconds_sum", labels(rank))] >= m["computed"]
        assert metrics[("stallwatch_dataset_read_duration_seconds_sum", labels(rank))] >= m["reads"] * READ_DELAY
        assert metrics[("stallwatch_client_dropped_events_total", labels(rank))] == 0
    assert not any(name == "stallwatch_receiver_batches_total" and dict(label)["result"] != "accepted"
                   for name, label in metrics)


class FileStream(IterableDataset[torch.Tensor]):
    """The same files as an iterable dataset, each worker streaming its own share of them."""

    def __init__(self, paths: list[Path]) -> None:
        self.files = FileDataset(paths)

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        share = range(len(self.files)) if info is None else range(info.id, len(self.files), info.num_workers)
        return (self.files[index] for index in share)


def assert_every_read_carries_its_batch(tmp_path: Path, files: list[Path], loader: DataLoader[Any],
                                        epochs: int, workers: set[int]) -> None:
    """Iterate `loader` into a real receiver; each step's number names exactly the reads of its samples."""
    socket_path = tmp_path / "events.sock"
    received: list[EventBatch] = []
    collector = EventsCollector(str(socket_path), sink=received.append)
    transport.configure(str(socket_path))
    try:
        served: list[list[int]] = []  # sample indices of each batch, in the order the loop got them
        for _ in range(epochs):
            served += [batch.tolist() for batch in loader]
        expected_reads = epochs * sum(reads_per_file(p.stat().st_size) for p in files)

        def rows(kind: str) -> int:
            return sum(len(b) for b in received if b.kind == kind)

        wait_for("every read and step in the recording",
                 lambda: rows("read") == expected_reads and rows("step") == len(served), 30)
    finally:
        transport.sender().close()
        collector.close()
    steps = [b.columns for b in received if b.kind == "step"]
    step_batches = [int(k) for columns in steps for k in columns["batch"]]
    first = min(step_batches)  # the process's count: loaders iterated before this one took numbers too
    assert sorted(step_batches) == list(range(first, first + len(served))), "one number per batch, across epochs"
    keys_by_batch: dict[int, set[int]] = {}
    seen_workers = set()
    for columns in (b.columns for b in received if b.kind == "read"):
        for batch, key, worker in zip(columns["batch"], columns["key"], columns["worker"], strict=True):
            keys_by_batch.setdefault(int(batch), set()).add(int(key))
            seen_workers.add(int(worker))
    assert seen_workers == workers
    for number, indices in zip(step_batches, served, strict=True):
        file_keys = {read_key(str(files[i]), offset)
                     for i in indices for offset in read_offsets(files[i].stat().st_size)}
        assert keys_by_batch[number] == file_keys


def test_every_read_is_tagged_with_the_batch_it_served_even_out_of_order(tmp_path: Path, files: list[Path]) -> None:
    loader = DataLoader(FileDataset(files, slow_every=5), batch_size=4, num_workers=4, in_order=False,
                        persistent_workers=True)
    assert_every_read_carries_its_batch(tmp_path, files, instrument(loader, job="tags", rank=0), 2, {0, 1, 2, 3})


def test_reads_of_an_iterable_dataset_are_tagged_too(tmp_path: Path, files: list[Path]) -> None:
    loader = DataLoader(FileStream(files), batch_size=3, num_workers=2, prefetch_factor=3)
    assert_every_read_carries_its_batch(tmp_path, files, instrument(loader, job="stream", rank=0), 1, {0, 1})


def test_reads_in_the_main_process_are_tagged_too(tmp_path: Path, files: list[Path]) -> None:
    loader = DataLoader(FileDataset(files[:12]), batch_size=5, shuffle=True)
    assert_every_read_carries_its_batch(tmp_path, files[:12], instrument(loader, job="main", rank=0), 2, {-1})


TRAINER_THAT_EXITS_AT_ONCE = """
import sys
from pathlib import Path
from torch.utils.data import DataLoader
from stallwatch.client import transport
from stallwatch.client.torch import instrument
from tests.test_client_torch import FileDataset
transport.configure(sys.argv[1])
loader = DataLoader(FileDataset([Path(p) for p in sys.argv[2:]]), batch_size=4, num_workers=2, persistent_workers=True)
for epoch in range(2):
    for batch in instrument(loader, job="quick", rank=0):
        pass
"""


def test_persistent_workers_of_a_trainer_that_exits_at_once_flush_their_reads(tmp_path: Path,
                                                                              files: list[Path]) -> None:
    """The trainer leaves right after its last epoch, long before a worker's periodic flush: every read arrives
    (multiprocessing's exit hook used to terminate the workers before they could flush: none did)."""
    socket_path = tmp_path / "run" / "events.sock"
    agent = start_agent(["--events.socket", str(socket_path), "--no-collector.gpu", "--no-collector.correlator"],
                        tmp_path / "agent.log", timeout=60)
    try:
        subprocess.run([sys.executable, "-c", TRAINER_THAT_EXITS_AT_ONCE, str(socket_path), *map(str, files)],
                       cwd=Path(__file__).parent.parent, check=True, timeout=120)
        expected = 2 * sum(reads_per_file(p.stat().st_size) for p in files)
        key = ("stallwatch_dataset_reads_total", (("rank", "0"), ("training_job", "quick"), ("verdict", "unknown")))
        wait_for(f"{expected} reads at the agent", lambda: scrape(agent.url).get(key) == expected, 10)
    finally:
        stop_agent(agent)
