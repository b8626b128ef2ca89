"""Follow a log file by path across rotation, returning each complete line exactly once.

The file is tracked by (device, inode) and byte offset, the way tail -F and log shippers do:
- rename rotation (`mv access.log access.log.1`, then `nginx -s reopen`): the old file stays open and
  is read to its end; it is kept for `rotate_wait` seconds more, because a writer may still append to
  it until it reopens. It is closed only once that time has passed, it has stopped growing, and its
  successor has been written to (or it was deleted): a writer that never reopens keeps being followed.
- several rename rotations between two polls: the files rotated in between are found among the
  numbered copies `PATH.1` … `PATH.9` (logrotate's default naming, newer first) and read from their
  start, oldest first.
- copytruncate (the file is copied to `PATH.1`, then truncated in place): a truncation is seen when the
  file is shorter than the offset or the bytes just before the offset changed. Lines appended between
  the last read and the copy are recovered from the numbered copy whose bytes up to the offset match
  what was read, then every newer copy is read whole; without such a copy the gap is reported, since
  nothing can recover it.
- a partial last line is held back until its newline arrives, up to `max_line_bytes`: a longer line is
  skipped to its newline and reported, so memory stays bounded whatever is written. A file that does
  not exist yet is waited for and, once it appears, read from its start.
Problems are reported through `on_problem(reason)` so the caller can count them: `partial_line` (cut
off for ever), `oversize_line`, `rotation_gap`.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Enough bytes before the offset to recognise the same file after a truncation or in its copy.
_FINGERPRINT_BYTES = 256
# Numbered copies looked at after a rotation: PATH.1 to PATH.9.
_NUMBERED_COPIES = 9
# An nginx log line is a few hundred bytes plus the URI, itself bounded by nginx's header buffers (8 KiB).
DEFAULT_MAX_LINE_BYTES = 64 << 10


def _open_log(path: str) -> int:
    """A descriptor of the regular file at `path`. Opened without blocking: a FIFO put at the path (or a
    socket, a device) would hold its open until a writer comes, and the agent with it; it is no log."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    kind = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(kind):
        os.close(descriptor)
        what = "a FIFO" if stat.S_ISFIFO(kind) else "a directory" if stat.S_ISDIR(kind) else "no regular file"
        raise OSError(f"{path} is {what}, not a log file")
    return descriptor


