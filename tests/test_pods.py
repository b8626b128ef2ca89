"""The pods collector against a real gRPC server on a Unix socket that serves the kubelet's published
pod-resources API (v1.PodResourcesLister); only the kubelet behind it is stood in for. The GPUs are
the fake NVML's, with MIG devices on one of them."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.exporters import pods
from stallwatch.exporters.gpu import GpuCollector
from stallwatch.exporters.gpu_directory import GpuDirectory
from stallwatch.exporters.kubelet import api_pb2
from stallwatch.exporters.nvml_fake import FakeGpu, FakeNVML
from stallwatch.exporters.pods import PodsCollector
from stallwatch.harness import AgentProcess, start_agent, stop_agent
from tests.conftest import ROOT

GPU0, GPU1 = "GPU-8e5cf1f8-9a3b-4a1e-b0c7-2f0d8c6b1a01", "GPU-8e5cf1f8-9a3b-4a1e-b0c7-2f0d8c6b1a02"
MIG_A, MIG_B = "MIG-3c2b8f4e-6d1a-5e9f-8a7b-1c2d3e4f5a60", "MIG-3c2b8f4e-6d1a-5e9f-8a7b-1c2d3e4f5a61"


def pod(namespace: str, name: str, *containers: tuple[str, str, list[str]]) -> api_pb2.PodResources:
    return api_pb2.PodResources(name=name, namespace=namespace, containers=[
        api_pb2.ContainerResources(name=container, devices=[
            api_pb2.ContainerDevices(resource_name=resource, device_ids=ids,
                                     topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=0)]))],
            cpu_ids=[2, 3])
        for container, resource, ids in containers])


class Kubelet:
    """A gRPC server speaking v1.PodResourcesLister/List from the published messages."""

    def __init__(self, socket: Path) -> None:
        self.pods: list[api_pb2.PodResources] = []
        self.calls = 0
        self._lock = threading.Lock()
        handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
            "List": grpc.unary_unary_rpc_method_handler(
                self._list, request_deserializer=api_pb2.ListPodResourcesRequest.FromString,
                response_serializer=api_pb2.ListPodResourcesResponse.SerializeToString)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()

    def _list(self, request: api_pb2.ListPodResourcesRequest, context: Any) -> api_pb2.ListPodResourcesResponse:
        with self._lock:
            self.calls += 1
            return api_pb2.ListPodResourcesResponse(pod_resources=list(self.pods))

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kl-") as directory:  # short: sun_path holds 108 bytes
        yield Path(directory) / "kubelet.sock"


@pytest.fixture
def kubelet(socket_path: Path) -> Iterator[Kubelet]:
    server = Kubelet(socket_path)
    yield server
    server.stop()


@pytest.fixture
def directory() -> Iterator[GpuDirectory]:
    """The device ids the gpu collector publishes for two GPUs, the second one split into MIG devices."""
    gpus = GpuDirectory()
    nvml = FakeNVML([FakeGpu(uuid=GPU0), FakeGpu(uuid=GPU1, mig_uuids=(MIG_A, MIG_B))], pcie_latency=0.0)
    collector = GpuCollector(nvml, directory=gpus, start=False)
    collector.poll()
    yield gpus
    collector.close()


def info_series(families: list[Metric]) -> set[tuple[str, ...]]:
    [info] = [f for f in families if f.name == catalogue.GPU_POD_INFO.name]
    labels = catalogue.GPU_POD_INFO.labels
    return {tuple(s.labels[k] for k in labels) for s in info.samples}


def value(families: list[Metric], name: str, **labels: str) -> float:
    return next(s.value for f in families for s in f.samples if s.name == name and s.labels == labels)


def test_every_gpu_device_maps_to_its_pod_and_the_series_go_with_the_pod(
    kubelet: Kubelet, socket_path: Path, directory: GpuDirectory
) -> None:
    kubelet.pods = [
        pod("ml", "resnet-0", ("trainer", "nvidia.com/gpu", [GPU0]), ("sidecar", "example.com/fpga", ["fpga-0"])),
        pod("research", "bert-7", ("trainer", "nvidia.com/mig-3g.71gb", [MIG_A])),
        pod("research", "notebook", ("lab", "nvidia.com/mig-3g.71gb", [MIG_B])),
        pod("kube-system", "no-devices"),
    ]
    collector = PodsCollector(socket_path, directory, start=False)
    try:
        collector.refresh()
        families = list(collector.collect())
        assert info_series(families) == {
            ("0", GPU0, "nvidia.com/gpu", "ml", "resnet-0", "trainer"),
            ("1", MIG_A, "nvidia.com/mig-3g.71gb", "research", "bert-7", "trainer"),
            ("1", MIG_B, "nvidia.com/mig-3g.71gb", "research", "notebook", "lab"),
        }
        assert value(families, catalogue.PODS_KUBELET_UP.name) == 1
        kubelet.pods = kubelet.pods[1:]  # resnet-0 finished
        collector.refresh()
        families = list(collector.collect())
        assert {s[4] for s in info_series(families)} == {"bert-7", "notebook"}
    finally:
        collector.close()


def test_time_sliced_replicas_and_unknown_devices(kubelet: Kubelet, socket_path: Path,
                                                  directory: GpuDirectory) -> None:
    kubelet.pods = [pod("ml", "a", ("t", "nvidia.com/gpu.shared", [f"{GPU0}::0"])),
                    pod("ml", "b", ("t", "nvidia.com/gpu.shared", [f"{GPU0}::1"])),
                    pod("ml", "c", ("t", "nvidia.com/gpu", ["GPU-not-on-this-node"]))]
    collector = PodsCollector(socket_path, directory, start=False)
    try:
        collector.refresh()
        assert {(s[0], s[4]) for s in info_series(list(collector.collect()))} == {("0", "a"), ("0", "b"), ("", "c")}
    finally:
        collector.close()


def test_allocations_past_the_cap_are_counted(kubelet: Kubelet, socket_path: Path, directory: GpuDirectory,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pods, "MAX_SERIES", 2)
    kubelet.pods = [pod("ml", name, ("t", "nvidia.com/gpu", [f"GPU-{name}"])) for name in "abc"]
    collector = PodsCollector(socket_path, directory, start=False)
    try:
        collector.refresh()
        collector.refresh()
        families = list(collector.collect())
        assert len(info_series(families)) == 2
        assert value(families, catalogue.PODS_DROPPED_ALLOCATIONS.name) == 2  # one left out per answer
    finally:
        collector.close()


def test_an_absent_kubelet_is_counted_and_drops_the_mapping(socket_path: Path, directory: GpuDirectory) -> None:
    kubelet = Kubelet(socket_path)
    kubelet.pods = [pod("ml", "resnet-0", ("trainer", "nvidia.com/gpu", [GPU0]))]
    collector = PodsCollector(socket_path, directory, interval=1.0, timeout=1.0, start=False)
    try:
        collector.refresh()
        assert len(info_series(list(collector.collect()))) == 1
        kubelet.stop()
        collector.refresh()
        collector.refresh()
        families = list(collector.collect())
        assert info_series(families) == set()
        assert value(families, catalogue.PODS_KUBELET_UP.name) == 0
        assert value(families, catalogue.PODS_KUBELET_ERRORS.name, code="unavailable") == 2
        kubelet = Kubelet(socket_path)  # the kubelet restarts: the same channel finds it again
        kubelet.pods = [pod("ml", "resnet-1", ("trainer", "nvidia.com/gpu", [GPU0]))]
        for _ in range(50):  # within the reconnect backoff (one interval)
            collector.refresh()
            if info_series(list(collector.collect())):
                break
            time.sleep(0.1)
        assert {s[4] for s in info_series(list(collector.collect()))} == {"resnet-1"}
    finally:
        collector.close()
        kubelet.stop()


@pytest.fixture
def agent(tmp_path: Path, socket_path: Path, kubelet: Kubelet) -> Iterator[AgentProcess]:
    running = start_agent(["--gpu.fake-devices=2", "--collector.pods", f"--pods.socket={socket_path}",
                           "--pods.interval=0.2", "--no-collector.events"], tmp_path / "agent.log")
    yield running
    stop_agent(running)


@pytest.mark.slow
def test_the_agent_labels_its_gpus_with_pods_over_http(agent: AgentProcess, kubelet: Kubelet) -> None:
    # The fake NVML's GPUs are GPU-<uuid of 0xFA4E0000 + index>; pod "b" holds the second one.
    uuid1 = FakeNVML([FakeGpu(), FakeGpu()]).gpus[1].uuid
    kubelet.pods = [pod("ml", "b", ("trainer", "nvidia.com/gpu", [uuid1]))]
    expected = (f'stallwatch_gpu_pod_info{{container="trainer",device="{uuid1}",gpu="1",namespace="ml",pod="b",'
                'resource="nvidia.com/gpu"} 1.0')
    for _ in range(100):
        with urllib.request.urlopen(agent.url, timeout=10) as reply:
            body = reply.read().decode()
        if expected in body:
            break
        time.sleep(0.1)
    assert expected in body, body
    assert 'stallwatch_scrape_collector_success{collector="pods"} 1.0' in body


def test_the_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    subprocess.run([str(ROOT / "scripts" / "generate-protos.sh"), str(tmp_path)], check=True, timeout=120,
                   env=dict(os.environ, PYTHON=sys.executable))
    for name in ("api_pb2.py", "api_pb2.pyi"):
        fresh = (tmp_path / "kubelet" / name).read_text()
        committed = (ROOT / "stallwatch" / "exporters" / "kubelet" / name).read_text()
        assert fresh == committed, f"stallwatch/exporters/kubelet/{name} is stale: run `make protos`"
