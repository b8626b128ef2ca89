"""Read capture: the files a loader reads through `open()` recorded, with no change to the code that reads.

`start()` puts `capturing_open` in place of `builtins.open` and `io.open` (what `open()`, `Path.open`,
`Path.read_bytes`, NumPy's `np.load`, `torch.load` and PIL's `Image.open` call). A file it captures is the
file `open()` returns, read through `reads.RecordedFile`: one read event a read call, with its key, bytes,
start, end and the batch it serves. It captures a file opened for reading only (no `+`, buffered), by
path, while this process's reads have a source (a loader worker, or a loop without workers during its
epoch, `reads.bound`), and not under the Python installation or kernel pseudo-files (`skipped_prefixes`):
the interpreter's own imports go through `io.open_code` and are never seen. Every other open returns
the original's object untouched.

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

from stallwatch.client import remote, wire
from stallwatch.client.reads import RecordedFile, bound

# "0" turns read capture off, for `instrument` and `stallwatch run` alike.
CAPTURE_ENV = "STALLWATCH_CAPTURE_READS"
SPOKE_MOUNTS_ENV = "STALLWATCH_SPOKE_MOUNTS"
KERNEL_FILES = ("/proc", "/sys", "/dev")

original_open: Callable[..., IO[Any]] = io.open


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(CAPTURE_ENV, "").strip() != "0"


def _folders(paths: Iterable[str]) -> tuple[str, ...]:
    """Each path as a prefix of what lies under it (`/data/` does not take in `/database`), those inside
    another left out: each open that is not skipped tries them all."""
    folders = sorted({os.path.join(os.path.abspath(path), "") for path in paths if path})
    return tuple(folder for folder in folders if not any(folder.startswith(other) for other in folders
                                                          if other != folder))


def skipped_prefixes() -> tuple[str, ...]:
    """Where reads are never captured: the Python installation (prefixes, standard library, site-packages)
    and kernel pseudo-files."""
    installation = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages(),
                    site.getusersitepackages()]
    installation += [sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")]
    return _folders([*installation, *KERNEL_FILES])


def spoke_mounts(env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    return _folders(env.get(SPOKE_MOUNTS_ENV, "").split(os.pathsep))


class _Settings:
    __slots__ = ("mounts", "skipped")

    def __init__(self) -> None:
        self.skipped: tuple[str, ...] = ()
        self.mounts: tuple[str, ...] = ()


_settings = _Settings()


def capturing_open(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None,
                   errors: str | None = None, newline: str | None = None, closefd: bool = True,
                   opener: Callable[[str, int], int] | None = None) -> IO[Any]:
    """`open()`, whose file records its reads when it is one to capture (the module's rules)."""
    opened = original_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    # Cheapest refusals first: most opens a process skips are refused by the first two tests.
    if not bound() or (type(file) is str and file.startswith(_settings.skipped)):
        return opened
    if "r" not in mode or "+" in mode or buffering == 0 or isinstance(file, int):  # no path to key a descriptor by
        return opened
    try:
        path = os.path.abspath(os.fsdecode(file)) if type(file) is not str or not file.startswith(os.sep) else file
        if path.startswith(_settings.skipped):
            return opened
        verdict = wire.VERDICT_UNKNOWN if path.startswith(_settings.mounts) else wire.VERDICT_DIRECT
        if "b" in mode:
            return RecordedFile(opened, path, verdict, 0)  # type: ignore[return-value]  # reads as the file does
        return _recorded_text(opened, path, verdict, mode, newline)  # type: ignore[arg-type]
    except Exception:  # never into the reader: the file is read uncaptured
        return opened


def _recorded_text(opened: io.TextIOWrapper, path: str, verdict: int, mode: str, newline: str | None,
                   ) -> io.TextIOWrapper:
    """The text file `opened` reading through a recorded buffer, decoding as it would have."""
    text = io.TextIOWrapper(RecordedFile(opened.buffer, path, verdict, 0),  # type: ignore[arg-type]
                            encoding=opened.encoding, errors=opened.errors, line_buffering=opened.line_buffering,
                            newline=newline)
    opened.detach()  # the buffer is the new wrapper's alone: the old one would close it when collected
    text.mode = mode  # type: ignore[misc]  # as open() sets it
    return text


def installed() -> bool:
    return builtins.open is capturing_open


def start(env: Mapping[str, str] = os.environ) -> bool:
    """Capture reads in this process from now on, unless `CAPTURE_ENV` says not to; whether it captures.
    Remote reads (HTTP, object stores) too: `remote`."""
    if not enabled(env):
        return False
    _settings.skipped, _settings.mounts = skipped_prefixes(), spoke_mounts(env)
    builtins.open = io.open = capturing_open  # type: ignore[assignment]
    remote.start(env)
    return True


def stop() -> None:
    """Open files as before `start()`, files already captured recording on; remote reads as `remote.stop()`."""
    builtins.open = io.open = original_open  # type: ignore[assignment]
    remote.stop()
