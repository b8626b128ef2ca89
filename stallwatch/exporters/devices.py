"""Which physical GPU each device id belongs to, shared between collectors.

The gpu collector publishes what NVML enumerates: each GPU's UUID (`GPU-...`) and the UUIDs of its MIG
devices (`MIG-...`), by GPU index. The pods collector looks up the device ids the kubelet reports,
which are those UUIDs (a time-slicing device plugin appends `::N` to share one GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

SHARED_REPLICA_SEPARATOR = "::"


class GpuDirectory:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._index: dict[str, str] = {}

    def publish(self, index_by_device: Mapping[str, str]) -> None:
        """Replace the whole table: device id -> GPU index (as the `gpu` label spells it)."""
        with self._lock:
            self._index = dict(index_by_device)

    def gpu_of(self, device_id: str) -> str:
        """The GPU index of a device id, or "" when NVML did not report it."""
        physical = device_id.split(SHARED_REPLICA_SEPARATOR, 1)[0]
        with self._lock:
            return self._index.get(physical, "")
