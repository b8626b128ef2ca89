"""The `spoke_nfs` collector: a spoke mounted over NFS, seen from the node's NFS client.

A spoke that exports its cache over NFS (a Qumulo portal spoke, a filer in front of object storage)
has no per-read verdict the node can see; the NFS client's per-operation statistics in
`/proc/self/mountstats` give READ counts, bytes and the summed RTT and execute times, so
`rate(rtt) / rate(operations)` is the spoke's read latency, which jumps when reads miss to the hub.

Mount points are not labels (they are paths); each mount to watch is named by the operator:
`--spoke_nfs.mount spoke-a=/mnt/dataset`. The file is small and read on each scrape. mountstats lists
the mounts of the reading process's mount namespace: in a container that has its own, the node's
mounts are those of the node's init, `--spoke_nfs.pid 1` (with the node's /proc as `--spoke_nfs.proc`,
or `hostPID`), which the Helm chart sets with `hostProc.enabled`.

Formats handled (kernel `nfs_show_stats` / `rpc_clnt_show_stats`): `statvers=1.0` and `1.1`, per-op
lines of 8 fields (queue/RTT/execute in ms) or 9 (plus errors, newer kernels), NFSv3 and NFSv4,
mount points with octal escapes (`\\040` for a space). Counters are unsigned 64-bit in the kernel
and are parsed as Python ints, so values near 2^64 stay exact until they become the float of the
exposition.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.exporters.collector import CollectorContext, register_collector

log = logging.getLogger(__name__)

NFS_TYPES = frozenset({"nfs", "nfs4"})
_DEVICE = re.compile(r"^device (?P<device>\S+) mounted on (?P<mount>\S+) with fstype (?P<fstype>\S+)"
                     r"(?: statvers=(?P<statvers>\S+))?")
_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class OpStats:
    operations: int
    transmissions: int
    major_timeouts: int
    bytes_sent: int
    bytes_received: int
    queue_ms: int
    rtt_ms: int
    execute_ms: int
    errors: int | None  # only in the 9-field form


@dataclass(frozen=True)
class NfsMount:
    device: str
    mount_point: str
    fstype: str
    statvers: str
    read: OpStats | None  # None: no per-op statistics, or a malformed READ line
    malformed: bool = False


def unescape(text: str) -> str:
    """Mount points are printed with octal escapes for space, tab, newline and backslash."""
    return _OCTAL.sub(lambda match: chr(int(match.group(1), 8)), text)


def parse_op(fields: Sequence[str]) -> OpStats:
    if len(fields) not in (8, 9):
        raise ValueError(f"expected 8 or 9 counters, got {len(fields)}")
    values = [int(field) for field in fields]
    if any(value < 0 for value in values):
        raise ValueError("negative counter")
    ops, transmissions, timeouts, sent, received, queue, rtt, execute = values[:8]
    return OpStats(ops, transmissions, timeouts, sent, received, queue, rtt, execute,
                   errors=values[8] if len(values) == 9 else None)


def parse_mountstats(text: str) -> list[NfsMount]:
    """Every NFS mount in a mountstats text, with its READ statistics."""
    mounts: list[NfsMount] = []
    current: dict[str, str] | None = None
    read: OpStats | None = None
    malformed = False

    def finish() -> None:
        if current is not None:
            mounts.append(NfsMount(current["device"], unescape(current["mount"]), current["fstype"],
                                   current["statvers"] or "", read, malformed))

    for line in text.splitlines():
        if line.startswith("device "):
            finish()
            match = _DEVICE.match(line)
            current = match.groupdict() if match and match["fstype"] in NFS_TYPES else None
            read, malformed = None, False
            continue
        if current is None:
            continue
        name, _, rest = line.strip().partition(":")
        if name == "READ" and rest:
            try:
                read = parse_op(rest.split())
            except ValueError:
                malformed = True
    finish()
    return mounts


class NfsSpokeCollector:
    def __init__(self, mounts: Mapping[str, str], proc_root: str | Path = "/proc", pid: str = "self") -> None:
        """`mounts`: spoke name -> mount point; `pid`: whose mount namespace is read (see --spoke_nfs.pid)."""
        self._mounts = dict(mounts)
        self._path = Path(proc_root) / pid / "mountstats"
        self._errors: Counter[tuple[str, str]] = Counter()

    def collect(self) -> Iterator[Metric]:
        c = catalogue
        families = {
            "operations": c.SPOKE_NFS_READ_OPERATIONS.family(), "bytes": c.SPOKE_NFS_READ_BYTES.family(),
            "rtt": c.SPOKE_NFS_READ_RTT.family(), "execute": c.SPOKE_NFS_READ_EXECUTE.family(),
            "timeouts": c.SPOKE_NFS_READ_MAJOR_TIMEOUTS.family(), "errors": c.SPOKE_NFS_READ_ERRORS.family(),
        }
        try:
            # surrogateescape: a mount point is bytes, not necessarily UTF-8 (as os.fsdecode reads paths)
            text = self._path.read_text(errors="surrogateescape")
            found = {mount.mount_point: mount for mount in parse_mountstats(text)}
        except OSError as error:
            for spoke in self._mounts:
                self._count(spoke, "read_error", f"cannot read {self._path}: {error.strerror}")
            found = None
        for spoke, mount_point in sorted(self._mounts.items()):
            mount = None if found is None else found.get(mount_point)
            if mount is None:
                if found is not None:
                    self._count(spoke, "mount_not_found", f"no NFS mount at {mount_point}")
                continue
            if mount.read is None:
                self._count(spoke, "malformed_line" if mount.malformed else "no_read_stats",
                            f"no READ statistics for {mount_point}")
                continue
            read = mount.read
            families["operations"].add_metric([spoke], read.operations)
            families["bytes"].add_metric([spoke], read.bytes_received)
            families["rtt"].add_metric([spoke], read.rtt_ms / 1000)
            families["execute"].add_metric([spoke], read.execute_ms / 1000)
            families["timeouts"].add_metric([spoke], read.major_timeouts)
            if read.errors is not None:
                families["errors"].add_metric([spoke], read.errors)
        yield from families.values()
        errors = c.SPOKE_COLLECTOR_ERRORS.family()
        for (spoke, reason), count in sorted(self._errors.items()):
            errors.add_metric([spoke, reason], count)
        yield errors

    def close(self) -> None:
        pass

    def _count(self, spoke: str, reason: str, detail: str) -> None:
        if not self._errors[(spoke, reason)]:
            log.warning("spoke %s: %s (counted from now on)", spoke, detail)
        self._errors[(spoke, reason)] += 1


def parse_mount_option(text: str) -> tuple[str, str]:
    name, sep, mount_point = text.partition("=")
    if not sep or not name or not mount_point.startswith("/"):
        raise argparse.ArgumentTypeError(f"expected NAME=/mount/point, got {text!r}")
    return name, mount_point


def parse_pid(text: str) -> str:
    """`self` or a process id."""
    if text != "self" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"must be self or a process id, got {text!r}")
    return text


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--spoke_nfs.mount", dest="spoke_nfs_mount", type=parse_mount_option, action="append",
                       default=[], metavar="NAME=MOUNTPOINT",
                       help="an NFS mount of a spoke and the spoke label for it (repeat for several)")
    group.add_argument("--spoke_nfs.proc", dest="spoke_nfs_proc", default="/proc", metavar="PATH",
                       help="procfs root, e.g. the host's /proc mounted into a container (default: %(default)s)")
    group.add_argument("--spoke_nfs.pid", dest="spoke_nfs_pid", type=parse_pid, default="self", metavar="self|PID",
                       help="the process whose mounts are read, PROC/PID/mountstats: self on a node; 1 (the node's "
                       "init) in a container with its own mount namespace, where self lists only the container's "
                       "mounts (default: %(default)s)")


def _from_context(context: CollectorContext) -> NfsSpokeCollector:
    options = context.options
    mounts = dict(options.spoke_nfs_mount)
    if not mounts:
        log.warning("spoke_nfs: no --spoke_nfs.mount NAME=MOUNTPOINT given; nothing to report")
    return NfsSpokeCollector(mounts, options.spoke_nfs_proc, options.spoke_nfs_pid)


register_collector("spoke_nfs", False, "spokes mounted over NFS, from the NFS client's mountstats",
                   _from_context, _add_arguments)
