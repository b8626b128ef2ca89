"""Read capture: the files a loader reads through `open()` recorded, with no change to the code that reads.

`start()` puts `capturing_open` in place of `builtins.open` and `io.open` (what `open()`, `Path.open`,
`Path.read_bytes`, NumPy's `np.load`, `torch.load` and PIL's `Image.open` call). A file it captures is
what `open()` returned, the same objects, its `io.FileIO` beneath recording its reads
(`reads.record_reads`): one read event a read the file system answers (a buffer's refill, a read larger
than the buffer, a read to the end), with its key, bytes, start, end and the batch it serves. The reads
the buffer serves from memory (a decoder's many small reads of a header: 38 for a JPEG through PIL) cost
what they did and are in the event of the refill that brought them. It captures a file opened for
reading only (no `+`, buffered), by path, while this process's reads have a source (a loader worker, or
a loop without workers during its epoch, `reads.bound`), and not under the Python installation or kernel
pseudo-files (`skipped_prefixes`): the interpreter's own imports go through `io.open_code` and are never
seen. Every other open is the original's.

Most opens are refused, and a hook written in Python costs about 100 ns an open however little it does,
so the client ships `_speedups`, a C hook that settles the cheap refusals (no source; a skipped path)
and hands `capturing_open` the rest. It is built where a C compiler and Python's headers are (the
client's wheel, `make`); without it `capturing_open` is installed alone, with the same rules.

A file under a spoke's mount (`SPOKE_MOUNTS_ENV`: mount points, `os.pathsep`-separated) is a spoke read
with its verdict left to the agent; any other crossed no spoke (`wire.VERDICT_DIRECT`, booked
`direct_read`). Paths are compared as given, made absolute, without resolving symbolic links.
"""

from __future__ import annotations

import builtins
import io
import os
import site
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

from stallwatch.client import reads, remote, wire
from stallwatch.client.reads import _speedups
from stallwatch.client.reads import context as _reading

# "0" turns read capture off, for `instrument` and `stallwatch run` alike.
CAPTURE_ENV = "STALLWATCH_CAPTURE_READS"
SPOKE_MOUNTS_ENV = "STALLWATCH_SPOKE_MOUNTS"
KERNEL_FILES = ("/proc", "/sys", "/dev")

original_open: Callable[..., IO[Any]] = io.open


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(CAPTURE_ENV, "").strip() != "0"


def _folders(paths: Iterable[str]) -> tuple[str, ...]:
    """Each path as a prefix of what lies under it (`/data/` does not take in `/database`), in the order
    given, those inside another left out: `str.startswith` tries them in turn, so the likeliest first."""
    folders = list(dict.fromkeys(os.path.join(os.path.abspath(path), "") for path in paths if path))
    return tuple(folder for folder in folders if not any(folder.startswith(other) for other in folders
                                                          if other != folder))


def skipped_prefixes() -> tuple[str, ...]:
    """Where reads are never captured: the Python installation (prefixes, standard library, site-packages)
    and kernel pseudo-files, the environment's prefix first (where installed packages' data files lie)."""
    installation = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages(),
                    site.getusersitepackages()]
    installation += [sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")]
    return _folders([*installation, *KERNEL_FILES])


def spoke_mounts(env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    return _folders(env.get(SPOKE_MOUNTS_ENV, "").split(os.pathsep))


class _Settings:
    __slots__ = ("hook", "mounts", "skipped")

    def __init__(self) -> None:
        self.skipped: tuple[str, ...] = ()
        self.mounts: tuple[str, ...] = ()
        self.hook: Callable[..., IO[Any]] | None = None  # what `start()` installed


_settings = _Settings()
# Absolute paths found under a skipped folder: an installation's files are few, and a process that opens
# one often opens it again.
SKIPPED_PATHS_KEPT = 4096
_skipped_paths: set[str] = set()


def capturing_open(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None,
                   errors: str | None = None, newline: str | None = None, closefd: bool = True,
                   opener: Callable[[str, int], int] | None = None) -> IO[Any]:
    """`open()`, whose file records its reads when it is one to capture (the module's rules)."""
    captured = None
    try:
        # Cheapest refusals first, inline (a call costs more than a test): a process whose reads have no
        # source, and a path skipped before (a set's lookup costs a fraction of testing the folders).
        if _reading.source is not None and file not in _skipped_paths:
            captured = _to_capture(file, mode, buffering, encoding is None and errors is None and newline is None)
    except Exception:  # never into the reader (an unhashable path-like, say): the file is opened uncaptured
        captured = None
    opened = original_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    if captured is not None:
        try:
            raw = opened.raw if "b" in mode else opened.buffer.raw  # type: ignore[attr-defined]
            reads.record_reads(raw, captured[0], captured[1], 0 if opener is None else raw.tell())
        except Exception:  # never into the reader: the file reads on, uncaptured
            pass
    return opened


_READ_MODES = frozenset({"r", "rb", "rt", "br", "tr"})


def _to_capture(file: Any, mode: str, buffering: int, no_text_arguments: bool) -> tuple[str, int] | None:
    """The path and verdict of a file `capturing_open` records, None for one it leaves to the original."""
    if type(file) is str and file.startswith(_settings.skipped):  # absolute: every skipped folder is
        if len(_skipped_paths) < SKIPPED_PATHS_KEPT:
            _skipped_paths.add(file)
        return None
    # Read only, buffered (1 is a text file's line buffering), a path to key its reads by, and arguments
    # `open()` takes (it raises for the rest, and is left to).
    if mode not in _READ_MODES or buffering == 0 or isinstance(file, int) or (
            "b" in mode and (buffering == 1 or not no_text_arguments)):
        return None
    path = os.path.abspath(os.fsdecode(file)) if type(file) is not str or not file.startswith(os.sep) else file
    if path.startswith(_settings.skipped):
        return None
    return path, wire.VERDICT_UNKNOWN if path.startswith(_settings.mounts) else wire.VERDICT_DIRECT



def _hook() -> Callable[..., IO[Any]]:
    """What `start()` installs: `capturing_open` behind the C hook that settles its refusals where the
    client was built with it, else `capturing_open` alone."""
    if _speedups is None:
        return capturing_open
    hook: Callable[..., IO[Any]] = _speedups.OpenHook(original_open, capturing_open, _reading, _settings.skipped,
                                                      _settings.mounts, wire.VERDICT_UNKNOWN, wire.VERDICT_DIRECT)
    return hook


def accelerated() -> bool:
    """Whether `start()` installs the C hook."""
    return _speedups is not None


def current_open() -> Callable[..., IO[Any]]:
    """`open()` as this process has it: what the C hook unpickles as, in whichever process."""
    return builtins.open


def installed() -> bool:
    return _settings.hook is not None and builtins.open is _settings.hook


def start(env: Mapping[str, str] = os.environ) -> bool:
    """Capture reads in this process from now on, unless `CAPTURE_ENV` says not to; whether it captures.
    Remote reads (HTTP, object stores) too: `remote`."""
    if not enabled(env):
        return False
    _settings.skipped, _settings.mounts = skipped_prefixes(), spoke_mounts(env)
    _skipped_paths.clear()
    _settings.hook = _hook()
    builtins.open = io.open = _settings.hook  # type: ignore[assignment]
    remote.start(env)
    return True


def stop() -> None:
    """Open files as before `start()`, files already captured recording on; remote reads as `remote.stop()`."""
    builtins.open = io.open = original_open  # type: ignore[assignment]
    remote.stop()
