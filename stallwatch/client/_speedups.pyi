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
    """A captured raw file's reads, recorded: reads.FileReads in C."""

    path: str
    position: int
    verdict: int

    def __init__(self, file: io.FileIO, path: str, verdict: int, position: int) -> None: ...
    def readinto(self, buffer: Any, /) -> int | None: ...
    def readall(self) -> bytes: ...
    def read(self, size: int | None = -1, /) -> bytes | None: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...

def configure(file_type: type, context: object, read_key: Callable[[str, int], int], empty_read_ns: int,
              process_sender: object, channel_type: type, full: int) -> None: ...

def read_key(resource: str, offset: int, /) -> int: ...
