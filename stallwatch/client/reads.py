"""Recording dataset reads: a file wrapper, a raw file (read capture's), an HTTP GET, and a span for any
other reader.

Each read becomes one event: its key (`stallwatch.client.keys.read_key` of the path or URL and the byte
offset, so the agent can join it to the spoke's log without a path ever leaving the node), bytes,
start and end (`time.monotonic_ns()`), and the cache's verdict when the reader sees one. The
process's read context adds the loader worker and the batch being built; the PyTorch integration
sets both inside each worker (`bind_worker`, `set_batch`), other code may call them itself.
Recording never raises into the reader: a failure to record only loses the event.

What is in flight, as the flush thread reports it (`transport`): the batch the process is building
(from `set_batch` until `handed_over`), the read it has open (the latest started), and the batch it
last handed over. A read stores its location, offset and start as it starts and clears them as it
ends, two attribute stores; its key is computed only when a flush reports it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import time
import urllib.request
import weakref
from collections.abc import Callable, Iterator, Sized
from threading import get_ident
from time import monotonic_ns
from types import ModuleType, TracebackType
from typing import IO, Any, ParamSpec, SupportsIndex, TypeVar

from stallwatch.client import transport, wire
from stallwatch.client.identity import source_from_environment
from stallwatch.client.keys import read_key
from stallwatch.client.transport import Channel, sender

_speedups: ModuleType | None
try:
    from stallwatch.client import _speedups
except ImportError:  # built without a C compiler: the raw file's reads in Python
    _speedups = None

# The read a captured file has open outside `context.reading` (its C recording keeps it apart while no
# other read is open: nothing allocated a read).
_c_open_reads: Callable[[], list[tuple[str, int, int]]] = list if _speedups is None else _speedups.open_reads

P = ParamSpec("P")
R = TypeVar("R", bound=Sized)
T = TypeVar("T")

# nginx $upstream_cache_status values: these were served from the spoke's cache (REVALIDATED asked the
# hub only whether the cached copy was still good); MISS, EXPIRED and BYPASS fetched from the hub.
_CACHE_HITS = frozenset({"HIT", "STALE", "UPDATING", "REVALIDATED"})
_CACHE_MISSES = frozenset({"MISS", "EXPIRED", "BYPASS"})


def verdict_from_cache_status(value: str | None) -> int:
    """An `X-Cache-Status` header value -> wire.VERDICT_HIT, _MISS or _UNKNOWN."""
    status = (value or "").strip().upper()
    if status in _CACHE_HITS:
        return wire.VERDICT_HIT
    if status in _CACHE_MISSES:
        return wire.VERDICT_MISS
    return wire.VERDICT_UNKNOWN


# Reply headers that carry a cache's verdict: nginx's as the project's spokes send it, Varnish's and CDNs'.
CACHE_STATUS_HEADERS = ("X-Cache-Status", "X-Cache", "CF-Cache-Status")


def verdict_from_headers(headers: Any) -> int | None:
    """The verdict of the first cache header in a reply's `headers` (a case-insensitive `get`) that names one,
    read from its first word (`Hit from cloudfront`, `HIT, MISS`); None when none does."""
    for name in CACHE_STATUS_HEADERS:
        words = str(headers.get(name) or "").replace(",", " ").split()
        verdict = verdict_from_cache_status(words[0]) if words else wire.VERDICT_UNKNOWN
        if verdict != wire.VERDICT_UNKNOWN:
            return verdict
    return None


class _ReadContext:
    """Where this process's reads go, which batch they serve, and what it has in flight."""

    __slots__ = ("batch", "building", "channel", "handed", "reading", "source")
    source: wire.Source | None
    channel: Channel | None
    batch: int
    building: tuple[int, int] | None  # (batch, since)
    reading: dict[int, tuple[str, int, int]]  # each thread's open read (location, offset, start), by `get_ident`
    handed: tuple[int, int] | None  # (batch, when)

    def __init__(self) -> None:
        self.source = None
        self._forget()

    def bind(self, channel: Channel) -> Channel:
        self.channel = channel
        channel.reader = self
        return channel

    def target(self) -> Channel:
        channel, current = self.channel, sender()
        if channel is None or channel.owner is not current:  # first read, or `configure()` chose another agent
            channel = self.bind(current.channel(self.source or source_from_environment()))
        return channel

    def open_records(self, channel: Channel, as_of_ns: int) -> list[wire.Open]:
        """The batch being built, the open read and the batch last handed over, while reading as `channel`."""
        if channel is not self.channel:
            return []
        building, handed, batch = self.building, self.handed, self.batch
        records: list[wire.Open] = []
        if building is not None:
            records.append((wire.OPEN_BATCH, building[0], 0, building[1], as_of_ns))
        # The oldest open read, whichever thread reads it (a dataset may read on several): the stall's longest.
        reading = min([*self.reading.copy().values(), *_c_open_reads()], key=lambda read: read[2], default=None)
        if reading is not None:
            location, offset, start = reading
            records.append((wire.OPEN_READ, batch, read_key(location, offset), start, as_of_ns))
        if handed is not None:
            records.append((wire.OPEN_HANDED, handed[0], 0, handed[1], as_of_ns))
        return records

    def _forget(self) -> None:  # also in a forked child: the parent's channel and work are not ours
        self.channel, self.batch = None, -1
        self.building = self.handed = None
        self.reading = {}


