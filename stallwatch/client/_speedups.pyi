from collections.abc import Callable
from typing import Any

class OpenHook:
    """open(), whose file records its reads when read capture takes it (_speedups.c)."""

    __wrapped__: Callable[..., Any]

    def __init__(self, original: Callable[..., Any], capturing: Callable[..., Any], context: object,
                 skipped_folders: tuple[str, ...]) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

def recorded_readinto(file_type: type, context: object, read_key: Callable[[str, int], int],
                      empty_read_ns: int) -> Callable[[Any, Any], int]: ...

def read_key(resource: str, offset: int, /) -> int: ...
