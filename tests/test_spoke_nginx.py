"""spoke_nginx against a real nginx proxy_cache in front of a real hub, and its parser and tailer on
real log lines (tests/data/nginx-stallwatch.log was written by nginx with the shipped log_format)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stallwatch import catalogue
from stallwatch.client.keys import read_key
from stallwatch.client.reads import verdict_from_cache_status
from stallwatch.eventbatch import EventBatch, Verdict
from stallwatch.exporters.logtail import LogTailer
from stallwatch.exporters.spoke_nginx import (
    LOG_FORMAT,
    RESULTS,
    MalformedLineError,
    NginxSpokeCollector,
    parse_entry,
    seconds_text_to_ns,
    upstream_error_count,
    upstream_seconds_ns,
)
from stallwatch.harness import wait_for
from tests.realspoke import NGINX, ROOT, Agent, Hub, Nginx, free_port, get

DATA = Path(__file__).parent / "data"
REAL_LINES = [line for line in (DATA / "nginx-stallwatch.log").read_text().splitlines() if not line.startswith("#")]
needs_nginx = pytest.mark.skipif(not os.access(NGINX, os.X_OK), reason="nginx not installed")


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def samples(collector: NginxSpokeCollector) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for family in collector.collect():
        for sample in family.samples:
            out[(sample.name, *(f"{k}={v}" for k, v in sorted(sample.labels.items())))] = sample.value
    return out


# --- parsing -------------------------------------------------------------------------------------------

def test_every_cache_status_of_real_nginx_parses() -> None:
    entries = [parse_entry(line) for line in REAL_LINES]
    results = Counter(entry.result for entry in entries)
    assert set(results) == {"hit", "miss", "expired", "stale", "updating", "revalidated", "bypass", "none"}
    by_uri = {line.rsplit("uri:", 1)[1]: entry for line, entry in zip(REAL_LINES, entries, strict=True)}
    assert by_uri["/local"].verdict is Verdict.UNKNOWN and by_uri["/local"].upstream_ns == -1
    assert by_uri["/nocache/a.bin"].verdict is Verdict.MISS  # not cached, but fetched from the hub
    assert by_uri["/down/x"].upstream_errors == 1 and by_uri["/down/x"].status == 502
    revalidated = next(e for e in entries if e.result == "revalidated")
    assert revalidated.verdict is Verdict.HIT and revalidated.upstream_ns >= 0  # asked the hub, served cache
    updating = next(e for e in entries if e.result == "updating")
    assert updating.verdict is Verdict.HIT and updating.upstream_ns == -1


def test_every_cache_status_but_none_has_the_clients_verdict() -> None:
    """The result labels and the client's hit/miss reading of X-Cache-Status name the same statuses."""
    for status, result in RESULTS.items():
        verdict = Verdict(verdict_from_cache_status(status))
        assert (verdict is Verdict.UNKNOWN) == (result == "none"), status


def test_upstream_time_lists_and_dashes() -> None:
    assert upstream_seconds_ns("0.010, 0.020") == 30_000_000
    assert upstream_seconds_ns("0.010, 0.020 : 0.100") == 130_000_000
    assert upstream_seconds_ns("-, 0.005") == 5_000_000
    assert upstream_seconds_ns("-") == -1
    assert upstream_error_count("502, 504, 200") == 2
    assert upstream_error_count("-") == 0
    assert seconds_text_to_ns("1700000000.123") == 1_700_000_000_123_000_000


def test_key_uses_the_slice_or_range_start_and_drops_the_query() -> None:
    line = REAL_LINES[0].replace("uri:/data/a.bin", "uri:/data/a.bin?sig=x")
    assert parse_entry(line).key == read_key("/data/a.bin", 0)
    sliced = line.replace("slice:-", "slice:bytes=8388608-16777215")
    assert parse_entry(sliced).key == read_key("/data/a.bin", 8388608)
    ranged = line.replace("range:-", "range:bytes=100-199")
    assert parse_entry(ranged).key == read_key("http://spoke:8080/data/a.bin", 100)


@pytest.mark.parametrize(("line", "reason"), [
    ("garbage", "malformed_line"),
    (REAL_LINES[0].replace("cache:MISS", "cache:WEIRD"), "unknown_cache_status"),
    (REAL_LINES[0].replace("bytes:1000", "bytes:many"), "malformed_line"),
    (REAL_LINES[0].replace("msec:", "when:"), "malformed_line"),
])
def test_bad_lines_say_why(line: str, reason: str) -> None:
    with pytest.raises(MalformedLineError) as caught:
        parse_entry(line)
    assert caught.value.reason == reason


