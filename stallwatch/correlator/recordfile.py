"""An append-only file of whole records that never fails its caller: what the correlator's recorders write to.

A record goes in whole or not at all: after a failed write (a full disk, an I/O error) the file is
cut back to the end of its last whole record, so a reader never meets half a record, and recording
picks up again once the disk has room. A failure is never raised: it is counted by cause (the
errno's name) in `errors`, for `stallwatch_correlator_record_errors_total`, and logged once per
cause. Attribution never waits on a recorder.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections import Counter
from pathlib import Path

log = logging.getLogger(__name__)


def cause(error: OSError) -> str:
    """A failure's cause as a label value: the errno's name (`ENOSPC`), else the exception's type."""
    return errno.errorcode.get(error.errno or 0, type(error).__name__)


class RecordFile:
    """`path` opened for appending whole records; with `truncate`, emptied first. `header` starts the
    file: it is written with the first record that fits, so a file that has records has it."""

    def __init__(self, path: str | Path, what: str, *, truncate: bool = False, header: bytes = b"") -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(path, flags, 0o644)
        self._path, self._what, self._header = str(path), what, header
        self._end = os.fstat(self._fd).st_size  # where the last whole record ends
        self._lock = threading.Lock()
        self.errors: Counter[str] = Counter()
        self.records = 0

    def append(self, record: bytes) -> bool:
        """Write one record; False (counted, logged once per cause) if it could not be written whole."""
        with self._lock:
            data = memoryview(self._header + record if self._end == 0 else record)
            written = 0
            try:
                while written < len(data):
                    written += os.write(self._fd, data[written:])
            except OSError as error:
                self._failed(error, written)
                return False
            self._end += written
            self.records += 1
            return True

    def _failed(self, error: OSError, written: int) -> None:
        if written:
            with contextlib.suppress(OSError):  # not a regular file (/dev/full): nothing to cut back
                os.ftruncate(self._fd, self._end)
        reason = cause(error)
        self.errors[reason] += 1
        if self.errors[reason] == 1:
            log.error("correlator: cannot record %s to %s: %s; attribution goes on, and records that could "
                      "not be written are counted in stallwatch_correlator_record_errors_total{reason=\"%s\"}",
                      self._what, self._path, error.strerror or error, reason)

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)
