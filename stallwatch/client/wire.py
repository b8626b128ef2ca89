"""The wire contract between training clients and the agent: one datagram is one batch.

Standard library only (the training client imports it); the agent decodes the same layout with
NumPy in `stallwatch.exporters.events_decode`, building its dtypes from the field tables below, so
the two sides cannot drift apart.

A batch, little-endian, no padding:

    header   HEADER: version, string count, the source (job string id, gpu, worker, rank),
             record counts, events the client dropped since its last delivered batch, and the
             client's clocks at send time (monotonic and wall, nanoseconds)
    strings  n_strings x (u16 length, UTF-8 bytes); the header's job is an index into them, the
             others are attributes of the source, `name=value` (`GPU_UUID`); a decoder ignores
             names it does not know, so attributes are added without a new version
    steps    n_steps x STEP records (STEP_FIELDS)
    reads    n_reads x READ records (READ_FIELDS)
    open     n_open x OPEN records (OPEN_FIELDS): what the source has in flight as of `as_of_ns`
             (version 3; a version 2 header has no n_open and no open records)

Every record of a batch comes from one source (job, rank, gpu, loader worker), so per-record fields
are only what changes from one event to the next.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import starmap

VERSION = 3  # 2: a step carries ready_ns; 3: open records (what is in flight)

# Where batches travel: the agent binds this Unix datagram socket (`--events.socket`), clients send
# to the path in SOCKET_ENV or, without it, to this default.
DEFAULT_SOCKET = "/var/run/stallwatch/events.sock"
SOCKET_ENV = "STALLWATCH_SOCKET"

HEADER_FIELDS: tuple[tuple[str, str], ...] = (
    ("version", "B"),
    ("n_strings", "H"),
    ("job", "H"),
    ("gpu", "h"),
    ("worker", "h"),
    ("rank", "i"),
    ("n_steps", "I"),
    ("n_reads", "I"),
    ("n_open", "I"),
    ("dropped", "Q"),
    ("mono_ns", "q"),
    ("wall_ns", "q"),
)
STEP_FIELDS: tuple[tuple[str, str], ...] = (
    ("batch", "q"),
    ("wait_start_ns", "q"),
    ("wait_end_ns", "q"),
    ("compute_end_ns", "q"),
    ("ready_ns", "q"),  # when a loader worker handed the step's batch over; -1 unknown
)
READ_FIELDS: tuple[tuple[str, str], ...] = (
    ("batch", "q"),
    ("key", "Q"),
    ("bytes", "q"),
    ("start_ns", "q"),
    ("end_ns", "q"),
    ("verdict", "b"),
)


def _layout(fields: Sequence[tuple[str, str]]) -> struct.Struct:
    return struct.Struct("<" + "".join(code for _, code in fields))


# What is in flight in the source when it flushes, so the agent knows a stall while it lasts (a step is
# sent only once its wait is over). `state` is one of the OPEN_* codes below; `as_of_ns` is when the
# source looked (every record of one flush shares it). Sent by the flush thread only, never per event.
OPEN_FIELDS: tuple[tuple[str, str], ...] = (
    ("state", "b"),
    ("batch", "q"),  # the batch the open work serves; -1 unknown
    ("key", "Q"),  # OPEN_READ: the read's key (`keys.read_key`); else 0
    ("since_ns", "q"),
    ("as_of_ns", "q"),
)
# The trainer (worker -1) is waiting in `next()` since `since_ns`: exactly the wait_start of the step that
# will end the wait, so the agent can book the wait as it accrues and the step's rest when it comes.
OPEN_WAIT = 0
# The trainer's loop ended at `since_ns` (its last step's compute end): none of its waits is open until
# it steps again, so the agent waits for it no longer.
OPEN_ENDED = 1
# A loader worker is building batch `batch` since `since_ns` (it took the batch's indices then).
OPEN_BATCH = 2
# A loader worker's read of `batch` (key `key`) is open since `since_ns`.
OPEN_READ = 3
# A loader worker handed `batch` over at `since_ns`, its latest: the trainer's wait on it after that is delivery.
OPEN_HANDED = 4
# The trainer's loop, an epoch of `key` steps (its loader's len()), began at `since_ns` and has taken `batch` of
# them: how far the job is through its pass over the data, for the agent's warm-up forecast. Sent only with the
# steps a flush sends anyway. An epoch may run for days: its start may be older than other records' may.
OPEN_EPOCH = 5
OPEN_STATES = (OPEN_WAIT, OPEN_ENDED, OPEN_BATCH, OPEN_READ, OPEN_HANDED, OPEN_EPOCH)

HEADER_V2_FIELDS = tuple(field for field in HEADER_FIELDS if field[0] != "n_open")
HEADER = _layout(HEADER_FIELDS)
HEADER_V2 = _layout(HEADER_V2_FIELDS)
STEP = _layout(STEP_FIELDS)
READ = _layout(READ_FIELDS)
OPEN = _layout(OPEN_FIELDS)
STRING_LENGTH = struct.Struct("<H")

# The cache's verdict on a read, as `stallwatch.eventbatch.Verdict` numbers it (that module needs NumPy).
VERDICT_UNKNOWN = -1
VERDICT_HIT = 0
VERDICT_MISS = 1
# The read crossed no spoke (a local disk, a mount no spoke serves): the agent books it direct_read.
VERDICT_DIRECT = 2

MAX_JOB_NAME = 128
# The label value the agent folds jobs and ranks past its limits into; no client may name a job so.
OVERFLOW_NAME = "__other__"
# The source attribute naming its GPU as NVML does: `GPU-<uuid>`, or a MIG device's `MIG-...` id.
# The header's gpu stays the client's guess at the physical index (-1 unknown), for agents before it.
GPU_UUID = "gpu_uuid"
# Events per datagram: at 41 bytes a read, a full batch stays near 42 KB, a fifth of the socket's send
# buffer (net.core.wmem_default, 208 KB here). Each datagram costs a syscall and a wake-up of the agent's
# receiver on another core, tens of microseconds in a VM: 1,024 events a datagram made recording one
# event 10-20 % cheaper than 512 (docs/benchmarks.md), and the agent's 10-datagram queue holds twice the
# events.
MAX_EVENTS = 1024

Step = tuple[int, int, int, int, int]
Read = tuple[int, int, int, int, int, int]
Open = tuple[int, int, int, int, int]


@dataclass(frozen=True)
class Source:
    """Who the events of a batch belong to. `worker` is the loader worker id, -1 for the trainer."""

    job: str
    rank: int
    gpu: int = -1
    worker: int = -1
    gpu_uuid: str = ""


def job_name(name: str) -> str:
    """A job name the agent accepts: printable, non-empty, at most MAX_JOB_NAME characters, not the
    reserved OVERFLOW_NAME."""
    cleaned = "".join(ch if ch.isprintable() else "_" for ch in name)[:MAX_JOB_NAME]
    return cleaned if cleaned and cleaned != OVERFLOW_NAME else "unknown"


def _strings(source: Source) -> list[bytes]:
    strings = [source.job.encode()]
    if source.gpu_uuid:
        strings.append(f"{GPU_UUID}={source.gpu_uuid}".encode())
    return strings


def encode_header(
    source: Source, n_steps: int, n_reads: int, dropped: int, mono_ns: int, wall_ns: int, n_open: int = 0
) -> bytes:
    """A batch's header, packed at send time: the drop count and clocks are those of the moment it leaves."""
    return HEADER.pack(VERSION, len(_strings(source)), 0, source.gpu, source.worker, source.rank, n_steps, n_reads,
                       n_open, dropped, mono_ns, wall_ns)


