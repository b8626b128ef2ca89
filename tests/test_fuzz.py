"""Fuzz every decoder and parser of outside input, through the collector that owns it, with hypothesis:
no exception escapes, and every input is either used or counted as a rejection, exactly once.

The budget is `STALLWATCH_FUZZ_EXAMPLES` examples per target (200 here, affordable in CI);
benchmarks/fuzz.py runs this same file with a larger budget."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.core import Metric

from stallwatch.client import wire
from stallwatch.exporters.collector import collected, registered
from stallwatch.exporters.config import ConfigError, parse
from stallwatch.exporters.events import EventsCollector
from stallwatch.exporters.events_decode import REJECT_REASONS
from stallwatch.exporters.openmetrics_mapping import load_mapping, mapping_text
from stallwatch.exporters.spoke_nfs import NfsSpokeCollector
from stallwatch.exporters.spoke_nginx import NginxSpokeCollector
from stallwatch.exporters.spoke_openmetrics import OpenMetricsSpokeCollector
from stallwatch.exporters.spoke_varnish import VarnishSpokeCollector

DATA = Path(__file__).parent / "data"
FUZZ = settings(
    max_examples=int(os.environ.get("STALLWATCH_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def mutated(seed: bytes) -> st.SearchStrategy[bytes]:
    """The seed with a few bytes overwritten, a slice cut out or random bytes spliced in."""

    @st.composite
    def strategy(draw: st.DrawFn) -> bytes:
        data = bytearray(seed)
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, max(0, len(data) - 1)))
            action = draw(st.sampled_from(["set", "cut", "insert", "truncate"]))
            if action == "set" and data:
                data[at] = draw(st.integers(0, 255))
            elif action == "cut":
                del data[at:at + draw(st.integers(1, 16))]
            elif action == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=16))
            else:
                del data[at:]
        return bytes(data)

    return strategy()


def total(families: Iterable[Metric], name: str, **labels: str) -> float:
    return sum(s.value for f in families for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# --- events: the client wire format ------------------------------------------------------------------
def a_batch() -> bytes:
    now = time.monotonic_ns()
    steps = [(i, now - 3000, now - 2000, now - 1000, now - 2500) for i in range(3)]
    reads = [(1, 7, 4096, now - 2000, now - 1000, wire.VERDICT_MISS)] * 2
    opens = [(wire.OPEN_READ, 1, 7, now - 900, now - 10), (wire.OPEN_HANDED, 0, 0, now - 2500, now - 10)]
    return wire.encode(wire.Source("fuzz", 1, 0, 2), steps, reads, 3, 2, 0, now, time.time_ns(), opens)


def a_version_2_batch() -> bytes:
    """As an older client sends it: the header without n_open, no open records."""
    now = time.monotonic_ns()
    source = wire.Source("fuzz", 1, 0, 2)
    header = wire.HEADER_V2.pack(2, 1, 0, source.gpu, source.worker, source.rank, 1, 0, 0, now, time.time_ns())
    return header + wire.encode_body(source, [(0, now - 3000, now - 2000, now - 1000, -1)], b"")


@pytest.fixture(scope="module")
def receiver() -> Iterator[EventsCollector]:
    collector = EventsCollector(os.path.join(tempfile.mkdtemp(prefix="sw-fuzz-"), "events.sock"))
    yield collector
    collector.close()


@FUZZ
@given(data=st.one_of(st.binary(max_size=512), st.builds(a_batch).flatmap(mutated),
                      st.builds(a_version_2_batch).flatmap(mutated)))
def test_event_batches(receiver: EventsCollector, data: bytes) -> None:
    before = total(receiver.collect(), "stallwatch_receiver_batches_total")
    receiver.process([data])
    families = list(receiver.collect())
    assert total(families, "stallwatch_receiver_batches_total") == before + 1
    results = {s.labels["result"] for f in families for s in f.samples if s.name == "stallwatch_receiver_batches_total"}
    assert results <= {"accepted", *REJECT_REASONS}


# --- nginx access log lines --------------------------------------------------------------------------
NGINX_LINES = [line for line in (DATA / "nginx-stallwatch.log").read_text().splitlines() if line]


@FUZZ
@given(lines=st.lists(st.one_of(
    st.sampled_from(NGINX_LINES).map(str.encode).flatmap(mutated),
    st.text(max_size=200).map(str.encode),
), min_size=1, max_size=8))
@example(lines=[b"msec:17962331607\trequest_time:0.005\tstatus:200\tbytes:1000\tcache:MISS\tupstream_time:0.005\t"
                b"upstream_status:200\tslice:-\trange:-\turi:/a.bin"])  # found: ns past int64 broke the batch
def test_nginx_log_lines(tmp_path: Path, lines: list[bytes]) -> None:
    lines = [line.replace(b"\n", b" ") for line in lines]
    log = tmp_path / f"access-{time.monotonic_ns()}.log"
    log.write_bytes(b"".join(line + b"\n" for line in lines))
    collector = NginxSpokeCollector(str(log), "fuzz", from_start=True, interval=0)
    used = collector.poll()
    families = list(collector.collect())
    rejected = total(families, "stallwatch_spoke_collector_errors_total")
    assert used + rejected == len(lines)
    assert total(families, "stallwatch_spoke_requests_total") == used
    collector.close()


# --- NFS mountstats ----------------------------------------------------------------------------------
@FUZZ
@given(text=st.one_of(
    st.sampled_from(sorted(DATA.glob("mountstats-*.txt"))).map(Path.read_bytes).flatmap(mutated),
    st.binary(max_size=300),
))
@example(text=b"device s:/x mounted on /mnt/\x80 with fstype nfs statvers=1.1\n")  # found: not UTF-8
def test_mountstats(tmp_path: Path, text: bytes) -> None:
    (tmp_path / "self").mkdir(exist_ok=True)
    (tmp_path / "self" / "mountstats").write_bytes(text)
    collector = NfsSpokeCollector({"fuzz": "/mnt/spoke"}, proc_root=tmp_path)
    for _ in range(2):
        families = list(collector.collect())
    reported = total(families, "stallwatch_spoke_nfs_read_operations_total")
    errors = total(families, "stallwatch_spoke_collector_errors_total")
    assert errors == (0 if any(s.name.startswith("stallwatch_spoke_nfs_read_operations")
                               for f in families for s in f.samples) else 2)
    assert reported >= 0


# --- OpenMetrics / Prometheus text from a spoke ----------------------------------------------------
JUICEFS = load_mapping(*mapping_text("juicefs"))


@FUZZ
@given(body=st.one_of(
    st.sampled_from(sorted(DATA.glob("*.prom"))).map(Path.read_bytes).flatmap(mutated),
    st.binary(max_size=300),
))
@example(body=b'# TYPE juicefs_object_request_durations_histogram_seconds histogram\n'
               b'juicefs_object_request_durations_histogram_seconds_bucket{method="GET",le="x1"} 3\n')  # found
def test_openmetrics_exposition(body: bytes) -> None:
    collector = OpenMetricsSpokeCollector("http://spoke/metrics", JUICEFS, "fuzz", get=lambda *_: body)
    families, succeeded = collected(collector, "spoke_openmetrics")
    errors = total(families, "stallwatch_spoke_collector_errors_total")
    assert errors in (0, 1)
    # Either mapped families, or one counted parse error and the collector reported failed.
    assert (errors == 0 and succeeded and len(families) > 1) or (errors == 1 and not succeeded)


# --- varnishstat -j ----------------------------------------------------------------------------------
VARNISH = json.dumps({"version": 1, "timestamp": "2025-01-01T00:00:00", "counters": {
    "MAIN.cache_hit": {"value": 10}, "MAIN.cache_miss": {"value": 3}, "MAIN.backend_fail": {"value": 0},
    "SMA.s0.g_bytes": {"value": 1024}, "SMA.s0.g_space": {"value": 4096}}})
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=16), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(text=st.one_of(
    st.just(VARNISH.encode()).flatmap(mutated).map(lambda b: b.decode("utf-8", "replace")),
    JSON.map(json.dumps),
    st.dictionaries(st.sampled_from(["MAIN.cache_hit", "MAIN.cache_miss", "SMA.s0.g_bytes", "x"]),
                    st.dictionaries(st.sampled_from(["value", "flag"]), JSON, max_size=2), max_size=4)
      .map(lambda counters: json.dumps({"counters": counters})),
))
@example(text='{"counters": null}')  # found: an AttributeError past the collector's error handling
def test_varnishstat_json(text: str) -> None:
    collector = VarnishSpokeCollector("fuzz", run=lambda *_: text)
    families, succeeded = collected(collector, "spoke_varnish")
    errors = total(families, "stallwatch_spoke_collector_errors_total", reason="parse_error")
    assert errors == (0 if len(families) > 1 else 1) and succeeded == (errors == 0)


# --- the agent's --config.file -----------------------------------------------------------------------
KNOWN_KEYS = [*(f"collector.{name}" for name in registered()), "web.listen-address", "web.telemetry-path",
              "log.level", "gpu.interval", "events.queue-limit", "events.rank-limit", "events.socket-group",
              "spoke_nginx.interval", "spoke_nfs.mount", "spoke_qumulo.timeout", "web.config.file", "config.file"]
KEYS = st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=12))


@FUZZ
@given(content=st.one_of(
    st.one_of(st.dictionaries(KEYS, JSON, max_size=5), JSON).map(lambda document: yaml.safe_dump(document).encode()),
    st.binary(max_size=80),
))
@example(content=b"web.listen-address: null\n")  # found: a traceback
@example(content=b"\x80")  # found: not UTF-8
def test_config_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "agent.yaml"
    path.write_bytes(content)
    try:
        parse(["--config.file", str(path)], registered())
    except ConfigError as error:
        assert "\n" not in str(error).strip()