# --- the collector on a file ---------------------------------------------------------------------------

def make_collector(path: Path, batches: list[EventBatch], **kwargs: Any) -> NginxSpokeCollector:
    return NginxSpokeCollector(str(path), "spoke-a", spoke_id=3, sink=batches.append, interval=0,
                               wall_ns=lambda: 5_000_000_000_000_000_000, monotonic_ns=lambda: 1_000, **kwargs)


def test_counts_bytes_batches_and_errors_from_real_lines(tmp_path: Path) -> None:
    log, batches = tmp_path / "access.log", list[EventBatch]()
    collector = make_collector(log, batches)
    log.write_text("\n".join([*REAL_LINES, "not a log line"]) + "\n")
    seen = samples(collector)
    entries = [parse_entry(line) for line in REAL_LINES]
    for result, count in Counter(e.result for e in entries).items():
        assert seen[("stallwatch_spoke_requests_total", f"result={result}", "spoke=spoke-a")] == count
    assert seen[("stallwatch_spoke_requests_total", "result=hit", "spoke=spoke-a")] >= 1
    assert seen[("stallwatch_spoke_bytes_total", "source=cache", "spoke=spoke-a")] == sum(
        e.body_bytes for e in entries if e.verdict is Verdict.HIT)
    assert seen[("stallwatch_spoke_hub_fetch_duration_seconds_count", "spoke=spoke-a")] == sum(
        e.upstream_ns >= 0 for e in entries)
    assert seen[("stallwatch_spoke_hub_errors_total", "spoke=spoke-a")] == 2  # /down/x and the STALE refusal
    assert seen[("stallwatch_spoke_collector_errors_total", "reason=malformed_line", "spoke=spoke-a")] == 1
    (batch,) = batches
    assert batch.kind == "spoke_request" and len(batch) == len(entries)
    assert {name: str(column.dtype) for name, column in batch.columns.items()} == {
        "spoke": "int32", "key": "uint64", "bytes": "int64", "end_ns": "int64", "duration_ns": "int64",
        "upstream_ns": "int64", "verdict": "int8"}
    assert (batch.columns["spoke"] == 3).all()
    # wall 5e18 ns is monotonic 1000 ns: every $msec moves by the same offset.
    offset = 5_000_000_000_000_000_000 - 1_000
    assert batch.columns["end_ns"][0] == entries[0].end_wall_ns - offset
    assert list(batch.columns["verdict"]) == [int(e.verdict) for e in entries]
    assert batch.columns["key"][0] == np.uint64(read_key("/data/a.bin", 0))
    collector.close()


def test_partial_line_waits_for_its_end_and_missing_log_is_waited_for(tmp_path: Path) -> None:
    log, batches = tmp_path / "later.log", list[EventBatch]()
    collector = make_collector(log, batches)
    assert collector.poll() == 0  # no file yet: nothing, no error
    first, second = REAL_LINES[0], REAL_LINES[1]
    with log.open("w") as out:  # created after the agent started: read from its start
        out.write(first + "\n" + second[:20])
        out.flush()
        assert collector.poll() == 1
        out.write(second[20:] + "\n")
    assert collector.poll() == 1
    seen = samples(collector)
    assert not any(key[0] == "stallwatch_spoke_collector_errors_total" for key in seen)
    collector.close()