def encode_body(source: Source, steps: Iterable[Step], reads: bytes | bytearray, opens: Iterable[Open] = ()) -> bytes:
    """What follows the header: the string table and the records, steps and opens in STEP/OPEN field order,
    reads already packed (READ records back to back, as a channel keeps them)."""
    parts: list[bytes | bytearray] = []
    for string in _strings(source):
        parts += (STRING_LENGTH.pack(len(string)), string)
    # starmap keeps the per-record loop in C: ~90 ns a record here, against ~150 ns for pack_into.
    parts.extend(starmap(STEP.pack, steps))
    parts.append(reads)
    parts.extend(starmap(OPEN.pack, opens))
    return b"".join(parts)


def encode(
    source: Source,
    steps: Iterable[Step],
    reads: Iterable[Read],
    n_steps: int,
    n_reads: int,
    dropped: int,
    mono_ns: int,
    wall_ns: int,
    opens: Sequence[Open] = (),
) -> bytes:
    """One datagram. `steps` and `reads` are tuples in STEP/READ field order, counted by the caller; `opens`
    in OPEN field order."""
    return (encode_header(source, n_steps, n_reads, dropped, mono_ns, wall_ns, len(opens))
            + encode_body(source, steps, b"".join(starmap(READ.pack, reads)), opens))
