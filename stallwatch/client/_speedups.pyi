import io
from collections.abc import Callable
from typing import Any

class OpenHook:
    """open(), whose file records its reads when read capture takes it (_speedups.c)."""

    __wrapped__: Callable[..., Any]

    def __init__(self, original: Callable[..., Any], capturing: Callable[..., Any], context: object,
                 skipped_folders: tuple[str, ...], spoke_mounts: tuple[str, ...], spoke_verdict: int,
                 other_verdict: int) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

class FileReads:
    """A captured raw file's reads: the state its CapturedFileIO methods record with (reads.FileReads's)."""

    _path: str
    _position: int
    _verdict: int

class CapturedFileIO(io.FileIO):
    """io.FileIO whose reads read capture records, from open() to close (named as io.FileIO is)."""

def configure(context: object, read_key: Callable[[str, int], int], empty_read_ns: int, process_sender: object,
              channel_type: type, full: int) -> None: ...

def record_reads(file: io.FileIO, path: str, verdict: int, position: int = 0, /) -> None: ...

def open_reads() -> list[tuple[str, int, int]]: ...

def read_key(resource: str, offset: int, /) -> int: ...
