"""The client against a real receiver on a real socket: steps, drops, a missing agent, a restart."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from stallwatch.client import ReadSpan, http_get, monitor, transport, wire
from stallwatch.client.identity import source_from_environment
from stallwatch.client.keys import read_key
from stallwatch.eventbatch import EventBatch
from stallwatch.exporters.events import EventsCollector
from stallwatch.harness import parse_samples, wait_for


def samples(collector: EventsCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    return parse_samples(generate_latest(registry).decode())


class Received:
    def __init__(self) -> None:
        self.batches: list[EventBatch] = []

    def __call__(self, batch: EventBatch) -> None:
        self.batches.append(batch)

    def rows(self, kind: str) -> int:
        return sum(len(b) for b in self.batches if b.kind == kind)

    def column(self, kind: str, name: str) -> list[int]:
        """A column of every batch of `kind` received, in arrival order (the flush thread may split events
        recorded together into two batches)."""
        return [int(value) for b in self.batches if b.kind == kind for value in b.columns[name]]


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "run" / "events.sock")
    transport.configure(path)
    yield path
    transport.sender().close()


@pytest.fixture
def agent(socket_path: str) -> Iterator[tuple[EventsCollector, Received]]:
    received = Received()
    collector = EventsCollector(socket_path, sink=received)
    yield collector, received
    collector.close()


def test_each_step_times_the_wait_and_the_work_after_it(agent: tuple[EventsCollector, Received]) -> None:
    collector, received = agent

    def slow_loader() -> Iterator[int]:
        for item in range(3):
            time.sleep(0.02)
            yield item

    for _ in monitor(slow_loader(), job="steps", rank=2, gpu=1):
        time.sleep(0.01)
    wait_for("3 steps at the agent", lambda: received.rows("step") == 3, 15)
    (batch,) = [b for b in received.batches if b.kind == "step"]
    columns = {name: column.astype(np.int64) for name, column in batch.columns.items()}
    assert list(columns["batch"]) == [0, 1, 2]
    assert list(columns["rank"]) == [2, 2, 2] and list(columns["gpu"]) == [1, 1, 1]
    waits = columns["wait_end_ns"] - columns["wait_start_ns"]
    computes = columns["compute_end_ns"] - columns["wait_end_ns"]
    assert (waits >= 20_000_000).all() and (computes >= 10_000_000).all()
    assert (columns["wait_start_ns"][1:] == columns["compute_end_ns"][:-1]).all()  # no gap, no overlap
    metrics = samples(collector)
    assert metrics[("stallwatch_loader_wait_seconds_count", (("rank", "2"), ("training_job", "steps")))] == 3
    assert metrics[("stallwatch_loader_wait_seconds_sum", (("rank", "2"), ("training_job", "steps")))] >= 0.06


def test_break_and_exceptions_end_the_step_that_was_running(agent: tuple[EventsCollector, Received]) -> None:
    _, received = agent
    for index in monitor(range(100), job="brk", rank=0):
        if index == 4:
            break
    with pytest.raises(RuntimeError):
        for index in monitor(range(100), job="exc", rank=0):
            if index == 2:
                raise RuntimeError("training failed")
    wait_for("8 steps at the agent", lambda: received.rows("step") == 5 + 3, 15)


def test_reads_carry_bytes_times_and_verdict(agent: tuple[EventsCollector, Received]) -> None:
    collector, received = agent
    with ReadSpan("http://spoke:8080/shards/0001.tar?sig=1", 4096) as span:
        span.bytes, span.verdict = 1234, wire.VERDICT_MISS
    with pytest.raises(OSError), ReadSpan("/data/missing.bin"):
        raise OSError("no such file")
    with ReadSpan("/local/disk.bin") as span:  # crossed no spoke
        span.bytes, span.verdict = 10, wire.VERDICT_DIRECT
    transport.sender().flush_all()
    wait_for("3 reads at the agent", lambda: received.rows("read") == 3, 15)
    assert received.column("read", "bytes") == [1234, 0, 10]
    assert received.column("read", "verdict") == [wire.VERDICT_MISS, wire.VERDICT_UNKNOWN, wire.VERDICT_DIRECT]
    job = source_from_environment()
    labels = (("rank", str(job.rank)), ("training_job", job.job))
    seen = samples(collector)
    for verdict in ("miss", "unknown", "direct"):
        assert seen[("stallwatch_dataset_reads_total", (*labels, ("verdict", verdict)))] == 1, verdict


def train_finishes(steps: int, job: str) -> bool:
    """Run a monitored loop of `steps` steps in a thread; whether it finished within a minute."""
    finished = threading.Event()

    def train() -> None:
        for _ in monitor(range(steps), job=job, rank=0):
            pass
        finished.set()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    thread.join(timeout=60)
    return finished.is_set()


def test_without_an_agent_the_client_neither_blocks_nor_raises_and_counts(socket_path: str) -> None:
    assert train_finishes(5 * wire.MAX_EVENTS, "alone")
    channel = transport.sender().channel(wire.Source("alone", 0, -1, -1))
    assert channel.dropped_total == 5 * wire.MAX_EVENTS


def test_a_full_agent_queue_drops_instead_of_blocking(socket_path: str) -> None:
    Path(socket_path).parent.mkdir(parents=True)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # an agent that never reads
    stuck.bind(socket_path)
    try:
        events = 40 * wire.MAX_EVENTS  # far more datagrams than the kernel queues for one socket
        assert train_finishes(events, "stuck")
        channel = transport.sender().channel(wire.Source("stuck", 0, -1, -1))
        # Kept for a retry at most RETRY_BUDGET_NS, then dropped and counted: all but the queued ones.
        wait_for("the pending batches dropped", lambda: transport.sender().pending_events == 0, 5)
        assert 0 < channel.dropped_total < events
    finally:
        stuck.close()


def test_batches_that_met_a_full_queue_arrive_once_the_agent_drains_it(socket_path: str) -> None:
    Path(socket_path).parent.mkdir(parents=True)
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # an agent busy elsewhere for a moment
    slow.bind(socket_path)
    try:
        events = 30 * wire.MAX_EVENTS
        assert train_finishes(events, "slow")
        assert transport.sender().pending_events > 0  # the kernel queued only some of the 30 datagrams
        received, steps = 0, 0
        slow.settimeout(2)
        while steps < events:
            data = slow.recv(1 << 18)
            received += 1
            steps += wire.HEADER.unpack_from(data)[6]
        channel = transport.sender().channel(wire.Source("slow", 0, -1, -1))
        assert steps == events and channel.dropped_total == 0 and received == 30
    finally:
        slow.close()


def test_after_an_agent_restart_the_client_delivers_again_and_reports_its_drops(socket_path: str) -> None:
    first = EventsCollector(socket_path)
    for _ in monitor(range(10), job="restart", rank=0):
        pass
    first.close()
    for _ in monitor(range(7), job="restart", rank=0):  # nobody listening: dropped and counted
        pass
    received = Received()
    second = EventsCollector(socket_path, sink=received)
    try:
        def one_more_step_arrives() -> bool:  # the client retries a missing agent after a pause
            for _ in monitor(range(1), job="restart", rank=0):
                pass
            return received.rows("step") > 0

        wait_for("a step at the restarted agent", one_more_step_arrives, 20)
        labels = (("rank", "0"), ("training_job", "restart"))
        assert samples(second)[("stallwatch_client_dropped_events_total", labels)] >= 7
    finally:
        second.close()


def test_a_flood_beyond_the_queue_limit_is_dropped_and_counted(socket_path: str) -> None:
    in_sink, release = threading.Event(), threading.Event()

    def slow_correlator(batch: EventBatch) -> None:
        in_sink.set()
        release.wait(timeout=30)

    collector = EventsCollector(socket_path, queue_limit=3, sink=slow_correlator)
    try:
        def batch(events: int) -> bytes:
            now = time.monotonic_ns()
            return wire.encode(wire.Source("flood", 0), [(0, now - 3, now - 2, now - 1, -1)] * events, [], events, 0, 0,
                               now, time.time_ns())

        collector._receiver.enqueue(batch(2))  # the receive thread's entry point, called here to control the timing
        assert in_sink.wait(timeout=30)  # the processing thread is busy with the first batch, still held
        collector._receiver.enqueue(batch(1))  # queued: the queue was empty, 3 events held
        collector._receiver.enqueue(batch(1))  # over the limit of 3 events held: dropped whole
        collector._receiver.enqueue(batch(3))  # dropped whole
        metrics = samples(collector)
        assert metrics[("stallwatch_receiver_batches_total", (("result", "queue_full"),))] == 2
        assert metrics[("stallwatch_receiver_dropped_events_total", (("reason", "queue_full"),))] == 4
    finally:
        release.set()
        collector.close()


def test_bad_batches_are_counted_by_reason_and_the_receiver_goes_on(agent: tuple[EventsCollector, Received]) -> None:
    collector, received = agent
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = transport.sender().path
    sender.sendto(b"\x07" + bytes(60), path)
    sender.sendto(b"\x01\x00", path)
    sender.close()
    for _ in monitor(range(2), job="after", rank=0):
        pass
    wait_for("2 steps at the agent", lambda: received.rows("step") == 2, 15)
    metrics = samples(collector)
    assert metrics[("stallwatch_receiver_batches_total", (("result", "bad_version"),))] == 1
    assert metrics[("stallwatch_receiver_batches_total", (("result", "truncated"),))] == 1
    assert metrics[("stallwatch_receiver_batches_total", (("result", "accepted"),))] == 1


def test_an_unbindable_socket_leaves_the_agent_running_and_says_so(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    collector = EventsCollector(str(blocker / "events.sock"))
    try:
        assert samples(collector)[("stallwatch_receiver_up", ())] == 0
    finally:
        collector.close()


def test_http_get_records_the_spokes_cache_verdict(agent: tuple[EventsCollector, Received]) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Spoke(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"x" * 100
            self.send_response(200)
            self.send_header("X-Cache-Status", "HIT" if "cached" in self.path else "MISS")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Spoke)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert http_get(f"{base}/cached/a.bin") == b"x" * 100
        http_get(f"{base}/cold/b.bin", offset=100, length=100)
    finally:
        server.shutdown()
        server.server_close()
    transport.sender().flush_all()
    _, received = agent
    wait_for("2 reads at the agent", lambda: received.rows("read") == 2, 15)
    assert received.column("read", "verdict") == [wire.VERDICT_HIT, wire.VERDICT_MISS]
    assert received.column("read", "key") == [read_key("/cached/a.bin", 0), read_key("/cold/b.bin", 100)]


def test_a_read_that_cannot_be_packed_is_counted_as_dropped_when_recorded(
        agent: tuple[EventsCollector, Received]) -> None:
    _, received = agent
    channel = transport.sender().channel(wire.Source("unpackable-read", 0))
    now = time.monotonic_ns()
    channel.read((2**64, read_key("/a", 0), 10, now, now + 1, wire.VERDICT_HIT))  # a batch past 64 bits
    channel.read((5, read_key("/a", 0), 10, now, now + 1, wire.VERDICT_HIT))
    assert channel.dropped_total == 1 and channel.reads_waiting() == 1
    channel.flush()
    wait_for("the good read at the agent", lambda: received.rows("read") == 1, 5)
    assert received.column("read", "batch") == [5]


def test_a_batch_that_fails_to_pack_is_counted_as_dropped(agent: tuple[EventsCollector, Received]) -> None:
    collector, received = agent
    channel = transport.sender().channel(wire.Source("unpackable", 0))
    now = time.monotonic_ns()
    channel.step((0, now, now + 1, now + 2))  # type: ignore[arg-type]  # one field short: the batch cannot be packed
    channel.step((1, now, now + 1, now + 2, -1))
    channel.flush()
    channel.step((2, now, now + 1, now + 2, -1))  # the next batch gets through and reports the two lost events
    channel.flush()
    wait_for("the good step at the agent", lambda: received.rows("step") == 1, 5)
    labels = (("rank", "0"), ("training_job", "unpackable"))
    assert channel.dropped_total == 2
    assert samples(collector)[("stallwatch_client_dropped_events_total", labels)] == 2
