"""The client's wire format: what the encoder writes the agent's decoder reads back, and nothing else."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallwatch.client import wire
from stallwatch.eventbatch import Verdict
from stallwatch.exporters.events_decode import MAX_DROPPED, MAX_READ_BYTES, REJECT_REASONS, RejectedBatchError, decode

NOW = time.monotonic_ns()
WALL = time.time_ns()
HOUR = 3600 * 10**9

job_names = st.text(min_size=1, max_size=wire.MAX_JOB_NAME).filter(str.isprintable)
gpu_uuids = st.one_of(st.just(""), st.builds("{}-{}".format, st.sampled_from(["GPU", "MIG"]), st.uuids()))
sources = st.builds(
    wire.Source, job_names, st.integers(0, 2**31 - 1), st.integers(-1, 2**15 - 1), st.integers(-1, 2**15 - 1),
    gpu_uuids,
)
ages = st.integers(0, HOUR - 1)
durations = st.integers(0, 10**9)
batches = st.integers(-1, 2**62)


@st.composite
def steps(draw: st.DrawFn) -> wire.Step:
    compute_end = NOW - draw(st.integers(0, 10**10))
    wait_end = compute_end - draw(durations)
    wait_start = max(wait_end - draw(durations), NOW - HOUR + 1)
    ready = draw(st.one_of(st.just(-1), st.integers(wait_start, compute_end)))
    return (draw(batches), wait_start, min(wait_end, compute_end), compute_end, ready)


@st.composite
def reads(draw: st.DrawFn) -> wire.Read:
    end = NOW - draw(ages)
    start = max(end - draw(durations), NOW - HOUR)
    verdict = draw(st.sampled_from([wire.VERDICT_UNKNOWN, wire.VERDICT_HIT, wire.VERDICT_MISS]))
    return (draw(batches), draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**40)), start, end, verdict)


def encode(source: wire.Source, step_rows: list[wire.Step], read_rows: list[wire.Read], dropped: int = 0,
           mono_ns: int = NOW, wall_ns: int = WALL) -> bytes:
    return wire.encode(source, step_rows, read_rows, len(step_rows), len(read_rows), dropped, mono_ns, wall_ns)


def rows(records: np.ndarray, fields: tuple[tuple[str, str], ...]) -> list[tuple[int, ...]]:
    return [tuple(int(record[name]) for name, _ in fields) for record in records]


@settings(max_examples=150, deadline=None)
@given(sources, st.lists(steps(), max_size=40), st.lists(reads(), max_size=40), st.integers(0, MAX_DROPPED))
def test_round_trip(source: wire.Source, step_rows: list[wire.Step], read_rows: list[wire.Read], dropped: int) -> None:
    decoded = decode(encode(source, step_rows, read_rows, dropped), NOW, WALL)
    assert decoded.source == source
    assert decoded.dropped == dropped
    assert rows(decoded.steps, wire.STEP_FIELDS) == step_rows
    assert rows(decoded.reads, wire.READ_FIELDS) == read_rows


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_are_rejected_with_a_reason(data: bytes) -> None:
    try:
        decode(data, NOW, WALL)
    except RejectedBatchError as rejected:
        assert rejected.reason in REJECT_REASONS


@settings(max_examples=150, deadline=None)
@given(sources, st.lists(steps(), max_size=5), st.lists(reads(), max_size=5), st.data())
def test_truncated_and_padded_batches_are_rejected(
    source: wire.Source, step_rows: list[wire.Step], read_rows: list[wire.Read], data: st.DataObject
) -> None:
    whole = encode(source, step_rows, read_rows)
    cut = data.draw(st.integers(0, len(whole) - 1))
    with pytest.raises(RejectedBatchError) as truncated:
        decode(whole[:cut], NOW, WALL)
    assert truncated.value.reason == "truncated"
    with pytest.raises(RejectedBatchError) as padded:
        decode(whole + data.draw(st.binary(min_size=1, max_size=64)), NOW, WALL)
    assert padded.value.reason in ("bad_length", "truncated")  # extra bytes may read as more records


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_flipped_byte_never_crashes_the_decoder(data: st.DataObject) -> None:
    whole = bytearray(encode(data.draw(sources), data.draw(st.lists(steps(), max_size=5)),
                             data.draw(st.lists(reads(), max_size=5))))
    position = data.draw(st.integers(0, len(whole) - 1))
    whole[position] ^= data.draw(st.integers(1, 255))
    try:
        decode(bytes(whole), NOW, WALL)
    except RejectedBatchError as rejected:
        assert rejected.reason in REJECT_REASONS


SOURCE = wire.Source("job-a", 1, 0, 2)
STEP = (7, NOW - 300, NOW - 200, NOW - 100, NOW - 250)
READ = (7, 42, 4096, NOW - 50, NOW - 10, wire.VERDICT_MISS)


@pytest.mark.parametrize(("batch", "reason"), [
    (b"\x01" + encode(SOURCE, [STEP], [])[1:], "bad_version"),  # a client of the version before
    (encode(SOURCE, [STEP], [])[:3] + b"\x01\x00" + encode(SOURCE, [STEP], [])[5:], "unknown_string"),
    (encode(wire.Source("bad\nname", 0), [STEP], []), "bad_string"),
    (encode(wire.Source("x" * (wire.MAX_JOB_NAME + 1), 0), [STEP], []), "bad_string"),
    (encode(wire.Source("job", -1), [STEP], []), "bad_value"),
    (encode(SOURCE, [], [(*READ[:5], 5)]), "bad_value"),
    (encode(SOURCE, [], [(7, 42, -1, *READ[3:])]), "bad_value"),
    (encode(SOURCE, [], [(7, 42, MAX_READ_BYTES + 1, *READ[3:])]), "bad_value"),
    (encode(SOURCE, [STEP], [], dropped=MAX_DROPPED + 1), "bad_value"),
    (encode(wire.Source(wire.OVERFLOW_NAME, 0), [STEP], []), "bad_string"),
    (encode(SOURCE, [(7, NOW - 100, NOW - 200, NOW, -1)], []), "bad_timestamp"),
    (encode(SOURCE, [(7, NOW - 300, NOW - 200, NOW - 100, NOW + 10)], []), "bad_timestamp"),
    (encode(SOURCE, [], [(*READ[:3], NOW - 10, NOW + 10, 0)]), "bad_timestamp"),
    (encode(SOURCE, [STEP], [], mono_ns=NOW + 60 * 10**9, wall_ns=WALL + 60 * 10**9), "bad_timestamp"),
    (encode(SOURCE, [(7, NOW - 2 * HOUR, NOW - 200, NOW - 100, -1)], []), "bad_timestamp"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_each_check_rejects_with_its_reason(batch: bytes, reason: str) -> None:
    with pytest.raises(RejectedBatchError) as rejected:
        decode(batch, NOW, WALL)
    assert rejected.value.reason == reason


GPU_UUID = "GPU-6a1b2c3d-0000-4000-8000-00000000fa4e"


def test_the_gpu_uuid_rides_in_the_string_table_where_an_older_agent_skips_it() -> None:
    with_uuid = encode(wire.Source("job-a", 1, 0, 2, GPU_UUID), [STEP], [READ])
    without = encode(SOURCE, [STEP], [READ])
    header, older_header = wire.HEADER.unpack_from(with_uuid), wire.HEADER.unpack_from(without)
    assert header[0] == older_header[0] == wire.VERSION and header[1] == 2 and older_header[1] == 1
    assert header[2:] == older_header[2:]  # the job is still string 0, every other field unchanged
    assert decode(with_uuid, NOW, WALL).source.gpu_uuid == GPU_UUID
    assert decode(without, NOW, WALL).source.gpu_uuid == ""
    renamed = with_uuid.replace(b"gpu_uuid=", b"future_a=")  # an attribute a later client may add
    assert decode(renamed, NOW, WALL).source == SOURCE
    with pytest.raises(RejectedBatchError) as rejected:
        decode(with_uuid.replace(b"gpu_uuid=", b"gpu_uuid:"), NOW, WALL)
    assert rejected.value.reason == "bad_string"


def test_a_client_in_another_time_namespace_is_moved_onto_the_agents_clock() -> None:
    ahead = 5_000 * 10**9  # the container's monotonic clock reads 5000 s more than the node's
    its_step = (STEP[0], STEP[1] + ahead, STEP[2] + ahead, STEP[3] + ahead, STEP[4] + ahead)
    not_handed = (*its_step[:4], -1)  # an unknown handover stays unknown
    decoded = decode(encode(SOURCE, [its_step, not_handed], [], mono_ns=NOW + ahead), NOW, WALL)
    assert rows(decoded.steps, wire.STEP_FIELDS) == [STEP, (*STEP[:4], -1)]


def test_verdict_numbers_match_the_batch_contract() -> None:
    assert (wire.VERDICT_UNKNOWN, wire.VERDICT_HIT, wire.VERDICT_MISS) == (Verdict.UNKNOWN, Verdict.HIT, Verdict.MISS)


def test_the_client_imports_without_numpy_or_torch() -> None:
    code = ("import sys; sys.modules['numpy'] = None; sys.modules['torch'] = None\n"
            "import stallwatch.client, stallwatch.client.wire; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.stdout.strip() == "ok", result.stderr
