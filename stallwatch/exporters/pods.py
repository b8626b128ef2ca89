"""The `pods` collector: which pod holds each GPU, from the kubelet's pod-resources API.

The kubelet serves `v1.PodResourcesLister/List` (gRPC) on a Unix socket; its answer lists every running
pod's containers with the device ids their device plugins allocated. For NVIDIA GPUs those ids are the
GPU UUIDs (`GPU-...`), MIG device UUIDs (`MIG-...`) or, with time-slicing, `UUID::N`. Each allocated
device becomes one `stallwatch_gpu_pod_info` series with the index of the physical GPU it lives on
(from the gpu collector), so any per-GPU series gains namespace/pod/container by one join on `gpu`.
The series are bounded by the node's devices and disappear with the pod.

The kubelet is asked in a background thread, never on the scrape path. When it cannot be reached the
mapping is dropped (no pod labels are better than stale ones), `stallwatch_pods_kubelet_up` is 0 and
the failure is counted by gRPC status code; the agent runs on.
"""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.exporters.collector import CollectorContext, register_collector
from stallwatch.exporters.config import ConfigError
from stallwatch.exporters.gpu_directory import GpuDirectory
from stallwatch.flags import positive_float

log = logging.getLogger(__name__)

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
LIST_METHOD = "/v1.PodResourcesLister/List"
# The kubelet reports every device plugin's devices: only these resource names are GPUs
# (nvidia.com/gpu, nvidia.com/mig-1g.10gb, nvidia.com/gpu.shared, ...).
GPU_RESOURCE_PREFIX = "nvidia.com/"
# A node has at most a few dozen GPU devices; a larger answer is a broken kubelet or device plugin.
MAX_SERIES = 512


@dataclass(frozen=True, order=True)
class Allocation:
    """One GPU device allocated to one container."""

    device: str
    resource: str
    namespace: str
    pod: str
    container: str


def gpu_allocations(response: Any) -> list[Allocation]:
    """The GPU devices of a ListPodResourcesResponse, one per (device, container), sorted."""
    found = {
        Allocation(device_id, devices.resource_name, pod.namespace, pod.name, container.name)
        for pod in response.pod_resources
        for container in pod.containers
        for devices in container.devices
        if devices.resource_name.startswith(GPU_RESOURCE_PREFIX)
        for device_id in devices.device_ids
        if device_id
    }
    return sorted(found)


class PodsCollector:
    def __init__(
        self,
        socket: Path,
        directory: GpuDirectory,
        *,
        interval: float = 5.0,
        timeout: float = 2.0,
        start: bool = True,
    ) -> None:
        import grpc

        from stallwatch.exporters.kubelet import api_pb2

        self._grpc = grpc
        self._request = api_pb2.ListPodResourcesRequest()
        self._socket = socket
        self._directory = directory
        self._interval = interval
        self._timeout = timeout
        # The channel connects lazily and reconnects by itself, at most one interval after the kubelet
        # (re)starts: a kubelet that starts after the agent is found.
        backoff_ms = int(interval * 1000)
        self._channel = grpc.insecure_channel(f"unix://{socket.absolute()}", options=[
            ("grpc.initial_reconnect_backoff_ms", min(1000, backoff_ms)),
            ("grpc.max_reconnect_backoff_ms", backoff_ms)])
        self._list = self._channel.unary_unary(
            LIST_METHOD,
            request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
            response_deserializer=api_pb2.ListPodResourcesResponse.FromString,
        )
        self._lock = threading.Lock()
        self._allocations: list[Allocation] = []
        self._up = False
        self._errors: dict[str, int] = {}
        self._dropped = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._poll_forever, name="stallwatch-pods", daemon=True)
            self._thread.start()

    def _poll_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # a bug here must not kill the thread: the mapping would freeze
                log.exception("pods refresh failed")
            self._stop.wait(self._interval)

    def refresh(self) -> None:
        """Ask the kubelet once. Runs on the poll thread; tests call it directly."""
        try:
            response = self._list(self._request, timeout=self._timeout)
        except self._grpc.RpcError as error:
            code = error.code().name.lower() if callable(getattr(error, "code", None)) else "unknown"
            with self._lock:
                if self._up or not self._errors:
                    log.warning("pods collector: kubelet pod-resources API at %s: %s; no pod labels until "
                                "it answers", self._socket, code)
                self._up, self._allocations = False, []
                self._errors[code] = self._errors.get(code, 0) + 1
            return
        allocations = gpu_allocations(response)
        dropped = max(0, len(allocations) - MAX_SERIES)
        if dropped and not self._dropped:
            log.warning("pods collector: the kubelet lists %d GPU device allocations; keeping the first %d",
                        len(allocations), MAX_SERIES)
        allocations = allocations[:MAX_SERIES]
        with self._lock:
            self._dropped += dropped
            if not self._up:
                log.info("pods collector: kubelet answers, %d GPU device(s) allocated", len(allocations))
            self._up, self._allocations = True, allocations

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            allocations, up, errors, dropped = list(self._allocations), self._up, dict(self._errors), self._dropped
        info = catalogue.GPU_POD_INFO.family()
        for a in allocations:
            info.add_metric([self._directory.gpu_label(a.device), a.device, a.resource, a.namespace, a.pod,
                             a.container], 1)
        kubelet_up = catalogue.PODS_KUBELET_UP.family()
        kubelet_up.add_metric([], 1 if up else 0)
        failures = catalogue.PODS_KUBELET_ERRORS.family()
        for code, count in sorted(errors.items()):
            failures.add_metric([code], count)
        left_out = catalogue.PODS_DROPPED_ALLOCATIONS.family()
        left_out.add_metric([], dropped)
        yield from (info, kubelet_up, failures, left_out)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._timeout + 1)
        self._channel.close()


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--pods.socket", dest="pods_socket", type=Path, default=DEFAULT_SOCKET, metavar="PATH",
                       help="the kubelet's pod-resources socket (default: %(default)s)")
    group.add_argument("--pods.interval", dest="pods_interval", type=positive_float, default=5.0,
                       metavar="SECONDS", help="how often the kubelet is asked (default: %(default)s)")


def _from_context(context: CollectorContext) -> PodsCollector:
    try:
        import grpc  # noqa: F401
    except ImportError as error:
        raise ConfigError("the pods collector needs grpcio and protobuf: pip install grpcio protobuf, or install "
                          "the agent's wheel with its extra: pip install 'dist/stallwatch-VERSION-py3-none-any.whl"
                          "[kubernetes]' (make dist builds it)") from error
    return PodsCollector(context.options.pods_socket, context.gpus, interval=context.options.pods_interval)


register_collector("pods", False, "which pod holds each GPU (the kubelet's pod-resources API; Kubernetes only)",
                   _from_context, _add_arguments)