def test_existing_log_starts_at_its_end_unless_asked(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    log.write_text("\n".join(REAL_LINES) + "\n")
    assert make_collector(log, []).poll() == 0
    assert make_collector(log, [], from_start=True).poll() == len(REAL_LINES)


def test_rename_rotation_reads_the_old_file_to_its_end_first(tmp_path: Path) -> None:
    log, now, problems = tmp_path / "access.log", [0.0], list[str]()
    tailer = LogTailer(str(log), rotate_wait=5.0, clock=lambda: now[0], on_problem=problems.append)
    log.write_bytes(b"a\n")
    assert tailer.read_lines() == [b"a"]
    with log.open("ab") as writer:  # the writer keeps its descriptor across the rename
        writer.write(b"b\n")
        writer.flush()
        log.rename(tmp_path / "access.log.1")
        writer.write(b"c\n")
        writer.flush()
        assert tailer.read_lines() == [b"b", b"c"]  # no successor yet: keep reading the old one
        writer.write(b"d\n")
        writer.flush()
        log.write_bytes(b"e\n")
        assert tailer.read_lines() == [b"d", b"e"]  # the old file to its end, then the new one
        writer.write(b"f\ng")  # a late line into the old file, then one cut off for ever
        writer.flush()
        assert tailer.read_lines() == [b"f"]
    now[0] = 10.0  # past rotate_wait: the old file is closed and its cut line counted
    assert tailer.read_lines() == []
    assert problems == ["partial_line"]
    tailer.close()


def test_copytruncate_recovers_unread_lines_from_the_copy(tmp_path: Path) -> None:
    log, problems = tmp_path / "access.log", list[str]()
    tailer = LogTailer(str(log), on_problem=problems.append)
    log.write_bytes(b"one\n")
    assert tailer.read_lines() == [b"one"]
    with log.open("ab") as writer:
        writer.write(b"two\n")
    shutil.copyfile(log, tmp_path / "access.log.1")
    os.truncate(log, 0)
    with log.open("ab") as writer:
        writer.write(b"three-but-longer-than-before\n")
    assert tailer.read_lines() == [b"two", b"three-but-longer-than-before"]
    assert problems == []
    # Without a copy that matches, the gap is counted, and reading goes on.
    (tmp_path / "access.log.1").write_bytes(b"unrelated\n")
    os.truncate(log, 0)
    log.write_bytes(b"four\n")
    assert tailer.read_lines() == [b"four"]
    assert problems == ["rotation_gap"]
    tailer.close()


# --- against a real nginx -------------------------------------------------------------------------------

@pytest.fixture
def spoke(tmp_path: Path) -> Iterator[tuple[Nginx, Hub]]:
    files = tmp_path / "hub"
    files.mkdir()
    (files / "a.bin").write_bytes(b"a" * 1000)
    (files / "b.bin").write_bytes(b"b" * 3000)
    for name in ("short.bin", "reval.bin", "stale.bin", "slow-upd.bin"):
        (files / name).write_bytes(name.encode() * 50)
    hub, doomed_hub = Hub(files), Hub(files)
    cached = "proxy_cache spoke; proxy_cache_valid 200 10m;"
    expiring = "proxy_cache spoke; proxy_cache_valid 200 1s;"
    nginx = Nginx(tmp_path / "nginx", f"""
        location /data/ {{ proxy_pass http://127.0.0.1:{hub.port}/; {cached} proxy_cache_bypass $http_x_bypass; }}
        location /short/ {{ proxy_pass http://127.0.0.1:{hub.port}/; {expiring} }}
        location /reval/ {{ proxy_pass http://127.0.0.1:{hub.port}/; {expiring} proxy_cache_revalidate on; }}
        location /stale/ {{ proxy_pass http://127.0.0.1:{doomed_hub.port}/; {expiring} proxy_cache_use_stale error; }}
        location /upd/ {{ proxy_pass http://127.0.0.1:{hub.port}/; {expiring}
                         proxy_cache_use_stale updating; proxy_cache_background_update on; }}
        location /nocache/ {{ proxy_pass http://127.0.0.1:{hub.port}/; }}
        location /down/ {{ proxy_pass http://127.0.0.1:{free_port()}/; proxy_cache spoke; }}
        location = /local {{ return 204; }}
    """)
    nginx.doomed_hub = doomed_hub  # type: ignore[attr-defined]
    try:
        yield nginx, hub
    finally:
        nginx.close()
        hub.close()
        doomed_hub.close()


@needs_nginx
@pytest.mark.slow
def test_agent_metrics_agree_exactly_with_known_hits_and_misses(spoke: tuple[Nginx, Hub]) -> None:
    nginx, _ = spoke
    agent = Agent(["--collector.spoke_nginx", "--spoke_nginx.log", str(nginx.access_log),
                   "--spoke_nginx.name", "spoke-a", "--spoke_nginx.interval", "0.2"])
    try:
        # (path, request headers, the result we know nginx must give, hub contacted, hub errors)
        first: list[tuple[str, dict[str, str], str, bool, int]] = [
            ("/data/a.bin", {}, "miss", True, 0), ("/data/a.bin", {}, "hit", False, 0),
            ("/data/a.bin", {}, "hit", False, 0), ("/data/b.bin", {}, "miss", True, 0),
            ("/data/b.bin", {"X-Bypass": "1"}, "bypass", True, 0), ("/data/missing", {}, "miss", True, 0),
            ("/nocache/a.bin", {}, "none", True, 0), ("/local", {}, "none", False, 0),
            ("/down/x", {}, "miss", True, 1),
            ("/short/short.bin", {}, "miss", True, 0), ("/reval/reval.bin", {}, "miss", True, 0),
            ("/stale/stale.bin", {}, "miss", True, 0), ("/upd/slow-upd.bin", {}, "miss", True, 0),
        ]
        # After the 1 s validity has surely passed (nginx compares whole seconds) and the stale
        # location's hub is gone. The first /upd request starts a background update of the slow file
        # and is served stale; the second arrives while that update runs.
        after: list[tuple[str, dict[str, str], str, bool, int]] = [
            ("/short/short.bin", {}, "expired", True, 0), ("/reval/reval.bin", {}, "revalidated", True, 0),
            ("/stale/stale.bin", {}, "stale", True, 1), ("/upd/slow-upd.bin", {}, "stale", False, 0),
            ("/upd/slow-upd.bin", {}, "updating", False, 0),
        ]
        sent: list[tuple[str, int, bool, int]] = []

        def send(plan: list[tuple[str, dict[str, str], str, bool, int]]) -> None:
            for path, headers, result, hub_contacted, errors in plan:
                _, body, _ = get(nginx.url(path), headers)
                sent.append((result, len(body), hub_contacted, errors))

        send(first)
        cached_at = int(time.time())
        nginx.doomed_hub.close()  # type: ignore[attr-defined]
        # nginx stamps a cached copy with whole seconds: valid until the next one, expired the one after.
        wait_for("the 1 s validity to pass", lambda: int(time.time()) >= cached_at + 2, 5)
        send(after)
        expected = Counter(result for result, *_ in sent)
        label = "spoke=spoke-a"

        def scraped_requests() -> float:
            seen = agent.scrape()
            return sum(v for k, v in seen.items() if k[0] == "stallwatch_spoke_requests_total" and label in k)

        wait_for("every request counted", lambda: scraped_requests() == len(sent), 10)
        seen = agent.scrape()
        for result in ("hit", "miss", "expired", "stale", "updating", "revalidated", "bypass", "none"):
            assert seen[("stallwatch_spoke_requests_total", f"result={result}", label)] == expected[result], result
        from_cache = {"hit", "stale", "updating", "revalidated"}
        assert seen[("stallwatch_spoke_bytes_total", "source=cache", label)] == sum(
            size for result, size, *_ in sent if result in from_cache)
        assert seen[("stallwatch_spoke_bytes_total", "source=hub", label)] == sum(
            size for result, size, hub_contacted, _ in sent if result not in from_cache and hub_contacted)
        assert seen[("stallwatch_spoke_hub_fetch_duration_seconds_count", label)] == sum(
            hub_contacted for _, _, hub_contacted, _ in sent)
        assert seen[("stallwatch_spoke_hub_errors_total", label)] == sum(errors for *_, errors in sent)
        assert not any(k[0] == "stallwatch_spoke_collector_errors_total" for k in seen)
        assert seen[("stallwatch_scrape_collector_success", "collector=spoke_nginx")] == 1
    finally:
        agent.close()


class Traffic:
    """Requests to a real nginx, each waited for in the log file it should land in; `total` counts them."""

    def __init__(self, nginx: Nginx) -> None:
        self.nginx, self.total = nginx, 0

    def send(self, count: int, written_to: Path) -> None:
        before = lines_in(written_to)
        for _ in range(count):
            self.probe()
        wait_for("the lines in the log", lambda: lines_in(written_to) == before + count, 10)

    def probe(self) -> None:
        get(self.nginx.url("/data/a.bin"))
        self.total += 1

    def reopened(self) -> bool:
        """After `nginx -s reopen`: the worker reopens a moment after the master created the new file,
        and until then requests still land in the renamed one; each probe is counted like any other."""
        self.probe()
        return lines_in(self.nginx.access_log) > 0


def held_open(path: Path) -> bool:
    """Whether this process holds a descriptor on the file at `path`."""
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # closed while we looked
            if os.readlink(fd) == str(path):
                return True
    return False


def assert_every_request_counted_once(collector: NginxSpokeCollector, traffic: Traffic) -> None:
    seen = samples(collector)
    assert sum(v for k, v in seen.items() if k[0] == "stallwatch_spoke_requests_total") == traffic.total
    assert not any(k[0] == "stallwatch_spoke_collector_errors_total" for k in seen)


@needs_nginx
@pytest.mark.slow
def test_rotation_by_rename_and_reopen_and_by_copytruncate_loses_and_repeats_nothing(
    spoke: tuple[Nginx, Hub],
) -> None:
    nginx, _ = spoke
    log = nginx.access_log
    now = [0.0]
    collector = NginxSpokeCollector(str(log), "spoke-a", interval=0, rotate_wait=0.5, clock=lambda: now[0])
    traffic = Traffic(nginx)
    traffic.send(3, log)
    collector.poll()
    rotated = log.with_name("access.log.1")
    log.rename(rotated)
    traffic.send(2, rotated)  # nginx still writes to the renamed file until it reopens
    nginx.reopen()
    wait_for("nginx to reopen its log", traffic.reopened, 10)
    traffic.send(4, log)
    collector.poll()
    traffic.send(5, log)  # not read before the copy: recovered from access.log.1
    rotated.rename(log.with_name("access.log.2"))  # as logrotate shifts old copies before copying
    shutil.copyfile(log, rotated)
    os.truncate(log, 0)
    traffic.send(6, log)
    collector.poll()
    first_rotated = log.with_name("access.log.2")
    assert held_open(first_rotated)  # within rotate_wait: a writer may still append to it
    now[0] += 0.6  # past rotate_wait: the renamed file is closed
    collector.poll()
    assert not held_open(first_rotated)
    assert_every_request_counted_once(collector, traffic)
    collector.close()


@needs_nginx
def test_shipped_example_config_is_valid_nginx(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "nginx-spoke.conf").read_text()
    assert LOG_FORMAT in text, "docs/nginx-spoke.conf and spoke_nginx.LOG_FORMAT differ"
    text = text.replace("hub.example.com:443", "127.0.0.1:443").replace("/var/", f"{tmp_path}/var/")
    for name in ("log/nginx", "cache/nginx"):
        (tmp_path / "var" / name).mkdir(parents=True)
    config = tmp_path / "nginx.conf"
    config.write_text(text)
    checked = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", str(config), "-g", f"pid {tmp_path}/pid;"],
                             check=False, capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr


def test_metric_names_come_from_the_catalogue(tmp_path: Path) -> None:
    names = {family.name for family in make_collector(tmp_path / "none.log", []).collect()}
    spoke = {m.name.removesuffix("_total") for m in catalogue.by_subsystem("spoke")}
    assert names <= spoke


@needs_nginx
@pytest.mark.slow
def test_two_rotations_between_polls_and_a_log_never_reopened_lose_nothing(spoke: tuple[Nginx, Hub]) -> None:
    nginx, _ = spoke
    log = nginx.access_log
    now = [0.0]
    collector = NginxSpokeCollector(str(log), "spoke-a", interval=0, rotate_wait=0.3, clock=lambda: now[0])
    traffic = Traffic(nginx)

    def shift() -> None:
        """logrotate's numbered rotation: .2 -> .3, .1 -> .2, then the log -> .1."""
        for index in range(4, 0, -1):
            older = log.with_name(f"access.log.{index}")
            if older.exists():
                older.rename(log.with_name(f"access.log.{index + 1}"))
        log.rename(log.with_name("access.log.1"))

    def rotate_and_reopen() -> None:
        shift()
        nginx.reopen()
        wait_for("nginx to reopen its log", traffic.reopened, 10)

    traffic.send(3, log)
    collector.poll()
    rotate_and_reopen()
    traffic.send(3, log)
    rotate_and_reopen()  # the second rotation before the next poll: the middle file was never seen
    traffic.send(4, log)
    collector.poll()
    now[0] += 0.4  # past rotate_wait
    collector.poll()

    # Renamed without a reopen (logrotate's `create` without a postrotate): nginx keeps writing to the
    # renamed file, long after rotate_wait, while the new log stays empty.
    shift()
    log.touch()
    traffic.send(2, log.with_name("access.log.1"))
    collector.poll()
    now[0] += 0.4
    collector.poll()
    traffic.send(3, log.with_name("access.log.1"))
    now[0] += 0.4
    collector.poll()
    assert_every_request_counted_once(collector, traffic)
    collector.close()


def test_a_line_over_the_limit_is_skipped_counted_and_never_held(tmp_path: Path) -> None:
    log, problems = tmp_path / "access.log", list[str]()
    tailer = LogTailer(str(log), max_line_bytes=1000, on_problem=problems.append)
    tracemalloc.start()
    with log.open("ab") as writer:
        writer.write(b"short\n" + b"x" * 600)
        writer.flush()
        assert tailer.read_lines() == [b"short"]
        held_before = tracemalloc.get_traced_memory()[0]
        for _ in range(16):  # 16 MiB more of the same line, over many polls
            writer.write(b"x" * (1 << 20))
            writer.flush()
            assert tailer.read_lines() == []
        held = tracemalloc.get_traced_memory()[0] - held_before
        tracemalloc.stop()
        assert held < 256 << 10
        writer.write(b"x\nnext\n" + b"y" * 2000 + b"\nlast\n")
        writer.flush()
        assert tailer.read_lines() == [b"next", b"last"]
    assert problems == ["oversize_line", "oversize_line"]
    tailer.close()
