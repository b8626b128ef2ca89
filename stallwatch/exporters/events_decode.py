"""Decoding and validating one client batch (`stallwatch.client.wire`) into NumPy records.

A batch is accepted whole or rejected whole with one reason from REJECT_REASONS; nothing here
raises anything but `RejectedBatchError`, whatever the bytes. Checks, in order: the header fits and has our
version; the string table parses as printable UTF-8 job names of bounded length; the header's job id
names one of them; the record counts add up to exactly the bytes received; the source and record
values are in range; and every timestamp is plausible: the batch was sent between `MAX_QUEUE_AGE_NS`
ago and `FUTURE_SLACK_NS` from now, events end no later than it was sent and start at most
`MAX_EVENT_AGE_NS` before, each span starts before it ends.

Clocks: `time.monotonic_ns()` is one clock for all processes of a node, except in a container with
its own time namespace. The header carries the client's monotonic and wall clocks read together;
when its wall-minus-monotonic differs from ours by more than `CLOCK_TOLERANCE_NS`, the client's
monotonic clock is offset, and its timestamps are moved onto ours (after checking them against the
client's own send time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stallwatch.client import wire

REJECT_REASONS = (
    "truncated", "bad_version", "bad_length", "bad_string", "unknown_string", "bad_value", "bad_timestamp",
)
MAX_QUEUE_AGE_NS = 600 * 10**9
FUTURE_SLACK_NS = 10**9
MAX_EVENT_AGE_NS = 3600 * 10**9
CLOCK_TOLERANCE_NS = 2 * 10**9
_SANE_NS = 2**62
# Past these a value is a forgery or a bug, and summing a batch of them could wrap int64: a read of
# more than 1 TiB; more events dropped since the last delivered batch than a flood of a year holds.
MAX_READ_BYTES = 2**40
MAX_DROPPED = 2**48


def _dtype(fields: Sequence[tuple[str, str]]) -> np.dtype[np.void]:
    return np.dtype([(name, "<" + code) for name, code in fields])


STEP_DTYPE = _dtype(wire.STEP_FIELDS)
READ_DTYPE = _dtype(wire.READ_FIELDS)
assert STEP_DTYPE.itemsize == wire.STEP.size and READ_DTYPE.itemsize == wire.READ.size

Records = npt.NDArray[np.void]


class RejectedBatchError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Decoded:
    source: wire.Source
    dropped: int
    steps: Records
    reads: Records

    @property
    def events(self) -> int:
        return len(self.steps) + len(self.reads)


def peek_events(data: bytes, size: int | None = None) -> int:
    """The events a batch of `size` bytes (default: all of `data`) claims, for queue accounting before
    it is validated, but never more than its bytes could hold: a forged header must neither fill the
    queue nor inflate a counter (0 if unreadable)."""
    if len(data) < wire.HEADER.size:
        return 0
    header = wire.HEADER.unpack_from(data)
    room = (len(data) if size is None else size) - wire.HEADER.size
    return min(int(header[6]) + int(header[7]), room // min(wire.STEP.size, wire.READ.size))


def _strings(data: bytes, count: int) -> tuple[list[str], int]:
    strings, offset = [], wire.HEADER.size
    for _ in range(count):
        if offset + wire.STRING_LENGTH.size > len(data):
            raise RejectedBatchError("truncated", "string table")
        (length,) = wire.STRING_LENGTH.unpack_from(data, offset)
        offset += wire.STRING_LENGTH.size
        if offset + length > len(data):
            raise RejectedBatchError("truncated", "string table")
        try:
            text = data[offset:offset + length].decode()
        except UnicodeDecodeError as error:
            raise RejectedBatchError("bad_string", "not UTF-8") from error
        if not 0 < len(text) <= wire.MAX_JOB_NAME or not text.isprintable():
            raise RejectedBatchError("bad_string", "empty, too long or not printable")
        if text == wire.OVERFLOW_NAME:
            raise RejectedBatchError("bad_string", f"{wire.OVERFLOW_NAME} is reserved for folded jobs")
        strings.append(text)
        offset += length
    return strings, offset


def _check_values(rank: int, gpu: int, worker: int, steps: Records, reads: Records) -> None:
    if rank < 0 or gpu < -1 or worker < -1:
        raise RejectedBatchError("bad_value", "source out of range")
    if (steps["batch"] < -1).any() or (reads["batch"] < -1).any():
        raise RejectedBatchError("bad_value", "batch below -1")
    if ((reads["bytes"] < 0) | (reads["bytes"] > MAX_READ_BYTES)).any():
        raise RejectedBatchError("bad_value", "read bytes out of range")
    if ((reads["verdict"] < wire.VERDICT_UNKNOWN) | (reads["verdict"] > wire.VERDICT_MISS)).any():
        raise RejectedBatchError("bad_value", "unknown verdict")


def _check_times(sent_ns: int, steps: Records, reads: Records) -> None:
    """Every span in [sent_ns - MAX_EVENT_AGE_NS, sent_ns] and in order, on the client's own clock."""
    oldest = sent_ns - MAX_EVENT_AGE_NS
    spans = (
        (steps["wait_start_ns"], steps["wait_end_ns"]),
        (steps["wait_end_ns"], steps["compute_end_ns"]),
        (reads["start_ns"], reads["end_ns"]),
    )
    for start, end in spans:
        if len(start) and ((start < oldest) | (start > end) | (end > sent_ns)).any():
            raise RejectedBatchError("bad_timestamp", "event outside the batch's time range or ending before it starts")


