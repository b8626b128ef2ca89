"""Writes each published window as one JSON line, for reports (`--correlator.record-windows PATH`).

A line is what the metrics published at that moment (hold.py): one window's rows of the jobs released
together, its bounds in unix seconds. Usually every job of a window goes out at once, one line per
window; a job held for a stall gets a line of its own later, so a reader merges the lines of a window
(the same `start_s`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from stallwatch.correlator.hold import Publication
from stallwatch.correlator.recordfile import RecordFile
from stallwatch.correlator.results import NameLookup


class WindowFileWriter:
    """To a path: appended whole lines, a line that cannot be written (a full disk) left out and counted
    in `file.errors`, never raised. To a stream (standard output): written as is."""

    def __init__(self, target: str | Path | TextIO, job_names: NameLookup = str) -> None:
        self.file = RecordFile(target, "windows") if isinstance(target, (str, Path)) else None
        self._stream = target if not isinstance(target, (str, Path)) else None
        self._job_names = job_names

    def write(self, publication: Publication) -> None:
        line = json.dumps(publication.result.record(self._job_names, publication.wall_offset_ns)) + "\n"
        if self.file is not None:
            self.file.append(line.encode())
        elif self._stream is not None:
            self._stream.write(line)
            self._stream.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
