"""The recorded event file that `stallwatch correlate FILE` replays: a sequence of EventBatch records.

Format (version 2): the line `stallwatch-events 2 {"wall_offset_ns": N}\n`, N being unix ns minus the
node's monotonic ns when the file was opened (wallclock.py), so a replay prints the windows at their
wall-clock times; then records. A record is one line of JSON,
`{"kind": "read", "rows": 3, "columns": [["job", "<i4"], ["key", "<u8"], ...]}`, followed by the raw
bytes of each column in that order (NumPy dtype strings, so byte order is explicit). Appending a
batch is a write of its header and columns: the agent can tee its stream to a file as it runs.
Version 1 files (the line `stallwatch-events 1\n`, no offset) are still read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from stallwatch.correlator.recordfile import RecordFile
from stallwatch.correlator.wallclock import wall_offset_ns
from stallwatch.eventbatch import EventBatch

MAGIC = b"stallwatch-events"
VERSIONS = (b"1", b"2")


class EventFileError(ValueError):
    """A file that is not a stallwatch event file, or is damaged; the message says where."""


class EventFileWriter:
    """Appends batches to an event file; safe to call from several threads. A batch that cannot be
    written (a full disk) is left out whole and counted in `file.errors`: it never raises."""

    def __init__(self, path: str | Path) -> None:
        offset = json.dumps({"wall_offset_ns": wall_offset_ns()}).encode()
        self.file = RecordFile(path, "events", truncate=True, header=MAGIC + b" 2 " + offset + b"\n")

    def write(self, batch: EventBatch) -> bool:
        columns = {name: np.ascontiguousarray(column) for name, column in batch.columns.items()}
        header = {"kind": batch.kind, "rows": len(batch),
                  "columns": [[name, column.dtype.str] for name, column in columns.items()]}
        return self.file.append(b"".join([json.dumps(header).encode(), b"\n",
                                          *(column.tobytes() for column in columns.values())]))

    def close(self) -> None:
        self.file.close()


def _read_exact(stream: BinaryIO, size: int, where: str) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise EventFileError(f"{where}: truncated (wanted {size} bytes, file ends after {len(data)})")
    return data


def _header(path: str | Path, stream: BinaryIO) -> dict[str, Any]:
    """The file's header line: {} for version 1, else its JSON."""
    magic, _, rest = stream.readline(4096).partition(b" ")
    version, _, fields = rest.partition(b" ")
    if magic != MAGIC or version.strip() not in VERSIONS:
        raise EventFileError(f"{path}: not a stallwatch event file (no {MAGIC.decode()!r} header)")
    try:
        header = json.loads(fields) if fields.strip() else {}
    except ValueError as error:
        raise EventFileError(f"{path}: bad file header: {error}") from error
    return header if isinstance(header, dict) else {}


def recorded_wall_offset(path: str | Path) -> int | None:
    """The monotonic-to-unix offset recorded in the file, None in a version 1 file."""
    with Path(path).open("rb") as stream:
        offset = _header(path, stream).get("wall_offset_ns")
    return int(offset) if offset is not None else None


def read_events(path: str | Path) -> Iterator[EventBatch]:
    with Path(path).open("rb") as stream:
        _header(path, stream)
        record = 0
        while line := stream.readline():
            record += 1
            where = f"{path}: record {record}"
            try:
                header = json.loads(line)
                kind, rows = str(header["kind"]), int(header["rows"])
                layout = [(str(name), np.dtype(dtype)) for name, dtype in header["columns"]]
            except (ValueError, KeyError, TypeError) as error:
                raise EventFileError(f"{where}: bad header: {error}") from error
            columns = {name: np.frombuffer(_read_exact(stream, rows * dtype.itemsize, where), dtype=dtype)
                       for name, dtype in layout}
            yield EventBatch(kind, columns)
