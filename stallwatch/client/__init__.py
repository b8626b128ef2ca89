"""The stallwatch training client: standard library only, safe to import without torch or NumPy.

    from stallwatch.client import monitor
    for batch in monitor(loader):       # loader wait and compute, per step
        ...

Inside datasets, `open_recorded`, `http_get` and `ReadSpan` record each read. With PyTorch,
`stallwatch.client.torch.instrument(loader)` does both and tags every read with the batch it serves.
Events go to the node agent over `$STALLWATCH_SOCKET`; the client never blocks and never raises.
"""

from stallwatch.client.loop import Monitored, monitor
from stallwatch.client.reads import ReadSpan, RecordedFile, http_get, open_recorded, record_read, set_batch
from stallwatch.client.transport import configure

if __name__ != "stallwatch.client":  # one file, one module name
    raise ImportError(f"import stallwatch.client, not {__name__}: one file, one module name")

__all__ = [
    "Monitored",
    "ReadSpan",
    "RecordedFile",
    "configure",
    "http_get",
    "monitor",
    "open_recorded",
    "record_read",
    "set_batch",
]