@dataclass
class _Followed:
    file: int  # an os-level descriptor
    device: int
    inode: int
    offset: int = 0
    partial: bytearray = field(default_factory=bytearray)
    fingerprint: bytes = b""  # the bytes just before `offset`
    oversize: bool = False  # within a line already over the limit: skipped up to its newline

    @property
    def identity(self) -> tuple[int, int]:
        return self.device, self.inode

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
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        on_problem: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._skip_existing = not from_start
        self._rotate_wait = rotate_wait
        self._max_read = max_read_bytes
        self._max_line = max_line_bytes
        self._on_problem = on_problem
        self._clock = clock
        self._draining: list[tuple[_Followed, float]] = []
        # Opened now, so "the lines already there" means those written before the agent started.
        self._current: _Followed | None = None
        try:
            self._current = self._open_path()
        except OSError:  # not a log yet (a FIFO, no permission): each read tries again and says why
            self._skip_existing = False

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
        if (on_disk.st_dev, on_disk.st_ino) != current.identity:
            self._draining.append((current, self._clock() + self._rotate_wait))
            self._read_rotated_between(current, lines)
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
            descriptor = _open_log(self.path)
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

    def _split(self, followed: _Followed, data: bytes, lines: list[bytes]) -> None:
        first, *complete = data.split(b"\n")
        if not complete:  # no newline: the held line only grows
            self._hold(followed, first)
            return
        rest = complete.pop()
        if followed.oversize or len(followed.partial) + len(first) > self._max_line:
            self._on_problem("oversize_line")
        else:
            lines.append(bytes(followed.partial) + first)
        followed.partial.clear()
        followed.oversize = False
        for line in complete:
            if len(line) > self._max_line:
                self._on_problem("oversize_line")
            else:
                lines.append(line)
        self._hold(followed, rest)

    def _hold(self, followed: _Followed, piece: bytes) -> None:
        """Keep the start of a line until its newline arrives, unless it is already over the limit."""
        if followed.oversize or len(followed.partial) + len(piece) > self._max_line:
            followed.oversize = True
            followed.partial.clear()
        else:
            followed.partial += piece

    def _abandon_partial(self, followed: _Followed) -> None:
        """The line being assembled will never end (the file was cut or is closed): count it."""
        if followed.oversize:
            self._on_problem("oversize_line")
        elif followed.partial:
            self._on_problem("partial_line")
        followed.partial.clear()
        followed.oversize = False

    def _numbered_copies(self) -> list[str]:
        """The paths of the numbered copies that exist, newest (PATH.1) first."""
        found = []
        for number in range(1, _NUMBERED_COPIES + 1):
            path = f"{self.path}.{number}"
            if not os.path.lexists(path):
                break
            found.append(path)
        return found

    def _read_rotated_between(self, rotated: _Followed, lines: list[bytes]) -> None:
        """After `rotated` left the path: read the files that held the path after it and have already
        been rotated too (newer numbered copies than `rotated`'s, unknown to this tailer), oldest first."""
        known = {followed.identity for followed, _ in self._draining}
        newer: list[_Followed] = []
        found = False
        for path in self._numbered_copies():
            try:
                descriptor = _open_log(path)
            except FileNotFoundError:
                break
            info = os.fstat(descriptor)
            if (info.st_dev, info.st_ino) in known:
                os.close(descriptor)
                found = (info.st_dev, info.st_ino) == rotated.identity
                if found:
                    break
                continue
            newer.append(_Followed(descriptor, info.st_dev, info.st_ino))
        if not found:  # `rotated` is not among the numbered copies: another naming scheme, nothing to tell
            for followed in newer:
                os.close(followed.file)
            return
        deadline = self._clock() + self._rotate_wait
        for followed in reversed(newer):
            self._read_available(followed, lines)
            self._draining.append((followed, deadline))

    def _check_truncation(self, followed: _Followed, lines: list[bytes]) -> None:
        size = os.fstat(followed.file).st_size
        before = followed.fingerprint
        if size >= followed.offset and os.pread(followed.file, len(before), followed.offset - len(before)) == before:
            return
        self._recover_from_copies(followed, lines)
        self._abandon_partial(followed)
        followed.offset, followed.fingerprint = 0, b""

    def _recover_from_copies(self, followed: _Followed, lines: list[bytes]) -> None:
        """The rest of `followed` from its copy, then every newer copy whole (one per truncation since)."""
        copies = self._numbered_copies()
        before = followed.fingerprint
        for index, path in enumerate(copies):
            try:
                descriptor = _open_log(path)
            except FileNotFoundError:
                break
            try:
                if os.pread(descriptor, len(before), followed.offset - len(before)) != before:
                    continue
                copy = _Followed(descriptor, 0, 0, followed.offset, followed.partial, before, followed.oversize)
                self._read_available(copy, lines, budget=1 << 62)
            finally:
                os.close(descriptor)
            for newer in reversed(copies[:index]):
                copy = _Followed(_open_log(newer), 0, 0, 0, copy.partial, b"", copy.oversize)
                try:
                    self._read_available(copy, lines, budget=1 << 62)
                finally:
                    os.close(copy.file)
            followed.partial, followed.oversize = copy.partial, copy.oversize
            return
        self._on_problem("rotation_gap")

    def _drain_rotated(self, lines: list[bytes]) -> None:
        still: list[tuple[_Followed, float]] = []
        now = self._clock()
        successor_used = self._current is not None and (self._current.offset > 0 or bool(self._current.partial))
        for followed, deadline in self._draining:
            if now < deadline:
                self._read_available(followed, lines)
                still.append((followed, deadline))
                continue
            offset = followed.offset
            self._read_available(followed, lines, budget=1 << 62)  # a last look: all of it
            deleted = os.fstat(followed.file).st_nlink == 0
            if followed.offset > offset or not (successor_used or deleted):
                # Still written to, or its writer has not reopened the log yet: keep following it.
                still.append((followed, now + self._rotate_wait))
                continue
            self._abandon_partial(followed)
            os.close(followed.file)
        self._draining = still
