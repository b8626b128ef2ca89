"""The `spoke_juicefs` collector on a real JuiceFS mount: its object store is the demo hub's WebDAV bucket
behind an emulated region boundary, its block cache is the spoke.

A real PyTorch DataLoader reads the mount with plain `open()` (captured, the mount given as a spoke's),
cold (the block cache and the page cache dropped: every file a GET from the hub) then warm twice (the
page cache evicted before each epoch, so every read goes to JuiceFS, which serves it from its block
cache). The truth is the job's own timing of each read, as in test_attribution_loader: a file's first
read is a miss, the others hits (the bucket's GET count checks it). The agent's recorded events,
replayed through the correlator, must book every cause within 5 % of its truth or 0.5 s.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from stallwatch import catalogue
from stallwatch.catalogue import CAUSES
from stallwatch.client import transport
from stallwatch.client.capture import SPOKE_MOUNTS_ENV
from stallwatch.client.keys import read_key
from stallwatch.client.torch import instrument
from stallwatch.correlator.eventfile import read_events
from stallwatch.demo.davhub import DavHub
from stallwatch.demo.hub import Hub
from stallwatch.demo.juicefs import JuiceFS, usable
from stallwatch.demo.run import Demo, Settings
from stallwatch.eventbatch import Verdict
from stallwatch.exporters import spoke_juicefs
from stallwatch.exporters.spoke_juicefs import JuiceFSSpokeCollector, local_stamp_ns
from stallwatch.harness import AgentProcess, scrape, stop_agent, total, wait_for
from tests.test_attribution_loader import attributed, collate, received, train

# The tests with a real mount (the rest feed the collector lines).
needs_mount = pytest.mark.skipif(usable() is not None, reason=str(usable()))

ITEMS, ITEM_BYTES = 96, 256 << 10
RTT_S, BANDWIDTH = 0.06, 400e6 / 8


@pytest.fixture
def juicefs(tmp_path: Path) -> Iterator[tuple[JuiceFS, DavHub]]:
    hub = Hub(tmp_path / "hub", RTT_S, BANDWIDTH).start()
    bucket = DavHub(tmp_path / "bucket", hub).start()
    volume = JuiceFS(tmp_path / "jfs", bucket, cache_mib=64)
    try:
        yield volume, bucket
    finally:
        volume.unmount()
        bucket.close()
        hub.close()


class MountedFiles(Dataset[dict[str, Any]]):
    """Each item one file of the mount, read whole with plain `open()`; its first read (a marker file
    outside the mount says) is a miss."""

    def __init__(self, folder: Path, seen: Path, decode_s: float) -> None:
        self.folder, self.seen, self.decode_s = folder, seen, decode_s

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, index: int) -> dict[str, Any]:
        marker = self.seen / str(index)
        miss = not marker.exists()
        marker.touch()
        with open(self.folder / f"item-{index:04d}.bin", "rb") as file:
            start = time.monotonic_ns()
            payload = file.read()
            end = time.monotonic_ns()
        time.sleep(self.decode_s)
        return {"payload": payload, "read": (start, end, miss)}


def evict_page_cache(folder: Path) -> None:
    """The kernel keeps a FUSE file's pages across opens: without this a warm read never reaches JuiceFS."""
    for path in folder.iterdir():
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


