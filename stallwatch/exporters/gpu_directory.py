"""This node's GPUs by UUID: the gpu collector learns them from NVML, the receiver maps clients' GPUs.

A training process inside a container sees its GPUs renumbered from 0, so the index it could send
is not the node's; the UUID (`GPU-...`) names one physical device everywhere. The client sends it
(`stallwatch.client.identity`), and the receiver turns it into the NVML index the gpu collector's
utilization samples carry, so the correlator joins a rank's stalls to the GPU it really ran on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

# Unknown UUIDs are logged once each, up to this many: a misbehaving client cannot grow the set.
MAX_UNKNOWN_LOGGED = 64


class GpuDirectory:
    def __init__(self) -> None:
        self._index: Mapping[str, int] = {}  # replaced whole by `learn`: readers need no lock
        self._names: Mapping[int, str] = {}
        self._unknown_logged: set[str] = set()

    def learn(self, index_by_uuid: Mapping[str, int], names: Mapping[int, str] | None = None) -> None:
        """The UUIDs NVML reports (GPUs and MIG devices) and the index of the GPU each belongs to; each GPU's name."""
        self._index = dict(index_by_uuid)
        self._names = dict(names or {})

    def name_of(self, index: int) -> str:
        """The GPU's name as NVML gives it ("NVIDIA H100 80GB HBM3"); "" when not known (the correlator's prices)."""
        return self._names.get(index, "")

    def gpu_label(self, device_id: str) -> str:
        """The `gpu` label of a device plugin's id (a GPU or MIG UUID; a time-slicing plugin appends
        `::N` to share one GPU), "" when NVML did not report it (the pods collector's lookup)."""
        found = self._index.get(device_id.split("::", 1)[0])
        return "" if found is None else str(found)

    def index_of(self, uuid: str, client_index: int) -> int:
        """The NVML index of the client's GPU.

        Without a UUID, or while the directory knows no GPU at all (no gpu collector, or NVML not read
        yet), it is the client's own index, the best there is; a UUID this node does not have is -1.
        """
        known = self._index
        if not uuid or not known:
            return client_index
        found = known.get(uuid)
        if found is None and uuid.startswith("MIG-GPU-"):  # the older MIG id: MIG-<its GPU's UUID>/<gi>/<ci>
            found = known.get(uuid[len("MIG-"):].split("/", 1)[0])
        if found is not None:
            return found
        if uuid not in self._unknown_logged and len(self._unknown_logged) < MAX_UNKNOWN_LOGGED:
            self._unknown_logged.add(uuid)
            log.warning("events: a client's GPU %s is not among this node's GPUs; its steps carry gpu -1", uuid)
        return -1
