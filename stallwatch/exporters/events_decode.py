"""Decoding and validating one client batch (`stallwatch.client.wire`) into NumPy records.

A batch is accepted whole or rejected whole with one reason from REJECT_REASONS; nothing here
raises anything but `RejectedBatchError`, whatever the bytes. Checks, in order: the header fits and
has a version we read (`wire.VERSION`, or 2: `wire.HEADER_V2`, no open records); the string table
parses as printable UTF-8 job names of bounded length; the header's job id names one of them; the
record counts add up to exactly the bytes received; the source and record values are in range; and
every timestamp is plausible: the batch was sent between `MAX_QUEUE_AGE_NS` ago and
`FUTURE_SLACK_NS` from now, events end no later than it was sent and start at most
`MAX_EVENT_AGE_NS` before, each span starts before it ends; an open record was open since no
earlier than that (an epoch's progress, `wire.OPEN_EPOCH`: `MAX_EPOCH_AGE_NS`), and looked at (`as_of_ns`)
after its start and no later than the batch was sent.

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
MAX_EPOCH_AGE_NS = 30 * 86400 * 10**9  # an epoch over a large dataset runs for hours or days
MAX_EPOCH_STEPS = 2**40
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
OPEN_DTYPE = _dtype(wire.OPEN_FIELDS)
assert STEP_DTYPE.itemsize == wire.STEP.size and READ_DTYPE.itemsize == wire.READ.size
assert OPEN_DTYPE.itemsize == wire.OPEN.size
# The version 2 header, decoded as version 3 with no open records: the fields before n_open, and after.
_V2_SPLIT = [name for name, _ in wire.HEADER_FIELDS].index("n_open")

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
    opens: Records  # what the source had in flight (`wire.OPEN_FIELDS`); none from a version 2 client

    @property
    def events(self) -> int:
        return len(self.steps) + len(self.reads)


def _header(data: bytes) -> tuple[tuple[int, ...], int] | None:
    """The header's fields in HEADER_FIELDS order (n_open 0 for version 2) and its size; None if the bytes
    are too few or the version is not one we read."""
    version = data[0] if data else None
    if version == wire.VERSION and len(data) >= wire.HEADER.size:
        return wire.HEADER.unpack_from(data), wire.HEADER.size
    if version == 2 and len(data) >= wire.HEADER_V2.size:
        fields = wire.HEADER_V2.unpack_from(data)
        return (*fields[:_V2_SPLIT], 0, *fields[_V2_SPLIT:]), wire.HEADER_V2.size
    return None


_SMALLEST_RECORD = min(wire.STEP.size, wire.READ.size, wire.OPEN.size)


def peek_events(data: bytes, size: int | None = None) -> int:
    """The records (events and open records) a batch of `size` bytes (default: all of `data`) claims,
    for queue accounting before it is validated, but never more than its bytes could hold: a forged
    header must neither fill the queue nor inflate a counter (0 if unreadable)."""
    found = _header(data)
    if found is None:
        return 0
    header, header_size = found
    room = (len(data) if size is None else size) - header_size
    return min(int(header[6]) + int(header[7]) + int(header[8]), room // _SMALLEST_RECORD)


def _strings(data: bytes, count: int, offset: int) -> tuple[list[str], int]:
    strings = []
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


def _check_values(rank: int, gpu: int, worker: int, steps: Records, reads: Records, opens: Records) -> None:
    if rank < 0 or gpu < -1 or worker < -1:
        raise RejectedBatchError("bad_value", "source out of range")
    if (steps["batch"] < -1).any() or (reads["batch"] < -1).any() or (opens["batch"] < -1).any():
        raise RejectedBatchError("bad_value", "batch below -1")
    if not np.isin(opens["state"], wire.OPEN_STATES).all():
        raise RejectedBatchError("bad_value", "unknown open state")
    epochs = opens[opens["state"] == wire.OPEN_EPOCH]
    length = epochs["key"]
    if ((length < 1) | (length > MAX_EPOCH_STEPS) | (epochs["batch"] > length.astype(np.int64))).any():
        raise RejectedBatchError("bad_value", "an epoch's steps out of range")
    if ((reads["bytes"] < 0) | (reads["bytes"] > MAX_READ_BYTES)).any():
        raise RejectedBatchError("bad_value", "read bytes out of range")
    if ((reads["verdict"] < wire.VERDICT_UNKNOWN) | (reads["verdict"] > wire.VERDICT_DIRECT)).any():
        raise RejectedBatchError("bad_value", "unknown verdict")


def _check_times(sent_ns: int, steps: Records, reads: Records, opens: Records) -> None:
    """Every span in [sent_ns - MAX_EVENT_AGE_NS, sent_ns] and in order, on the client's own clock."""
    oldest = sent_ns - MAX_EVENT_AGE_NS
    epoch = opens["state"] == wire.OPEN_EPOCH
    spans = (
        (steps["wait_start_ns"], steps["wait_end_ns"], oldest),
        (steps["wait_end_ns"], steps["compute_end_ns"], oldest),
        (reads["start_ns"], reads["end_ns"], oldest),
        (opens["since_ns"], opens["as_of_ns"], np.where(epoch, sent_ns - MAX_EPOCH_AGE_NS, oldest)),
    )
    for start, end, earliest in spans:
        if len(start) and ((start < earliest) | (start > end) | (end > sent_ns)).any():
            raise RejectedBatchError("bad_timestamp", "event outside the batch's time range or ending before it starts")
    ready = steps["ready_ns"]
    if ((ready != -1) & ((ready < oldest) | (ready > sent_ns))).any():
        raise RejectedBatchError("bad_timestamp", "a batch handed over outside the batch's time range")


