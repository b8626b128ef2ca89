"""Writes each closed window as one JSON line, for reports (`--correlator.record-windows PATH`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from stallwatch.correlator.results import NameLookup, WindowResult


class WindowFileWriter:
    def __init__(self, target: str | Path | TextIO, job_names: NameLookup = str) -> None:
        if isinstance(target, (str, Path)):
            self._stream: TextIO = Path(target).open("a", encoding="utf-8")  # noqa: SIM115 (closed by close())
            self._owned = True
        else:
            self._stream, self._owned = target, False
        self._job_names = job_names

    def write(self, result: WindowResult) -> None:
        self._stream.write(json.dumps(result.record(self._job_names)) + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._owned:
            self._stream.close()
