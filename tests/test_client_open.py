"""Open records: what a client has in flight, reported by its flushes, decoded by the agent's decoder."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from stallwatch.client import RecordedFile, monitor, open_recorded, reads, transport, wire
from stallwatch.client.keys import read_key
from stallwatch.client.torch import instrument
from stallwatch.exporters.events_decode import (
    MAX_EPOCH_AGE_NS,
    MAX_EVENT_AGE_NS,
    Decoded,
    RejectedBatchError,
    decode,
    peek_events,
)
from stallwatch.harness import wait_for

HANG_S = 2.0
HANG_INDEX = 4  # the first sample of the epoch's third batch: worker 0 builds it (round robin)


class Datagrams:
    """A real socket at the client's path: every datagram, decoded as the agent decodes it."""

    def __init__(self, path: str) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)  # as the agent's
        self._socket.bind(path)
        self._socket.settimeout(0.1)
        self.decoded: list[Decoded] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._socket.recv(1 << 18)
            except TimeoutError:
                continue
            self.decoded.append(decode(data, time.monotonic_ns(), time.time_ns()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close()

    def opens(self, state: int, worker: int | None = None) -> list[dict[str, int]]:
        """Open records of `state` (from `worker`), as dicts, in arrival order."""
        return [{name: int(record[name]) for name in record.dtype.names or ()}
                for d in self.decoded if worker is None or d.source.worker == worker
                for record in d.opens if record["state"] == state]

    def rows(self, kind: str) -> list[dict[str, int]]:
        return [{name: int(record[name]) for name in record.dtype.names or ()}
                for d in self.decoded for record in getattr(d, kind)]


@pytest.fixture
def datagrams(tmp_path: Path) -> Iterator[Datagrams]:
    path = str(tmp_path / "events.sock")
    received = Datagrams(path)
    transport.configure(path)
    yield received
    transport.sender().close()
    received.close()


class HangingFile:
    """A file whose first read hangs HANG_S: the dataset's storage stalls once."""

    def __init__(self, path: Path, hang: bool) -> None:
        self._file = path.open("rb")
        self._hang = hang

    def read(self, size: int = -1) -> bytes:
        if self._hang:
            self._hang = False
            time.sleep(HANG_S)
        return self._file.read(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


class Files(Dataset[torch.Tensor]):
    def __init__(self, paths: list[Path], hang_index: int = -1, delay_s: float = 0.0) -> None:
        self.paths, self.hang_index, self.delay_s = paths, hang_index, delay_s

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay_s)
        file = HangingFile(self.paths[index], index == self.hang_index)
        with RecordedFile(file, str(self.paths[index])) as recorded:  # type: ignore[arg-type]
            recorded.read()
        return torch.tensor(index)


def files(tmp_path: Path, count: int) -> list[Path]:
    paths = [tmp_path / f"sample-{index}.bin" for index in range(count)]
    for path in paths:
        path.write_bytes(b"x" * 64)
    return paths


@pytest.mark.slow
def test_a_hanging_read_is_seen_while_it_hangs(datagrams: Datagrams, tmp_path: Path) -> None:
    paths = files(tmp_path, 8)
    loader = instrument(DataLoader(Files(paths, HANG_INDEX), batch_size=2, num_workers=2), job="open", rank=0)
    for _ in loader:
        time.sleep(0.01)
    looped_at = time.monotonic_ns()
    hung_key = read_key(str(paths[HANG_INDEX]), 0)

    def hung_reads() -> list[dict[str, int]]:
        return [read for read in datagrams.rows("reads") if read["key"] == hung_key]

    # The workers' last datagrams may come after the trainer's (a busy machine delays their flushes).
    wait_for("the loop's end and the hung read at the agent",
             lambda: bool(datagrams.opens(wire.OPEN_ENDED) and hung_reads()), 10)
    (hung,) = hung_reads()
    batch = hung["batch"]
    wait_for("the hung batch's handover", lambda: any(
        record["batch"] == batch for record in datagrams.opens(wire.OPEN_HANDED)), 10)
    steps = {step["batch"]: step for step in datagrams.rows("steps")}
    assert len(steps) == 4 and hung["end_ns"] - hung["start_ns"] >= HANG_S * 1e9

    # The trainer's wait, while it lasted, from exactly the start its step carries.
    waits = datagrams.opens(wire.OPEN_WAIT, worker=-1)
    assert any(wait["since_ns"] == steps[batch]["wait_start_ns"] for wait in waits)
    for wait in waits:
        (step,) = [step for step in steps.values() if step["wait_start_ns"] == wait["since_ns"]]
        assert step["wait_start_ns"] + transport.OPEN_AFTER_NS <= wait["as_of_ns"] <= step["wait_end_ns"]
        assert wait["batch"] == -1 and wait["key"] == 0

    # The worker's read and batch, while the read hung; then its handover, at the step's own stamp.
    worker = next(d.source.worker for d in datagrams.decoded if len(d.reads) and hung_key in d.reads["key"])
    reads = [read for read in datagrams.opens(wire.OPEN_READ, worker) if read["key"] == hung_key]
    assert reads and all(read["batch"] == batch and read["since_ns"] == hung["start_ns"] <= read["as_of_ns"]
                         <= hung["end_ns"] for read in reads)
    building = [record for record in datagrams.opens(wire.OPEN_BATCH, worker) if record["batch"] == batch]
    assert all(record["since_ns"] <= hung["start_ns"] and record["as_of_ns"] <= steps[batch]["ready_ns"]
               for record in building)
    assert any(hung["start_ns"] <= record["as_of_ns"] <= hung["end_ns"] for record in building)
    assert {record["since_ns"] for record in datagrams.opens(wire.OPEN_HANDED, worker)
            if record["batch"] == batch} == {steps[batch]["ready_ns"]}

    # A stall of 2 s: datagrams with only open records went while it lasted, from both sides.
    alone = {d.source.worker for d in datagrams.decoded if not len(d.steps) and not len(d.reads) and len(d.opens)}
    assert {-1, worker} <= alone

    # The loop's end, at its last step's end.
    (ended,) = datagrams.opens(wire.OPEN_ENDED, worker=-1)
    assert ended["since_ns"] == max(step["compute_end_ns"] for step in steps.values()) <= looped_at


def test_a_steady_job_sends_no_datagram_of_open_records_alone(datagrams: Datagrams, tmp_path: Path) -> None:
    loader = instrument(DataLoader(Files(files(tmp_path, 64), delay_s=0.003), batch_size=4), job="steady", rank=0)
    for _ in loader:  # ~12 ms a batch, built in this process: waits far below OPEN_AFTER_NS
        time.sleep(0.02)
    for _ in monitor(range(40), job="steady", rank=0):
        time.sleep(0.02)
    wait_for("both loops' ends at the agent", lambda: len(datagrams.opens(wire.OPEN_ENDED)) == 2, 10)
    assert len(datagrams.rows("steps")) == 16 + 40
    alone = [[(int(r["state"]), int(r["batch"]), int(r["key"])) for r in d.opens] for d in datagrams.decoded
             if len(d.opens) and not len(d.steps) and not len(d.reads)]
    assert not alone, f"datagrams of open records alone, as (state, batch, key): {alone}"
    assert not datagrams.opens(wire.OPEN_WAIT)
    # Open records rode along: the batch built or handed over as the flush looked.
    assert datagrams.opens(wire.OPEN_HANDED)


def test_a_loop_of_known_length_reports_its_progress_with_the_steps_it_sends(datagrams: Datagrams,
                                                                           tmp_path: Path) -> None:
    """Each epoch of a DataLoader over a map-style dataset (len() 16) and of `monitor(range(40))`: OPEN_EPOCH rides
    with the steps, its count of steps taken rising within the length (the loop's end, not its progress, goes with
    its last steps); an iterable without a length reports none."""
    loader = instrument(DataLoader(Files(files(tmp_path, 64), delay_s=0.003), batch_size=4, num_workers=2),
                        job="epochs", rank=0)
    for _ in range(2):
        for _ in loader:
            time.sleep(0.02)
    for _ in monitor(range(40), job="epochs", rank=0):
        time.sleep(0.01)
    for _ in monitor(iter(range(10)), job="epochs", rank=0):
        time.sleep(0.01)
    wait_for("the four loops' ends at the agent", lambda: len(datagrams.opens(wire.OPEN_ENDED)) == 4, 10)
    loops: dict[int, list[dict[str, int]]] = {}
    for record in datagrams.opens(wire.OPEN_EPOCH, worker=-1):
        loops.setdefault(record["since_ns"], []).append(record)  # each loop by its start
    assert [loop[0]["key"] for loop in loops.values()] == [16, 16, 40]  # the loaders' len(); no length, none
    for loop in loops.values():
        done = [record["batch"] for record in loop]
        assert done == sorted(done) and done[-1] <= loop[0]["key"]
        assert all(r["key"] == loop[0]["key"] for r in loop)
    # It rides with what made the flush send: steps; the loop before's end when that loop's own flush gave up
    # (the next test); or a wait reported while it lasts (an epoch's first batch, its workers starting on a
    # busy machine). At 0 steps in the last two.
    def carried(d: Decoded) -> bool:
        return len(d.steps) > 0 or any(r["state"] == wire.OPEN_ENDED or (
            r["state"] == wire.OPEN_WAIT and r["as_of_ns"] - r["since_ns"] >= transport.OPEN_AFTER_NS) for r in d.opens)

    alone = [[(int(r["state"]), int(r["batch"]), (int(r["as_of_ns"]) - int(r["since_ns"])) // 1_000_000)
              for r in d.opens] for d in datagrams.decoded
             if any(r["state"] == wire.OPEN_EPOCH for r in d.opens) and not carried(d)]
    assert not alone, f"progress without what sent it, (state, batch, ms open) each: {alone}"


class SlowStart:
    """Five batches, the first after `first_s` (workers starting, a cold cache)."""

    def __init__(self, first_s: float) -> None:
        self.first_s = first_s

    def __len__(self) -> int:
        return 5

    def __iter__(self) -> Iterator[int]:
        time.sleep(self.first_s)
        yield from range(5)


def test_an_epochs_progress_goes_with_a_wait_reported_while_it_lasts(datagrams: Datagrams) -> None:
    """An epoch whose first batch takes 0.6 s: the flushes during that wait send it as it lasts (OPEN_WAIT), the
    epoch's progress beside it at 0 steps, with no step yet to carry them."""
    for _ in monitor(SlowStart(0.6), job="slow-start", rank=0):
        time.sleep(0.01)
    wait_for("the loop's end at the agent", lambda: len(datagrams.opens(wire.OPEN_ENDED)) == 1, 10)
    during = [{int(r["state"]): r for r in d.opens} for d in datagrams.decoded if len(d.steps) == 0
              and any(r["state"] == wire.OPEN_WAIT for r in d.opens)]
    assert during, [(len(d.steps), d.opens) for d in datagrams.decoded]
    for records in during:
        assert records[wire.OPEN_WAIT]["as_of_ns"] - records[wire.OPEN_WAIT]["since_ns"] >= transport.OPEN_AFTER_NS
        assert (records[wire.OPEN_EPOCH]["batch"], records[wire.OPEN_EPOCH]["key"]) == (0, 5)  # 0 of 5 steps


def test_a_loop_reading_in_this_process_names_no_batch_handed_over_before_it(datagrams: Datagrams,
                                                                             tmp_path: Path) -> None:
    """A loader without workers hands its batches over in this process; a later loop of another job here (reading
    in this process too) has none handed over yet: the open records its flushes send during its first wait name
    no batch of the loader's."""
    for _ in instrument(DataLoader(Files(files(tmp_path, 8)), batch_size=4), job="first", rank=0):
        pass
    for _ in monitor(SlowStart(0.6), job="second", rank=0):
        pass
    wait_for("both loops' ends at the agent", lambda: len(datagrams.opens(wire.OPEN_ENDED)) == 2, 10)
    second = [(int(r["state"]), int(r["batch"])) for d in datagrams.decoded if d.source.job == "second"
              for r in d.opens]
    assert wire.OPEN_WAIT in {state for state, _ in second}, second  # its flushes sent open records
    assert not [record for record in second if record[0] == wire.OPEN_HANDED], second


def test_a_loops_end_whose_flush_gave_up_goes_with_the_next_flush(datagrams: Datagrams) -> None:
    """Another thread holds the sender as the first loop ends, longer than a loop's flush waits (50 ms): that
    flush gives up, never holding the trainer. The loop's end goes with the flush thread's next flush, while
    the next loop takes its first step, beside that loop's progress: 0 of its 40 steps."""
    sender = transport.sender()
    for step in monitor(range(8), job="ends", rank=0):
        if step == 7:  # the last step: the sender is busy until after the loop has ended
            sender._lock.acquire()
            threading.Timer(0.25, sender._lock.release).start()
        time.sleep(0.01)
    first_end = time.monotonic_ns()
    for step in monitor(range(40), job="ends", rank=0):
        time.sleep(1.0 if step == 0 else 0.01)
    wait_for("both loops' ends at the agent", lambda: len(datagrams.opens(wire.OPEN_ENDED)) == 2, 10)
    steps = datagrams.rows("steps")
    assert len(steps) == 48
    ended = [d for d in datagrams.decoded if any(r["state"] == wire.OPEN_ENDED for r in d.opens)]
    first = [r for r in ended[0].opens if r["state"] == wire.OPEN_ENDED]
    assert first[0]["since_ns"] == sorted(step["compute_end_ns"] for step in steps)[7] < first_end
    assert [(int(r["batch"]), int(r["key"])) for r in ended[0].opens if r["state"] == wire.OPEN_EPOCH] == [(0, 40)]


def test_reads_in_a_monitored_loops_process_are_the_loops_job(datagrams: Datagrams, tmp_path: Path) -> None:
    """A loop with no loader workers (`monitor(job=...)`, reads in the same process): its reads carry the
    loop's job and rank, so the correlator joins them to its stalls (they went to `unknown` before); after
    the loop, the environment's source again."""
    paths = files(tmp_path, 3)
    for _ in monitor(range(5), job="mine", rank=3):
        for path in paths:
            with open_recorded(path) as f:
                f.read()
    with open_recorded(paths[0]) as f:
        f.read()
    wait_for("the reads", lambda: sum(len(d.reads) for d in datagrams.decoded) == 16, 10)
    by_source = Counter((d.source.job, d.source.rank) for d in datagrams.decoded for _ in d.reads)
    assert by_source[("mine", 3)] == 15 and sum(by_source.values()) == 16, by_source


def test_a_wait_is_reported_from_the_loops_start_and_a_loop_inside_a_step_gives_it_back(
    datagrams: Datagrams,
) -> None:
    def slow(items: int, delay_s: float) -> Iterator[int]:
        for item in range(items):
            time.sleep(delay_s)
            yield item

    for _ in monitor(slow(2, 0.5), job="nested", rank=0):
        for _ in monitor(slow(1, 0.5), job="nested", rank=0):  # the same source: a validation loop, say
            pass
    wait_for("three loops' ends", lambda: len(datagrams.opens(wire.OPEN_ENDED)) == 3, 10)
    steps = datagrams.rows("steps")
    assert len(steps) == 4
    waits = datagrams.opens(wire.OPEN_WAIT)
    starts = {step["wait_start_ns"]: step for step in steps}
    assert {wait["since_ns"] for wait in waits} == set(starts)  # every wait of 0.5 s was seen, the first too
    assert all(wait["as_of_ns"] <= starts[wait["since_ns"]]["wait_end_ns"] for wait in waits)


# --- the wire -----------------------------------------------------------------------------------------
NOW, WALL = 10**15, 1_700_000_000 * 10**9
SOURCE = wire.Source("job", 3, 1, 2)
STEP = (7, NOW - 300, NOW - 200, NOW - 100, NOW - 250)
OPEN = (wire.OPEN_READ, 7, 42, NOW - 50, NOW - 10)


def encoded(opens: list[wire.Open], mono_ns: int = NOW, wall_ns: int = WALL) -> bytes:
    return wire.encode(SOURCE, [STEP], [], 1, 0, 0, mono_ns, wall_ns, opens)


def test_open_records_round_trip_and_move_with_the_clients_clock() -> None:
    opens = [OPEN, (wire.OPEN_WAIT, -1, 0, NOW - 900, NOW - 10), (wire.OPEN_HANDED, 6, 0, NOW - 70, NOW - 10),
             (wire.OPEN_EPOCH, 40, 100, NOW - 2 * MAX_EVENT_AGE_NS, NOW - 10)]  # an epoch older than other spans
    decoded = decode(encoded(opens), NOW, WALL)
    assert [tuple(int(value) for value in record) for record in decoded.opens] == opens
    assert decoded.events == 1  # open records are not events
    behind = 5 * 10**9  # a client whose monotonic clock (its own time namespace) runs 5 s behind ours
    batch, wait_start, wait_end, compute_end, ready = STEP
    step = (batch, wait_start - behind, wait_end - behind, compute_end - behind, ready - behind)
    their_opens = [(state, batch, key, since - behind, as_of - behind) for state, batch, key, since, as_of in opens]
    theirs = decode(wire.encode(SOURCE, [step], [], 1, 0, 0, NOW - behind, WALL, their_opens), NOW, WALL)
    assert (theirs.opens == decoded.opens).all()


def test_version_2_batches_still_decode() -> None:
    body = wire.encode_body(SOURCE, [STEP], b"")
    header = wire.HEADER_V2.pack(2, 1, 0, SOURCE.gpu, SOURCE.worker, SOURCE.rank, 1, 0, 4, NOW, WALL)
    decoded = decode(header + body, NOW, WALL)
    assert decoded.source == SOURCE and decoded.dropped == 4 and not len(decoded.opens)
    assert [tuple(int(value) for value in step) for step in decoded.steps] == [STEP]
    with pytest.raises(RejectedBatchError) as rejected:
        decode(header + body + wire.OPEN.pack(*OPEN), NOW, WALL)  # version 2 has no open records
    assert rejected.value.reason == "bad_length"


@pytest.mark.parametrize(("record", "reason"), [
    ((9, 7, 0, NOW - 50, NOW - 10), "bad_value"),  # no such state
    ((wire.OPEN_BATCH, -2, 0, NOW - 50, NOW - 10), "bad_value"),
    ((wire.OPEN_READ, 7, 42, NOW - 10, NOW - 50), "bad_timestamp"),  # open since after it was looked at
    ((wire.OPEN_READ, 7, 42, NOW - 50, NOW + 1), "bad_timestamp"),  # looked at after the batch was sent
    ((wire.OPEN_WAIT, -1, 0, NOW - MAX_EVENT_AGE_NS - 1, NOW - 10), "bad_timestamp"),  # open too long to be true
    ((wire.OPEN_EPOCH, 7, 100, NOW - MAX_EPOCH_AGE_NS - 1, NOW - 10), "bad_timestamp"),  # an epoch of a month
    ((wire.OPEN_EPOCH, -2, 100, NOW - 50, NOW - 10), "bad_value"),
    ((wire.OPEN_EPOCH, 0, 0, NOW - 50, NOW - 10), "bad_value"),  # an epoch of no steps
    ((wire.OPEN_EPOCH, 101, 100, NOW - 50, NOW - 10), "bad_value"),  # more steps taken than it has
    ((wire.OPEN_EPOCH, 1, 2**63, NOW - 50, NOW - 10), "bad_value"),
])
def test_malformed_open_records_reject_the_batch(record: wire.Open, reason: str) -> None:
    with pytest.raises(RejectedBatchError) as rejected:
        decode(encoded([OPEN, record]), NOW, WALL)
    assert rejected.value.reason == reason


def test_a_batch_cut_inside_its_open_records_is_truncated() -> None:
    with pytest.raises(RejectedBatchError) as rejected:
        decode(encoded([OPEN, OPEN])[:-1], NOW, WALL)
    assert rejected.value.reason == "truncated"


def test_open_records_are_counted_before_decoding_but_not_past_the_bytes() -> None:
    assert peek_events(encoded([OPEN, OPEN])) == 3
    forged = wire.HEADER.pack(wire.VERSION, 1, 0, -1, -1, 0, 0, 0, 2**32 - 1, 0, NOW, WALL) + b"\0\x03job"
    forged += wire.OPEN.pack(*OPEN) * 2
    assert peek_events(forged) == 2


def test_a_hanging_read_stays_in_flight_while_another_thread_reads(datagrams: Datagrams, tmp_path: Path) -> None:
    """A dataset reading on several threads: one read hangs while another thread's reads come and go; the
    hanging one is reported in flight all along (the other thread's reads used to end it)."""
    hung_path, quick_path = files(tmp_path, 2)
    with reads.reads_as(wire.Source("threads", 0, 0, 0)):
        hanging = threading.Thread(target=lambda: RecordedFile(HangingFile(hung_path, True),  # type: ignore[arg-type]
                                                               str(hung_path)).read())
        hanging.start()
        while hanging.is_alive():
            with RecordedFile(quick_path.open("rb"), str(quick_path)) as quick:
                quick.read()
            time.sleep(0.005)
        hung_key = read_key(str(hung_path), 0)
        wait_for("the hung read", lambda: hung_key in [read["key"] for read in datagrams.rows("reads")], 10)
    (hung,) = [read for read in datagrams.rows("reads") if read["key"] == hung_key]
    in_flight = [record for record in datagrams.opens(wire.OPEN_READ) if record["key"] == hung_key]
    late = [record for record in in_flight if record["as_of_ns"] >= hung["start_ns"] + HANG_S * 1e9 / 2]
    assert late and all(record["since_ns"] == hung["start_ns"] for record in in_flight)
