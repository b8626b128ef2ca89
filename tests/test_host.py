"""The host collector reads the real machine through psutil."""

from __future__ import annotations

import socket

from stallwatch import catalogue
from stallwatch.exporters.host import HostCollector


def read() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in HostCollector().collect()
        for s in family.samples
    }


def test_loopback_traffic_shows_in_the_interface_counters() -> None:
    key = (catalogue.HOST_NETWORK_RECEIVED.name, (("interface", "lo"),))
    before = read()[key]
    payload = b"x" * 1_000_000
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver, socket.socket(
        socket.AF_INET, socket.SOCK_DGRAM
    ) as sender:
        receiver.bind(("127.0.0.1", 0))
        for _ in range(20):
            sender.sendto(payload[:50_000], receiver.getsockname())
    assert read()[key] - before >= 20 * 50_000


def test_cpu_and_memory_are_plausible() -> None:
    r = read()
    cpus = r[(catalogue.HOST_CPUS.name, ())]
    assert cpus >= 1
    user = r[(catalogue.HOST_CPU_SECONDS.name, (("mode", "user"),))]
    assert user > 0
    total = r[(catalogue.HOST_MEMORY_TOTAL.name, ())]
    assert 0 < r[(catalogue.HOST_MEMORY_AVAILABLE.name, ())] <= total