@pytest.mark.slow
@needs_mount
def test_every_cause_of_a_loader_reading_a_juicefs_mount_is_within_five_percent_of_its_truth(
        juicefs: tuple[JuiceFS, DavHub], agent_factory: Callable[..., AgentProcess], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    volume, bucket = juicefs
    data = volume.mount_point / "data"
    data.mkdir()
    for index in range(ITEMS):
        (data / f"item-{index:04d}.bin").write_bytes(os.urandom(ITEM_BYTES))
    volume.drop_cache()

    socket_path = os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")
    events = tmp_path / "events.bin"
    agent = agent_factory("--events.socket", socket_path, "--no-collector.gpu", "--no-collector.host",
                          "--collector.spoke_juicefs", "--spoke_juicefs.mount", str(volume.mount_point),
                          "--correlator.record-events", str(events))
    monkeypatch.setenv(SPOKE_MOUNTS_ENV, str(volume.mount_point))
    transport.configure(socket_path)
    gets = [bucket.gets]
    truth = np.zeros(len(CAUSES))
    (tmp_path / "seen").mkdir()
    dataset = MountedFiles(data, tmp_path / "seen", decode_s=0.004)
    loader = instrument(DataLoader(dataset, collate_fn=collate, num_workers=4, batch_size=8), job="jfs", rank=0)
    try:
        for _ in range(3):
            truth += train(loader, 1, compute_s=0.01)
            gets.append(bucket.gets)
            evict_page_cache(data)
    finally:
        transport.sender().close()
    # Every file fetched in the cold epoch (a few twice: a read and JuiceFS's read-ahead can both ask), none after.
    assert gets[1] - gets[0] >= ITEMS and gets[1] == gets[3], gets
    steps, reads = 3 * len(loader), 3 * ITEMS
    wait_for("every step and read at the agent", lambda: received(agent) == (steps, reads), 30, agent.process,
             agent.log)
    samples = scrape(agent.url)
    time.sleep(2.5)  # the access log hands its lines over within about a second
    stop_agent(agent)

    # The spoke's own view: its counters, and a miss row for the start of every file read cold.
    requests = catalogue.SPOKE_REQUESTS.name
    assert total(samples, requests, result="miss") >= ITEMS and total(samples, requests, result="hit") >= ITEMS
    rows = [batch.columns for batch in read_events(events) if batch.kind == "spoke_request"]
    keys = np.concatenate([columns["key"] for columns in rows])
    verdicts = np.concatenate([columns["verdict"] for columns in rows])
    starts = {read_key(str(data / f"item-{index:04d}.bin"), 0) for index in range(ITEMS)}
    at_start = np.isin(keys, np.array(sorted(starts), dtype=np.uint64))
    assert int(np.count_nonzero(at_start & (verdicts == Verdict.MISS))) == ITEMS
    assert int(np.count_nonzero(at_start & (verdicts == Verdict.HIT))) == 2 * ITEMS

    got = attributed(events)
    print("cause, attributed s, truth s:", *(f"{c} {h:.2f} {w:.2f}" for c, h, w in zip(CAUSES, got, truth,
                                                                                  strict=True)))
    assert got.sum() == pytest.approx(truth.sum(), rel=0.05, abs=0.5)
    for cause, have, want in zip(CAUSES, got, truth, strict=True):
        assert abs(have - want) <= max(0.05 * want, 0.5), f"{cause}: {have:.2f} s attributed, truth {want:.2f} s"


@pytest.mark.slow
@needs_mount
def test_the_demo_runs_with_a_juicefs_spoke(tmp_path: Path) -> None:
    """`stallwatch demo --spoke juicefs`: the cold epoch misses in the block cache and stalls on remote fetches,
    later ones hit (or never reach JuiceFS: the page cache answers them). A hub far enough that the cold epoch's
    fetches outweigh the delivery stalls a busy machine adds over the warm ones (0.27 s against more, once)."""
    settings = Settings(duration=20, shards=32, shard_mib=1, workdir=tmp_path / "demo", quiet=True, spoke="juicefs",
                        rtt_seconds=0.15, bandwidth_mbit=50)
    outcome = Demo(settings).run()
    cold, *warm = outcome.epochs
    assert cold.hit_ratio == 0 and warm and all(e.hit_ratio is None or e.hit_ratio > 0.9 for e in warm)
    stalls = {cause: total(outcome.metrics, catalogue.STALL_SECONDS.name, cause=cause) for cause in CAUSES}
    assert max(stalls, key=lambda cause: stalls[cause]) == "remote_fetch", stalls


LOG = """\
2026.12.05 10:40:42.245509 [uid:0,gid:0,pid:7] lookup (1,data): (2,[drwxr-xr-x:0040755,2,0,0,1,1,1,0]) - OK <0.0003>
2026.12.05 10:40:42.245766 [uid:0,gid:0,pid:7] create (2,a,b.bin,-rw-r--r--:0100644): \
(3,[-rw-r--r--:0100644,1,0,0,1,1,1,0]) [fh:2] - OK <0.000284>
2026.12.05 10:40:42.316346 [uid:0,gid:0,pid:7] read (3,131072,0,7): (131072) - OK <0.069984>
2026.12.05 10:40:42.316746 [uid:0,gid:0,pid:7] read (3,131072,131072,7): (131072) - OK <0.000065>
2026.12.05 10:40:42.316800 [uid:0,gid:0,pid:7] read (9,4096,0,8): (4096) - OK <0.000100>
2026.12.05 10:40:42.316900 [uid:0,gid:0,pid:7] read (9223372032559808516,2847,0,3): 2847 - OK <0.000004>
#
"""


def test_reads_are_keyed_by_path_and_timed_from_the_log_in_the_mounts_time_zone(tmp_path: Path) -> None:
    """Without a mount: the log's lines fed in, `.stats` a plain file. An hour east of UTC, the lines' local
    times still land on the events' clock."""
    (tmp_path / ".stats").write_text(
        "juicefs_object_request_durations_histogram_seconds_GET_total 2\n"
        "juicefs_object_request_durations_histogram_seconds_GET_sum 0.14\njuicefs_blockcache_hits 5\n")
    batches: list[Any] = []
    stamp_ns = local_stamp_ns("2026.12.05 10:40:42.316346") - 3600 * 10**9
    collector = JuiceFSSpokeCollector(str(tmp_path), "jfs", sink=batches.append, retry_s=60,
                                      wall_ns=lambda: stamp_ns + 700_000_000, monotonic_ns=lambda: 5 * 10**9)
    try:
        assert collector.accept(LOG.encode()[:50]) == 0 and collector.accept(LOG.encode()[50:]) == 2
        (batch,) = batches
        assert batch.columns["key"].tolist() == [read_key(str(tmp_path / "data" / "a,b.bin"), offset)
                                                 for offset in (0, 131072)]
        assert batch.columns["verdict"].tolist() == [Verdict.MISS, Verdict.HIT]
        assert batch.columns["end_ns"][0] == pytest.approx(5 * 10**9 - 700_000_000, abs=1000)
        samples = {(s.name, s.labels.get("result", s.labels.get("reason"))): s.value
                   for family in collector.collect() for s in family.samples}
        assert samples[("stallwatch_spoke_requests_total", "hit")] == 5
        assert samples[("stallwatch_spoke_collector_errors_total", "unknown_inode")] == 1
    finally:
        collector.close()


def test_the_names_of_the_inodes_looked_up_longest_ago_are_forgotten_first(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spoke_juicefs, "MAX_INODES", 2)
    stamp = "2026.12.05 10:40:42.245509 [uid:0,gid:0,pid:7]"
    lookups = "".join(f"{stamp} lookup (1,{name}): ({inode},[-rw-r--r--:0100644,1,0,0,1,1,1,9]) - OK <0.0003>\n"
                      for name, inode in (("a", 2), ("b", 3), ("a", 2), ("c", 4)))
    reads = "".join(f"{stamp} read ({inode},4096,0,7): (9) - OK <0.000065>\n" for inode in (2, 3, 4))
    collector = JuiceFSSpokeCollector(str(tmp_path), "jfs", retry_s=60)
    try:
        assert collector.accept((lookups + reads).encode()) == 2  # b, looked up before a's second lookup, is gone
    finally:
        collector.close()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(LOG.splitlines()), st.text(max_size=120),
                          st.from_regex(spoke_juicefs.READ, fullmatch=True)), max_size=8))
def test_any_lines_are_taken_or_counted_never_raised(lines: list[str]) -> None:
    collector = JuiceFSSpokeCollector("/nonexistent", "jfs", retry_s=60)
    try:
        collector.accept(("\n".join(lines) + "\n").encode())
    finally:
        collector.close()
