"""A client's GPU, named by UUID, reaches the correlator as the node's NVML index (fake NVML, 8 GPUs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stallwatch.client import monitor, transport
from stallwatch.eventbatch import EventBatch, discard
from stallwatch.exporters.agent import _build
from stallwatch.exporters.collector import CollectorContext, CollectorSpec, ScrapeCollector, registered
from stallwatch.exporters.config import parse
from stallwatch.exporters.gpu import GpuCollector
from stallwatch.exporters.gpu_directory import GpuDirectory
from stallwatch.exporters.nvml_fake import FakeGpu, FakeNVML
from stallwatch.harness import wait_for


class Probe:
    """An event consumer beside the correlator: what the receiver hands on."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []

    def submit(self, batch: EventBatch) -> None:
        self.batches.append(batch)

    def collect(self) -> Iterator[Any]:
        return iter(())

    def close(self) -> None:
        pass

    def gpu_of_rank(self) -> dict[int, int]:
        steps = [b.columns for b in self.batches if b.kind == "step"]
        return {int(rank): int(gpu) for columns in steps for rank, gpu in zip(columns["rank"], columns["gpu"],
                                                                               strict=True)}


def gpu_uuids(collector: Any) -> list[str]:
    """The UUIDs the gpu collector reports, by index (`stallwatch_gpu_info`)."""
    info = next(m for m in collector.collect() if m.name == "stallwatch_gpu_info")
    return [s.labels["uuid"] for s in sorted(info.samples, key=lambda s: int(s.labels["gpu"]))]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Probe, list[str]]]:
    """The agent's own gpu (8 fake GPUs) and events collectors, built as the agent builds them."""
    socket = str(tmp_path / "events.sock")
    specs = registered()
    options = parse(["--gpu.fake-devices", "8", "--events.socket", socket], specs)
    probe = Probe()
    spec = CollectorSpec("probe", True, "test consumer", lambda context: probe, consumer=lambda context: probe)
    collectors = _build([spec, specs["gpu"], specs["events"]], CollectorContext(options=options, sink=discard))
    scrape = ScrapeCollector(collectors)
    transport.configure(socket)
    try:
        wait_for("the gpu collector's first read of NVML", lambda: len(gpu_uuids(collectors["gpu"])) == 8, 30)
        yield probe, gpu_uuids(collectors["gpu"])
    finally:
        transport.sender().close()
        scrape.close()


def test_each_pods_gpu_is_the_nodes_gpu_it_runs_on(node: tuple[Probe, list[str]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    probe, uuids = node
    pods = {  # rank: the environment its pod or process sees, and the node's GPU it runs on
        0: ({"LOCAL_RANK": "0", "NVIDIA_VISIBLE_DEVICES": uuids[5]}, 5),  # one GPU of eight, which it calls 0
        1: ({"LOCAL_RANK": "1", "NVIDIA_VISIBLE_DEVICES": f"{uuids[2]},{uuids[7]}"}, 7),
        2: ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": f"MIG-{uuids[3]}/1/0"}, 3),  # a MIG slice of GPU 3
        3: ({"LOCAL_RANK": "0", "NVIDIA_VISIBLE_DEVICES": "GPU-00000000-0000-4000-8000-000000000000"}, -1),
        4: ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}, 6),  # bare metal: indices are the node's
    }
    for rank, (env, _) in pods.items():
        for name in ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for _ in monitor(range(3), job="pods", rank=rank):
            pass
    wait_for("every rank's steps", lambda: len(probe.gpu_of_rank()) == len(pods), 30)
    assert probe.gpu_of_rank() == {rank: gpu for rank, (_, gpu) in pods.items()}


def test_an_agent_that_knows_no_gpu_keeps_the_clients_index() -> None:
    directory = GpuDirectory()
    assert directory.index_of("GPU-6a1b2c3d-0000-4000-8000-00000000fa4e", 2) == 2
    directory.learn({"GPU-6a1b2c3d-0000-4000-8000-00000000fa4e": 6})
    assert directory.index_of("GPU-6a1b2c3d-0000-4000-8000-00000000fa4e", 2) == 6
    assert directory.index_of("", 2) == 2


def test_a_mig_device_counts_on_the_gpu_it_is_carved_from() -> None:
    mig = "MIG-0d5e7c2a-aaaa-4bbb-8ccc-dddddddddddd"
    directory = GpuDirectory()
    collector = GpuCollector(FakeNVML([FakeGpu(), FakeGpu(), FakeGpu(mig_uuids=(mig,))]), start=False,
                             directory=directory)
    try:
        collector.poll()
        assert directory.index_of(mig, 0) == 2
        assert directory.index_of(f"MIG-{gpu_uuids(collector)[1]}/1/0", 0) == 1  # the older MIG id
    finally:
        collector.close()

