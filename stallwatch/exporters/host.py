"""The `host` collector: CPU, memory, network and disk I/O through psutil.

Network bytes toward the hub are the cross-region egress a spoke exists to cut; CPU time shows
loader workers that are busy preprocessing rather than waiting on reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import psutil
from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.exporters.collector import CollectorContext, register_collector


class HostCollector:
    def __init__(self, source: ModuleType = psutil) -> None:
        self._psutil = source

    def collect(self) -> Iterator[Metric]:
        c, ps = catalogue, self._psutil
        cpu = c.HOST_CPU_SECONDS.family()
        for mode, seconds in ps.cpu_times()._asdict().items():
            cpu.add_metric([mode], seconds)
        cpus = c.HOST_CPUS.family()
        cpus.add_metric([], ps.cpu_count() or 0)
        memory = ps.virtual_memory()
        total, available = c.HOST_MEMORY_TOTAL.family(), c.HOST_MEMORY_AVAILABLE.family()
        total.add_metric([], memory.total)
        available.add_metric([], memory.available)
        received, transmitted = c.HOST_NETWORK_RECEIVED.family(), c.HOST_NETWORK_TRANSMITTED.family()
        for interface, counters in sorted(ps.net_io_counters(pernic=True).items()):
            received.add_metric([interface], counters.bytes_recv)
            transmitted.add_metric([interface], counters.bytes_sent)
        read, written, busy = c.HOST_DISK_READ.family(), c.HOST_DISK_WRITTEN.family(), c.HOST_DISK_IO_SECONDS.family()
        for device, counters in sorted((ps.disk_io_counters(perdisk=True) or {}).items()):
            read.add_metric([device], counters.read_bytes)
            written.add_metric([device], counters.write_bytes)
            busy.add_metric([device], getattr(counters, "busy_time", 0) / 1000)  # ms
        yield from (cpu, cpus, total, available, received, transmitted, read, written, busy)

    def close(self) -> None:
        pass


def _from_context(context: CollectorContext) -> HostCollector:
    return HostCollector()


register_collector("host", True, "CPU, memory, network and disk I/O of the node (psutil)", _from_context)