context = _ReadContext()
os.register_at_fork(after_in_child=context._forget)


def bind_worker(source: wire.Source) -> None:
    """Send this process's reads as `source` (job, rank, gpu and loader worker id)."""
    context.source = source
    context.bind(sender().channel(source))


def bound() -> bool:
    """Whether this process's reads already have a source (a loader worker's, or one the caller chose)."""
    return context.source is not None


@contextlib.contextmanager
def reads_as(source: wire.Source) -> Iterator[None]:
    """Send this process's reads as `source` inside the block, from no batch built or handed over yet (another
    source's are not its); the previous source and its work after it."""
    saved = context.source, context.channel, context.batch, context.building, context.handed
    bind_worker(source)
    context.batch, context.building, context.handed = -1, None, None
    try:
        yield
    finally:
        context.source, context.channel, context.batch, context.building, context.handed = saved


def set_batch(batch: int) -> None:
    """The batch index the following reads serve, being built from now on (-1: unknown, none being built)."""
    context.batch = batch
    context.building = None if batch == -1 else (batch, time.monotonic_ns())


def handed_over(batch: int, at_ns: int) -> None:
    """The batch was finished and handed over at `at_ns` (`time.monotonic_ns()`); none is being built."""
    context.handed = (batch, at_ns)
    context.building = None


def current_batch() -> int:
    return context.batch


def record_read(
    location: str, offset: int, nbytes: int, start_ns: int, end_ns: int, verdict: int = wire.VERDICT_UNKNOWN
) -> None:
    """Record one read that already happened."""
    try:
        target = context.target()
        try:
            key = read_key(location, offset)
        except Exception:  # no key (a name with no UTF-8): lost, and counted, as a record that cannot be packed
            target.drop(1)
            return
        target.read((context.batch, key, nbytes, start_ns, end_ns, verdict))
    except Exception:  # never into the reader; the event is lost
        return


EMPTY_READ_NS = 1_000_000  # an empty read this long waited for something (a reply that never came): an event


def timed_read(location: str, offset: int, verdict: int, start_ns: int, count: Callable[[T], int],
               read: Callable[[Any, Any], T], target: Any, argument: Any) -> tuple[T, int]:
    """`read(target, argument)` recorded as one read of `location` at `offset`, started at `start_ns` (0: now):
    its result and the bytes `count` finds in it; -1 bytes when it ran inside another recorded read of this
    thread (a `ReadSpan`, a wrapper of the same file), which is the event. A read that raises an Exception is
    recorded as a failed one, of no bytes (the correlator books its worker's back-off to the hub), and raises as
    it would; one that found the end at once is not recorded (no bytes within `EMPTY_READ_NS`: the last of most
    files' reads, it neither read nor waited). A method and its object, not a bound method (`call` calls one): a
    captured file's every read of the file system passes here, and makes none (benchmarks/capture_overhead.py)."""
    thread, reading = get_ident(), context.reading
    if thread in reading:
        return read(target, argument), -1
    start = start_ns or monotonic_ns()
    reading[thread] = (location, offset, start)
    try:
        result = read(target, argument)
    except Exception:
        record_read(location, offset, 0, start, monotonic_ns(), verdict)
        raise
    finally:
        reading.pop(thread, None)  # a ReadSpan inside it may have ended it already
    nbytes, end = count(result), monotonic_ns()
    if nbytes or end - start >= EMPTY_READ_NS:
        record_read(location, offset, nbytes, start, end, verdict)
    return result, nbytes


def call(read: Callable[[Any], T], argument: Any) -> T:
    """`timed_read`'s `read` for a bound method or any one-argument callable."""
    return read(argument)