def _shift(records: Records, fields: Sequence[str], offset_ns: int) -> Records:
    shifted = records.copy()
    for name in fields:
        shifted[name] += offset_ns
    return shifted


def decode(data: bytes, now_ns: int, wall_now_ns: int) -> Decoded:
    """Validate and decode one batch; `now_ns` and `wall_now_ns` are the agent's clocks."""
    found = _header(data)
    if found is None:
        if len(data) >= wire.HEADER_V2.size and data[0] not in (2, wire.VERSION):
            raise RejectedBatchError("bad_version", f"version {data[0]}, expected 2 or {wire.VERSION}")
        raise RejectedBatchError("truncated", f"{len(data)} bytes, too few for a header")
    (_, n_strings, job, gpu, worker, rank, n_steps, n_reads, n_open, dropped, mono_ns, wall_ns), offset = found
    strings, offset = _strings(data, n_strings, offset)
    if job >= len(strings):
        raise RejectedBatchError("unknown_string", f"job id {job} of {len(strings)} strings")
    reads_at = offset + n_steps * wire.STEP.size
    opens_at = reads_at + n_reads * wire.READ.size
    expected = opens_at + n_open * wire.OPEN.size
    if expected > len(data):
        raise RejectedBatchError("truncated", f"{len(data)} bytes, records need {expected}")
    if expected < len(data):
        raise RejectedBatchError("bad_length", f"{len(data) - expected} bytes after the records")
    steps: Records = np.frombuffer(data, STEP_DTYPE, n_steps, offset)
    reads: Records = np.frombuffer(data, READ_DTYPE, n_reads, reads_at)
    opens: Records = np.frombuffer(data, OPEN_DTYPE, n_open, opens_at)
    _check_values(rank, gpu, worker, steps, reads, opens)
    if dropped > MAX_DROPPED:
        raise RejectedBatchError("bad_value", "dropped count out of range")
    clock_offset = (wall_ns - mono_ns) - (wall_now_ns - now_ns)  # add to a client time to get ours
    if not 0 < mono_ns < _SANE_NS or abs(clock_offset) > _SANE_NS // 2:
        raise RejectedBatchError("bad_timestamp", "client clock out of range")  # and int64 arithmetic stays exact
    _check_times(mono_ns, steps, reads, opens)
    if abs(clock_offset) <= CLOCK_TOLERANCE_NS:
        clock_offset = 0
    if not now_ns - MAX_QUEUE_AGE_NS <= mono_ns + clock_offset <= now_ns + FUTURE_SLACK_NS:
        raise RejectedBatchError("bad_timestamp", "batch sent too long ago or in the future")
    if clock_offset:
        known = steps["ready_ns"] != -1
        steps = _shift(steps, ("wait_start_ns", "wait_end_ns", "compute_end_ns", "ready_ns"), clock_offset)
        steps["ready_ns"][~known] = -1
        reads = _shift(reads, ("start_ns", "end_ns"), clock_offset)
        opens = _shift(opens, ("since_ns", "as_of_ns"), clock_offset)
    return Decoded(wire.Source(strings[job], rank, gpu, worker, _attributes(strings, job).get(wire.GPU_UUID, "")),
                   dropped, steps, reads, opens)


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