def _shift(records: Records, fields: Sequence[str], offset_ns: int) -> Records:
    shifted = records.copy()
    for name in fields:
        shifted[name] += offset_ns
    return shifted


def decode(data: bytes, now_ns: int, wall_now_ns: int) -> Decoded:
    """Validate and decode one batch; `now_ns` and `wall_now_ns` are the agent's clocks."""
    if len(data) < wire.HEADER.size:
        raise RejectedBatchError("truncated", f"{len(data)} bytes, header needs {wire.HEADER.size}")
    version, n_strings, job, gpu, worker, rank, n_steps, n_reads, dropped, mono_ns, wall_ns = (
        wire.HEADER.unpack_from(data)
    )
    if version != wire.VERSION:
        raise RejectedBatchError("bad_version", f"version {version}, expected {wire.VERSION}")
    strings, offset = _strings(data, n_strings)
    if job >= len(strings):
        raise RejectedBatchError("unknown_string", f"job id {job} of {len(strings)} strings")
    expected = offset + n_steps * wire.STEP.size + n_reads * wire.READ.size
    if expected > len(data):
        raise RejectedBatchError("truncated", f"{len(data)} bytes, records need {expected}")
    if expected < len(data):
        raise RejectedBatchError("bad_length", f"{len(data) - expected} bytes after the records")
    steps: Records = np.frombuffer(data, STEP_DTYPE, n_steps, offset)
    reads: Records = np.frombuffer(data, READ_DTYPE, n_reads, offset + n_steps * wire.STEP.size)
    _check_values(rank, gpu, worker, steps, reads)
    if dropped > MAX_DROPPED:
        raise RejectedBatchError("bad_value", "dropped count out of range")
    clock_offset = (wall_ns - mono_ns) - (wall_now_ns - now_ns)  # add to a client time to get ours
    if not 0 < mono_ns < _SANE_NS or abs(clock_offset) > _SANE_NS // 2:
        raise RejectedBatchError("bad_timestamp", "client clock out of range")  # and int64 arithmetic stays exact
    _check_times(mono_ns, steps, reads)
    if abs(clock_offset) <= CLOCK_TOLERANCE_NS:
        clock_offset = 0
    if not now_ns - MAX_QUEUE_AGE_NS <= mono_ns + clock_offset <= now_ns + FUTURE_SLACK_NS:
        raise RejectedBatchError("bad_timestamp", "batch sent too long ago or in the future")
    if clock_offset:
        steps = _shift(steps, ("wait_start_ns", "wait_end_ns", "compute_end_ns"), clock_offset)
        reads = _shift(reads, ("start_ns", "end_ns"), clock_offset)
    return Decoded(wire.Source(strings[job], rank, gpu, worker, _attributes(strings, job).get(wire.GPU_UUID, "")),
                   dropped, steps, reads)


def _attributes(strings: list[str], job: int) -> dict[str, str]:
    """The source's `name=value` strings (every string but the job's); names it does not know are ignored."""
    found = {}
    for index, text in enumerate(strings):
        if index != job:
            name, equals, value = text.partition("=")
            if not equals or not value:
                raise RejectedBatchError("bad_string", "a source attribute is not name=value")
            found[name] = value
    return found
