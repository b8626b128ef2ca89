"""spoke_nfs on real-format /proc/self/mountstats text of several kernels (see tests/data/SOURCES.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stallwatch.exporters.spoke_nfs import NfsSpokeCollector, parse_mount_option, parse_mountstats, parse_pid

DATA = Path(__file__).parent / "data"


def proc_with(tmp_path: Path, fixture: str) -> Path:
    (tmp_path / "self").mkdir(parents=True, exist_ok=True)
    (tmp_path / "self" / "mountstats").write_text((DATA / fixture).read_text())
    return tmp_path


def samples(collector: NfsSpokeCollector) -> dict[tuple[str, ...], float]:
    return {(s.name, *(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
            for family in collector.collect() for s in family.samples}


def test_procfs_nfs4_fixture() -> None:
    (mount,) = parse_mountstats((DATA / "mountstats-procfs-nfs4.txt").read_text())
    assert (mount.device, mount.mount_point, mount.fstype, mount.statvers) == (
        "192.168.1.1:/srv/test", "/mnt/nfs/test", "nfs4", "1.1")
    assert mount.read is not None
    assert (mount.read.operations, mount.read.transmissions, mount.read.bytes_received) == (1298, 1298, 1210292152)
    assert (mount.read.rtt_ms, mount.read.execute_ms, mount.read.errors) == (79386, 79407, None)


def test_nfs3_with_per_op_errors() -> None:
    (mount,) = parse_mountstats((DATA / "mountstats-nfs3-statvers1.1.txt").read_text())
    assert mount.fstype == "nfs" and mount.read is not None
    assert (mount.read.operations, mount.read.bytes_received, mount.read.errors) == (1, 144, 0)


def test_older_kernel_escaped_mount_point_and_counters_near_2_64() -> None:
    mounts = {m.mount_point: m for m in parse_mountstats((DATA / "mountstats-nfs3-statvers1.0.txt").read_text())}
    assert set(mounts) == {"/mnt/train data", "/mnt/scratch"}  # rootfs, xfs, tmpfs are not NFS
    read = mounts["/mnt/train data"].read
    assert read is not None and mounts["/mnt/train data"].statvers == "1.0"
    assert read.bytes_received == 18446744073709000000  # exact: no 64-bit signed overflow
    assert read.queue_ms == 18446744073709551000
    assert read.major_timeouts == 6
    assert mounts["/mnt/scratch"].read is None  # no per-op section yet


def test_collector_names_mounts_and_reports_seconds(tmp_path: Path) -> None:
    proc = proc_with(tmp_path, "mountstats-nfs3-statvers1.0.txt")
    collector = NfsSpokeCollector({"spoke-a": "/mnt/train data", "spoke-b": "/mnt/scratch",
                                   "gone": "/mnt/nowhere"}, proc)
    seen = samples(collector)
    assert seen[("stallwatch_spoke_nfs_read_operations_total", "spoke=spoke-a")] == 4398765
    assert seen[("stallwatch_spoke_nfs_read_bytes_total", "spoke=spoke-a")] == 18446744073709000000
    assert seen[("stallwatch_spoke_nfs_read_rtt_seconds_total", "spoke=spoke-a")] == pytest.approx(31999.812)
    assert seen[("stallwatch_spoke_nfs_read_execute_seconds_total", "spoke=spoke-a")] == pytest.approx(32876.311)
    assert seen[("stallwatch_spoke_nfs_read_major_timeouts_total", "spoke=spoke-a")] == 6
    assert ("stallwatch_spoke_nfs_read_errors_total", "spoke=spoke-a") not in seen  # 8-field kernel
    assert seen[("stallwatch_spoke_collector_errors_total", "reason=no_read_stats", "spoke=spoke-b")] == 1
    assert seen[("stallwatch_spoke_collector_errors_total", "reason=mount_not_found", "spoke=gone")] == 1
    assert not any("/mnt" in part for key in seen for part in key)  # never a path as a label


def test_malformed_read_line_and_missing_file_are_counted(tmp_path: Path) -> None:
    proc = proc_with(tmp_path, "mountstats-procfs-nfs4.txt")
    text = (proc / "self" / "mountstats").read_text()
    (proc / "self" / "mountstats").write_text(text.replace("READ: 1298 1298", "READ: 1298 x"))
    collector = NfsSpokeCollector({"spoke-a": "/mnt/nfs/test"}, proc)
    errors = samples(collector)
    assert errors[("stallwatch_spoke_collector_errors_total", "reason=malformed_line", "spoke=spoke-a")] == 1
    missing = NfsSpokeCollector({"spoke-a": "/mnt/nfs/test"}, tmp_path / "no-proc")
    assert samples(missing)[("stallwatch_spoke_collector_errors_total", "reason=read_error", "spoke=spoke-a")] == 1


def test_mount_option() -> None:
    assert parse_mount_option("spoke-a=/mnt/data") == ("spoke-a", "/mnt/data")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_mount_option("/mnt/data")


def test_in_a_container_the_node_mounts_are_read_from_pid_1(tmp_path: Path) -> None:
    proc = proc_with(tmp_path, "mountstats-procfs-nfs4.txt")
    (proc / "self").rename(proc / "1")  # the node's init sees the NFS mount
    (proc / "self").mkdir()
    (proc / "self" / "mountstats").write_text("device overlay mounted on / with fstype overlay\n")  # the pod's
    node = samples(NfsSpokeCollector({"spoke-a": "/mnt/nfs/test"}, proc, "1"))
    assert node[("stallwatch_spoke_nfs_read_operations_total", "spoke=spoke-a")] > 0
    pod = samples(NfsSpokeCollector({"spoke-a": "/mnt/nfs/test"}, proc))
    assert pod[("stallwatch_spoke_collector_errors_total", "reason=mount_not_found", "spoke=spoke-a")] == 1
    assert parse_pid("1") == "1" and parse_pid("self") == "self"
    for bad in ("0", "-1", "../1", "thread-self"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_pid(bad)