class ReadSpan:
    """Time one read of your own reader: `with ReadSpan(url, offset) as span: ...; span.bytes = n`.

    Set `span.bytes` (and `span.verdict` when the reader learns it) inside the block. A read that
    raises is recorded too, with the bytes set so far: a 30 s timeout is a stall worth seeing.
    As a decorator, `ReadSpan.wrap(fn)` records calls `fn(location, offset=0, ...)` returning a sized result.
    """

    __slots__ = ("_start", "bytes", "location", "offset", "verdict")

    def __init__(self, location: str, offset: int = 0) -> None:
        self.location = location
        self.offset = offset
        self.bytes = 0
        self.verdict = wire.VERDICT_UNKNOWN
        self._start = 0

    def __enter__(self) -> ReadSpan:
        self._start = start = time.monotonic_ns()
        context.reading[get_ident()] = (self.location, self.offset, start)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        context.reading.pop(get_ident(), None)
        record_read(self.location, self.offset, self.bytes, self._start, time.monotonic_ns(), self.verdict)

    @staticmethod
    def wrap(reader: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(reader)
        def recorded(*args: P.args, **kwargs: P.kwargs) -> R:
            location = str(args[0]) if args else str(kwargs.get("location", ""))
            offset = kwargs.get("offset", args[1] if len(args) > 1 else 0)
            with ReadSpan(location, offset if isinstance(offset, int) else 0) as span:
                result = reader(*args, **kwargs)
                span.bytes = len(result)
            return result

        return recorded


class RecordedFile:
    """A binary file whose reads are recorded, one event a call: read(), read1(), readinto(), readinto1(),
    readline(), readlines() and iteration.

    Tracks its own position instead of calling tell(), which would cost a system call per read.
    Everything else is the wrapped file's, pickling included (it refuses as the file does). A read made
    while another recorded read of the same thread is open (a `ReadSpan` around it, or a wrapper of this
    file) is not recorded again: the outer read is the event.
    """

    def __init__(self, raw: IO[bytes], path: str, verdict: int = wire.VERDICT_UNKNOWN,
                 position: int | None = None) -> None:
        self._file = raw
        self._path = path
        self._verdict = verdict
        self._position = position if position is not None else raw.tell() if raw.seekable() else 0

    def _recorded(self, read: Callable[[Any], T], argument: Any, count: Callable[[T], int]) -> T:
        result: T = _read_on(self, count, call, read, argument)
        return result

    def read(self, size: int | None = -1) -> bytes:
        return self._recorded(self._file.read, size, len)

    def read1(self, size: int = -1) -> bytes:
        return self._recorded(self._file.read1, size, len)  # type: ignore[attr-defined,no-any-return]

    def readinto(self, buffer: Any) -> int:
        return self._recorded(self._file.readinto, buffer, count_read)  # type: ignore[attr-defined,no-any-return]

    def readinto1(self, buffer: Any) -> int:
        return self._recorded(self._file.readinto1, buffer, count_read)  # type: ignore[attr-defined,no-any-return]

    def readline(self, size: int | None = -1) -> bytes:
        return self._recorded(self._file.readline, size, len)

    def readlines(self, hint: int = -1) -> list[bytes]:
        return self._recorded(self._file.readlines, hint, _total_length)

    def __iter__(self) -> RecordedFile:
        self._file.__iter__()  # raises as the file does once closed
        return self

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._position = self._file.seek(offset, whence)
        return self._position

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        return self._file.__reduce_ex__(protocol)

    def __enter__(self) -> RecordedFile:
        self._file.__enter__()  # raises as the file does once closed
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def count_read(count: int | None) -> int:
    """The bytes a `readinto` read: None (nothing ready, non-blocking) read none."""
    return count or 0


def _total_length(lines: list[bytes]) -> int:
    return sum(map(len, lines))


class FileReads:
    """A captured raw file's reads, recorded, one event a call that reads the file: `readinto` (a buffer's
    refill, or a read larger than the buffer), `readall`, `read`; `seek` keeps the position (a `tell()`
    would cost a system call a read). Without the C parts, `record_reads` puts these methods in the file's
    instance dict, where the buffer and any caller find them before `io.FileIO`'s: the file stays the
    `io.FileIO` that `open()` made, and its buffer keeps the fast paths it takes for one (a subclass made
    before the buffer cost it an attribute lookup a read, ~9,000 instructions a JPEG). The file is held
    weakly: no cycle through its dict, so a file nobody closes is closed when dropped, as before. In C
    (`_speedups.record_reads`) the file becomes a subclass of `io.FileIO` with these methods until its close,
    after its buffer was made, these reads' state a `_speedups.FileReads` that the C parts keep by the file."""

    __slots__ = ("_file", "_path", "_position", "_verdict")

    def __init__(self, file: io.FileIO, path: str, verdict: int, position: int) -> None:
        self._file = weakref.ref(file)
        self._path, self._verdict, self._position = path, verdict, position

    def _live(self) -> io.FileIO:
        file = self._file()
        if file is None:
            raise ValueError("I/O operation on closed file.")
        return file

    def _timed(self, read: Callable[[Any, Any], T], count: Callable[[T], int], argument: Any) -> T:
        return _read_on(self, count, read, self._live(), argument)

    def readinto(self, buffer: Any, /) -> int | None:
        return self._timed(_FILE_READINTO, count_read, buffer)

    def readall(self) -> bytes:
        return self._timed(_read_all, len, None)

    def read(self, size: int | None = -1, /) -> bytes | None:
        return self._timed(_FILE_READ, _length, size)

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        self._position = io.FileIO.seek(self._live(), offset, whence)
        return self._position


RECORDED_METHODS = ("readinto", "readall", "read", "seek")  # what `record_in_dict` puts in a file's dict


def record_in_dict(file: io.FileIO, path: str, verdict: int, position: int = 0) -> None:
    """`record_reads` in Python: a `FileReads`'s methods in the file's instance dict."""
    reads = FileReads(file, path, verdict, position)
    methods = (reads.readinto, reads.readall, reads.read, reads.seek)
    try:
        file.readinto, file.readall, file.read, file.seek = methods  # type: ignore[method-assign]
    except BaseException:  # all four or none: a file recording only some of its calls would miscount its reads
        for name in RECORDED_METHODS:
            file.__dict__.pop(name, None)
        raise


_CAPTURED_FILE: type | None = None
record_reads_of: Callable[[io.FileIO, str, int, int], None] = record_in_dict
if _speedups is not None:  # the same in C: ~1 µs less a read
    _speedups.configure(context, read_key, EMPTY_READ_NS, transport._current, Channel, transport.FULL)
    _CAPTURED_FILE, record_reads_of = _speedups.CapturedFileIO, _speedups.record_reads


def record_reads(file: io.FileIO, path: str, verdict: int, position: int = 0) -> None:
    """Record the reads of `file` (the `io.FileIO` that `open()` made, for reading, at `position`) as reads of
    `path` with `verdict`, until its close."""
    record_reads_of(file, path, verdict, position)


def recorder(file: Any) -> Any:
    """The state a raw file's reads are recorded with (`FileReads`, or `_speedups.FileReads`), None for a file
    that does not record its reads (`record_reads`)."""
    if _speedups is not None and type(file) is _CAPTURED_FILE:
        return _speedups.recorder(file)
    found = getattr(getattr(file, "readinto", None), "__self__", None)
    return found if isinstance(found, FileReads) else None


def recorded(file: Any) -> bool:
    """Whether `file` (a raw file) records its reads (`record_reads`)."""
    return recorder(file) is not None
_FILE_READINTO, _FILE_READ = io.FileIO.readinto, io.FileIO.read


def _read_on(file: RecordedFile | FileReads, count: Callable[[T], int], read: Callable[[Any, Any], T], target: Any,
             argument: Any) -> T:
    """A recorded file's (or a captured raw file's) `read(target, argument)` at its position, which moves on by
    the bytes read."""
    result: T
    result, nbytes = timed_read(file._path, file._position, file._verdict, 0, count, read, target, argument)
    if nbytes > 0:  # -1: inside another recorded read, which keeps its own position
        file._position += nbytes
    return result


def _read_all(file: io.FileIO, _: None) -> bytes:
    return io.FileIO.readall(file)


def _length(data: bytes | None) -> int:
    return 0 if data is None else len(data)


# Not the builtin as called: read capture (`stallwatch.client.capture`) may replace that with its own.
_open = io.open


def open_recorded(path: str | os.PathLike[str], buffering: int = -1) -> RecordedFile:
    """`open(path, "rb")` with every read recorded."""
    name = os.fspath(path)
    return RecordedFile(_open(name, "rb", buffering=buffering), name)  # closed by the wrapper


def http_get(url: str, offset: int = 0, length: int | None = None, timeout: float = 60.0) -> bytes:
    """GET a URL (a byte range when offset/length are given), recording the read and its
    cache's verdict (`verdict_from_headers`). HTTP errors raise as urllib raises them, after being recorded."""
    request = urllib.request.Request(url)
    if offset or length is not None:
        end = "" if length is None else str(offset + length - 1)
        request.add_header("Range", f"bytes={offset}-{end}")
    with ReadSpan(url, offset) as span, urllib.request.urlopen(request, timeout=timeout) as response:
        verdict = verdict_from_headers(response.headers)
        span.verdict = wire.VERDICT_UNKNOWN if verdict is None else verdict
        data: bytes = response.read()
        span.bytes = len(data)
    return data
