"""Follow a log file by path across rotation, returning each complete line exactly once.

The file is tracked by (device, inode) and byte offset, the way tail -F and log shippers do:
- rename rotation (`mv access.log access.log.1`, then `nginx -s reopen`): the old file stays open and
  is read to its end; it is kept for `rotate_wait` seconds more, because a writer may still append to
  it until it reopens, and only then closed. The new file is read from its start.
- copytruncate (the file is copied to `PATH.1`, then truncated in place): a truncation is seen when the
  file is shorter than the offset or the bytes just before the offset changed. Lines appended between
  the last read and the copy are recovered from `PATH.1` when its bytes up to the offset match what
  was read; otherwise the gap is reported, since nothing can recover it.
- a partial last line is held back until its newline arrives; a file that does not exist yet is
  waited for and, once it appears, read from its start.
Problems are reported through `on_problem(reason)` so the caller can count them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Enough bytes before the offset to recognise the same file after a truncation or in its copy.
_FINGERPRINT_BYTES = 256


@dataclass
class _Followed:
    file: int  # an os-level descriptor
    device: int
    inode: int
    offset: int = 0
    partial: bytearray = field(default_factory=bytearray)
    fingerprint: bytes = b""  # the bytes just before `offset`

    def remember(self, data: bytes) -> None:
        self.offset += len(data)
        self.fingerprint = (self.fingerprint + data)[-_FINGERPRINT_BYTES:]


class LogTailer:
    def __init__(
        self,
        path: str,
        *,
        from_start: bool = False,
        rotate_wait: float = 5.0,
        max_read_bytes: int = 8 << 20,
        on_problem: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._skip_existing = not from_start
        self._rotate_wait = rotate_wait
        self._max_read = max_read_bytes
        self._on_problem = on_problem
        self._clock = clock
        self._draining: list[tuple[_Followed, float]] = []
        # Opened now, so "the lines already there" means those written before the agent started.
        self._current: _Followed | None = self._open_path()

    def read_lines(self) -> list[bytes]:
        """Every complete line appended since the last call, oldest first, without the newline."""
        lines: list[bytes] = []
        self._drain_rotated(lines)
        if self._current is None:
            self._current = self._open_path()
        current = self._current
        if current is None:
            return lines
        self._check_truncation(current, lines)
        self._read_available(current, lines)
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return lines  # renamed away, its successor not created yet: keep reading the old one
        if (on_disk.st_dev, on_disk.st_ino) != (current.device, current.inode):
            self._draining.append((current, self._clock() + self._rotate_wait))
            self._current = self._open_path()
            if self._current is not None:
                self._read_available(self._current, lines)
        return lines

    def close(self) -> None:
        for followed, _ in self._draining:
            os.close(followed.file)
        self._draining.clear()
        if self._current is not None:
            os.close(self._current.file)
            self._current = None

    def _open_path(self) -> _Followed | None:
        try:
            descriptor = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self._skip_existing = False  # a file that appears later is new: read all of it
            return None
        info = os.fstat(descriptor)
        followed = _Followed(descriptor, info.st_dev, info.st_ino)
        if self._skip_existing:
            # Lines written before the agent started were counted by no one, but counting them now
            # would double-count across agent restarts; start at the end, at a line boundary.
            followed.offset = info.st_size
            followed.fingerprint = os.pread(descriptor, _FINGERPRINT_BYTES, max(0, info.st_size - _FINGERPRINT_BYTES))
            self._skip_existing = False
        return followed

    def _read_available(self, followed: _Followed, lines: list[bytes], budget: int | None = None) -> None:
        """Read to the end of the file, or `budget` bytes (default: the per-poll bound), whichever first."""
        left = self._max_read if budget is None else budget
        while left > 0:
            data = os.pread(followed.file, min(left, 1 << 20), followed.offset)
            if not data:
                return
            left -= len(data)
            followed.remember(data)
            self._split(followed, data, lines)

    @staticmethod
    def _split(followed: _Followed, data: bytes, lines: list[bytes]) -> None:
        pieces = data.split(b"\n")
        if len(pieces) > 1:
            pieces[0] = bytes(followed.partial) + pieces[0]
            followed.partial.clear()
            lines.extend(pieces[:-1])
        followed.partial += pieces[-1]

    def _check_truncation(self, followed: _Followed, lines: list[bytes]) -> None:
        size = os.fstat(followed.file).st_size
        before = followed.fingerprint
        if size >= followed.offset and os.pread(followed.file, len(before), followed.offset - len(before)) == before:
            return
        self._recover_from_copy(followed, lines)
        if followed.partial:
            self._on_problem("partial_line")
            followed.partial.clear()
        followed.offset, followed.fingerprint = 0, b""

    def _recover_from_copy(self, followed: _Followed, lines: list[bytes]) -> None:
        copy_path = self.path + ".1"
        try:
            descriptor = os.open(copy_path, os.O_RDONLY)
        except FileNotFoundError:
            self._on_problem("rotation_gap")
            return
        try:
            before = followed.fingerprint
            if os.pread(descriptor, len(before), followed.offset - len(before)) != before:
                self._on_problem("rotation_gap")
                return
            copy = _Followed(descriptor, 0, 0, followed.offset, followed.partial, before)
            self._read_available(copy, lines)
            followed.partial = copy.partial
        finally:
            os.close(descriptor)

    def _drain_rotated(self, lines: list[bytes]) -> None:
        still: list[tuple[_Followed, float]] = []
        now = self._clock()
        for followed, deadline in self._draining:
            if now < deadline:
                self._read_available(followed, lines)
                still.append((followed, deadline))
                continue
            self._read_available(followed, lines, budget=1 << 62)  # the last look: all of it
            if followed.partial:
                self._on_problem("partial_line")
            os.close(followed.file)
        self._draining = still
