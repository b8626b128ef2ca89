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
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from stallwatch.correlator.recordfile import RecordFile
from stallwatch.correlator.wallclock import wall_offset_ns
from stallwatch.eventbatch import EventBatch

MAGIC = b"stallwatch-events"
VERSIONS = (b"1", b"2")
MAX_RECORD_HEADER = 1 << 16  # bytes of a record's JSON line; the agent writes a few hundred
MAX_RECORD_ROWS = 1 << 24  # rows of one record; a batch the agent receives holds far fewer


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
    if offset is None:
        return None
    if not isinstance(offset, int) or isinstance(offset, bool) or abs(offset) >= 2**63:
        raise EventFileError(f"{path}: bad file header: wall_offset_ns is not a 64-bit integer")
    return offset


def read_events(path: str | Path) -> Iterator[EventBatch]:
    """The file's batches, one record at a time: memory stays at one record's size, whatever the file's."""
    with Path(path).open("rb") as stream:
        _header(path, stream)
        record = 0
        while line := stream.readline(MAX_RECORD_HEADER):
            record += 1
            where = f"{path}: record {record}"
            if not line.endswith(b"\n"):
                raise EventFileError(f"{where}: bad header: no end of line within {MAX_RECORD_HEADER} bytes")
            kind, rows, layout = _record_header(line, where)
            left = os.fstat(stream.fileno()).st_size - stream.tell()
            if rows * sum(dtype.itemsize for _, dtype in layout) > left:
                raise EventFileError(f"{where}: truncated ({rows} rows do not fit in the {left} bytes left)")
            columns = {name: np.frombuffer(_read_exact(stream, rows * dtype.itemsize, where), dtype=dtype)
                       for name, dtype in layout}
            yield EventBatch(kind, columns)


def _record_header(line: bytes, where: str) -> tuple[str, int, list[tuple[str, np.dtype[Any]]]]:
    """A record's kind, rows and columns, checked: rows within bounds, columns of plain numbers."""
    try:
        header = json.loads(line)
        kind, rows = str(header["kind"]), header["rows"]
        layout = [(str(name), np.dtype(dtype)) for name, dtype in header["columns"]]
    except (ValueError, KeyError, TypeError) as error:
        raise EventFileError(f"{where}: bad header: {error}") from error
    if not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= MAX_RECORD_ROWS:
        raise EventFileError(f"{where}: bad header: rows must be a whole number from 0 to {MAX_RECORD_ROWS}")
    for name, dtype in layout:
        if dtype.kind not in "biuf" or dtype.itemsize > 8:
            raise EventFileError(f"{where}: bad header: column {name!r} is {dtype}, not a number of 8 bytes or less")
    return kind, rows, layout
