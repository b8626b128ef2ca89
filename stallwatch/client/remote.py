"""Remote read capture: the HTTP replies and object-store files a loader reads, recorded where they are read,
with no change to the code that reads. `capture.start()` starts it with the capture of `open()`.

Each seam is patched once its library is imported, at `start()` or when the process imports it later
(`bootstrap.after_import`); none is imported here. Reads are recorded only while the process's reads have
a source (`reads.bound`), each through `reads.timed_read`: one event a read call, at the offset it read from.

- urllib3 (requests, and boto3's `StreamingBody`, which reads the urllib3 reply: one seam, so one event):
  the body of a GET reply, each `read`/`read1` of it (`stream()`, `readinto` and requests' `iter_content`
  read through them) and each chunk of `read_chunked`, keyed by the request's URL at its Range start plus
  the bytes read before. The first read starts when the request was sent: the wait for the reply's headers
  is part of reading it (the request is its thread's open read from then), and the last read ends when the
  body's bytes were read. A reply urllib3 reads whole as it arrives (`preload_content`) is one event, and so
  is an error reply (status 400 or more, a failed fetch): no bytes, from the request to its headers; its page
  is no dataset bytes and is not recorded. A request that gets no reply (refused, reset, timed out) is one too.
  An HTTPS connection's connect (and handshake) comes before its request: its first GET starts there, and a
  connect that fails is a failed fetch of the server.
- fsspec (s3fs, gcsfs, HTTP): each `read` of an `AbstractBufferedFile` (`readinto`, `readline` and
  iteration read through it), keyed `protocol://path` at the file's position; the fetches from the
  store happen inside it. A file class with a `read` of its own (fsspec's `HTTPFile`, which fetches a
  whole file before its base's read) has that one recorded, from its first file on.
- webdataset: a shard opened over http(s) is read from curl's pipe; each read of the pipe.
- numpy, a local file's seam kept with these: `np.load` reads the array of a file `capture` captured
  through `read()`, as it reads any file object but a real file (whose descriptor `fromfile` would read in
  C, unrecorded).

The verdict is the reply's cache header's (`reads.verdict_from_headers`) where the reader sees one; else a
read through a spoke (`SPOKE_URLS_ENV`, URL prefixes) is left to the agent, any other crossed no spoke
(`wire.VERDICT_DIRECT`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Generator, Mapping
from threading import get_ident
from types import ModuleType
from typing import Any, TypeVar
from urllib.parse import urlsplit

from stallwatch.client import wire
from stallwatch.client.bootstrap import after_import
from stallwatch.client.keys import range_start
from stallwatch.client.reads import (
    RecordedFile,
    bound,
    call,
    context,
    record_read,
    recorded,
    timed_read,
    verdict_from_headers,
)

T = TypeVar("T")

SPOKE_URLS_ENV = "STALLWATCH_SPOKE_URLS"  # spokes' URLs (prefixes), separated by spaces or commas
_DEFAULT_PORTS = {"http": 80, "https": 443}
_SENT = "_stallwatch_sent"  # on a urllib3 connection: the GET it sent, until its reply
_CONNECTED = "_stallwatch_connected"  # on an HTTPS connection: when its connect began, until its first request
_BODY = "_stallwatch_body"  # on a urllib3 reply: its body's reads (`_Body`)
_WHERE = "_stallwatch_where"  # on an fsspec file: (location, verdict)


def normal_url(url: str) -> str:
    """`http://spoke/data` -> `http://spoke:80/data`: URLs compared with their ports."""
    parts = urlsplit(url)
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 0)
    return f"{parts.scheme}://{parts.hostname}:{port}{parts.path}"


def spoke_urls(env: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The spokes' URL prefixes, ending in `/` (`http://spoke:80/data/` does not take in `/database`)."""
    return tuple(normal_url(url).rstrip("/") + "/" for url in env.get(SPOKE_URLS_ENV, "").replace(",", " ").split())


class _Settings:
    __slots__ = ("finders", "patched", "spokes")

    def __init__(self) -> None:
        self.spokes: tuple[str, ...] = ()
        self.patched: list[tuple[Any, str, Any]] = []  # (class or dict, name, original), to put back
        self.finders: list[Any] = []  # `after_import` hooks still waiting for their module


_settings = _Settings()


def _verdict(url: str, headers: Any = None) -> int:
    seen: int | None = None if headers is None else verdict_from_headers(headers)
    if seen is not None:
        return seen
    through_spoke = bool(_settings.spokes) and (normal_url(url) + "/").startswith(_settings.spokes)
    return wire.VERDICT_UNKNOWN if through_spoke else wire.VERDICT_DIRECT


def _patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    """Replace `owner`'s `name` (an attribute of a class, or a dict's item) by `wrap(original)`."""
    if isinstance(owner, dict):
        original = owner[name]
        owner[name] = wrap(original)
    else:
        original = owner.__dict__[name]
        setattr(owner, name, wrap(original))
    _settings.patched.append((owner, name, original))


# urllib3 ------------------------------------------------------------------------------------------------------


class _Body:
    """A GET reply's body being read: where it is, and when its request was sent (until its first read)."""

    __slots__ = ("location", "position", "sent", "verdict")

    def __init__(self, location: str, position: int, verdict: int, sent: int) -> None:
        self.location, self.position, self.verdict, self.sent = location, position, verdict, sent

    def read(self, count: Callable[[Any], int], read: Callable[[Any], Any], argument: Any) -> Any:
        start, self.sent = self.sent, 0  # the first read waited for the headers too
        result, nbytes = timed_read(self.location, self.position, self.verdict, start, count, call, read, argument)
        self.position += max(nbytes, 0)
        return result

    def chunks(self, chunks: Generator[bytes]) -> Generator[bytes]:
        with contextlib.closing(chunks):  # closed with this one, as the chunks would be
            while (chunk := self.read(_size, functools.partial(next, chunks), None)) is not None:
                yield chunk


def _size(data: bytes | None) -> int:
    return len(data) if data else 0


# Per thread, the open read of its fetch under way, until the reply's headers (`context.reading` holds it too).
_awaiting: dict[int, tuple[str, int, int]] = {}


class _Sent:
    """A fetch under way until its reply's headers: a GET sent, or an HTTPS connection's connect before its first
    request. The wait for them is part of reading the reply, so the fetch is its thread's open read from its start
    (a hub gone quiet is a read in flight while it lasts), unless the thread is inside another recorded read (a
    `ReadSpan`), which is the read then."""

    __slots__ = ("location", "offset", "open", "preloaded", "start")

    def __init__(self, location: str, offset: int, preloaded: bool, start: int | None = None) -> None:
        self.location, self.offset, self.preloaded = location, offset, preloaded
        self.start = start or time.monotonic_ns()
        thread, reading = get_ident(), context.reading
        current = reading.get(thread)
        if current is not None and current is _awaiting.get(thread):
            current = None  # an earlier GET's, never answered (urllib3 asks for no reply with a read timeout of 0)
        self.open = (location, offset, self.start) if current is None else None
        if self.open is not None:
            reading[thread] = _awaiting[thread] = self.open

    def awaited(self, wait: Callable[[], T]) -> T:
        """`wait()` for the reply (or the connection), raising as it raises: failed if it raises, answered if not."""
        try:
            result = wait()
        except Exception:
            self.failed()
            raise
        self.answered()
        return result

    def answered(self) -> None:
        """The headers came (or nothing will): the thread's open read is the body's, if any, from here on."""
        if self.open is None:
            return
        thread = get_ident()
        for opened in (context.reading, _awaiting):
            if opened.get(thread) is self.open:
                del opened[thread]

    def failed(self) -> None:
        """No reply (the connection refused or reset, a timeout waiting for the headers): a failed fetch, of no bytes,
        from the request until now."""
        try:  # never into the request: its own error is what its caller gets
            self.answered()
            if self.open is not None:
                record_read(self.location, self.offset, 0, self.start, time.monotonic_ns(), _verdict(self.location))
        except Exception:
            return


def _connect(original: Callable[..., Any]) -> Callable[..., Any]:
    """An HTTPS connection connects (and shakes hands) before its request is sent, so its first GET's read starts
    there; while it connects, its thread's open read is the server's, and a connect that fails is a failed fetch of
    it (a hub whose address no longer answers). A plain HTTP connection connects inside `request`."""
    def connect(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _SENT in self.__dict__ or not bound():  # within a request (a connection reopened): the request's read
            return original(self, *args, **kwargs)
        try:
            connecting = _Sent(f"https://{self.host}:{self.port}/", 0, True)
        except Exception:  # never into the connect: it is recorded with its request, if at all
            return original(self, *args, **kwargs)
        result = connecting.awaited(lambda: original(self, *args, **kwargs))
        self.__dict__[_CONNECTED] = connecting.start
        return result
    return connect


def _request(original: Callable[..., Any], https: type) -> Callable[..., Any]:
    def request(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        sent = None
        connected = self.__dict__.pop(_CONNECTED, None)
        if method == "GET" and bound():
            try:  # (url, Range header, preload_content), as `request(method, url, body, headers, ...)` has them
                headers = kwargs.get("headers", args[1] if len(args) > 1 else None) or {}
                ranges = next((value for name, value in headers.items() if name.lower() == "range"), "")
                ranges = ranges.decode("latin-1") if isinstance(ranges, bytes) else ranges  # botocore's are bytes
                location = url if "://" in url else (  # a path, as a client asks a server that is no proxy
                    f"{'https' if isinstance(self, https) else 'http'}://{self.host}:{self.port}{url}")
                sent = self.__dict__[_SENT] = _Sent(location, range_start(ranges), kwargs.get("preload_content", True),
                                                    connected)
            except Exception:  # never into the request: its reply is read uncaptured
                self.__dict__.pop(_SENT, None)
        try:
            return original(self, method, url, *args, **kwargs)
        except Exception:
            if sent is not None:
                self.__dict__.pop(_SENT, None)
                sent.failed()
            raise
    return request


def _getresponse(original: Callable[..., Any]) -> Callable[..., Any]:
    def getresponse(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent: _Sent | None = self.__dict__.pop(_SENT, None)
        if sent is None:
            return original(self, *args, **kwargs)
        response = sent.awaited(lambda: original(self, *args, **kwargs))
        _follow(response, sent)
        return response
    return getresponse


def _follow(response: Any, sent: _Sent) -> None:
    """Record the reply's body as it is read (or now, read whole already)."""
    try:
        url, offset = sent.location, sent.offset
        verdict = _verdict(url, response.headers)
        if response.status >= 400:  # a failed fetch (a spoke's 502 for a hub out): no bytes of the dataset, its page
            record_read(url, offset, 0, sent.start, time.monotonic_ns(), verdict)  # unread, the wait for it recorded
        elif sent.preloaded:
            record_read(url, offset, len(response.data), sent.start, time.monotonic_ns(), verdict)
        else:
            response.__dict__[_BODY] = _Body(url, offset, verdict, sent.start)
    except Exception:  # never into the reader: the body is read uncaptured
        response.__dict__.pop(_BODY, None)


def _body_read(original: Callable[..., Any]) -> Callable[..., Any]:
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        body = self.__dict__.get(_BODY)
        if body is None:
            return original(self, *args, **kwargs)
        return body.read(len, lambda response: original(response, *args, **kwargs), self)
    return read


def _read_chunked(original: Callable[..., Any]) -> Callable[..., Any]:
    def read_chunked(self: Any, *args: Any, **kwargs: Any) -> Generator[bytes]:
        chunks: Generator[bytes] = original(self, *args, **kwargs)
        body = self.__dict__.get(_BODY)
        return chunks if body is None else body.chunks(chunks)
    return read_chunked


def _patch_urllib3(urllib3: ModuleType) -> None:
    connection, response = urllib3.connection.HTTPConnection, urllib3.response.HTTPResponse
    https = urllib3.connection.HTTPSConnection
    _patch(connection, "request", lambda original: _request(original, https))
    _patch(https, "connect", _connect)
    _patch(connection, "getresponse", _getresponse)
    for name in ("read", "read1"):
        _patch(response, name, _body_read)
    _patch(response, "read_chunked", _read_chunked)


# fsspec -------------------------------------------------------------------------------------------------------


def _where(file: Any) -> tuple[str, int]:
    """An fsspec file's location (`s3://bucket/key`, a URL) and verdict, found once a file."""
    where: tuple[str, int] | None = file.__dict__.get(_WHERE)
    if where is None:
        location = file.fs.unstrip_protocol(file.path)
        # An object store's requests go to its endpoint (s3fs's `endpoint_url`): a spoke, or the store.
        endpoint = getattr(file.fs, "endpoint_url", None)
        where = file.__dict__[_WHERE] = (location, _verdict(endpoint if isinstance(endpoint, str) else location))
    return where


def _file_read(original: Callable[..., Any]) -> Callable[..., Any]:
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not bound():
            return original(self, *args, **kwargs)
        try:
            (location, verdict), offset = _where(self), self.loc
        except Exception:  # never into the reader: this read is uncaptured
            return original(self, *args, **kwargs)
        return timed_read(location, offset, verdict, 0, len, lambda file, _: original(file, *args, **kwargs), self,
                          None)[0]
    return read


def _file_init(original: Callable[..., Any], base: type) -> Callable[..., Any]:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            for owner in type(self).__mro__:
                if owner is base:
                    break
                if "read" in owner.__dict__ and not any(patched is owner for patched, _, _ in _settings.patched):
                    _patch(owner, "read", _file_read)
        except Exception as error:  # never into the opener
            print(f"stallwatch: {type(self).__name__} reads uncaptured: {error!r}", file=sys.stderr)
    return init


def _patch_fsspec(fsspec: ModuleType) -> None:
    base = fsspec.spec.AbstractBufferedFile
    _patch(base, "read", _file_read)
    _patch(base, "__init__", lambda original: _file_init(original, base))


# webdataset ---------------------------------------------------------------------------------------------------


def _shard_opener(original: Callable[..., Any]) -> Callable[..., Any]:
    def gopen(url: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        stream = original(url, mode, *args, **kwargs)
        if not bound() or mode != "rb":
            return stream
        try:
            return RecordedFile(stream, url, _verdict(url), 0)
        except Exception:  # never into the reader: the shard is read uncaptured
            return stream
    return gopen


def _patch_webdataset(webdataset: ModuleType) -> None:
    schemes = sys.modules["webdataset.gopen"].gopen_schemes  # the package's `gopen` is the function
    for scheme in ("http", "https"):
        _patch(schemes, scheme, _shard_opener)


# numpy: a local file's seam, here with the others ----------------------------------------------------------


def _array_file(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def isfileobj(f: Any) -> bool:  # a captured file: read through `read()`, as NumPy reads other file objects
        return original(f) and not recorded(getattr(f, "raw", None))
    return isfileobj


def _patch_numpy(numpy: ModuleType) -> None:
    """`np.load` reads the array of a real file (`isfileobj`) with `fromfile`, C reading the descriptor past
    the buffer and its raw file: a captured file's array would go unrecorded."""
    module = sys.modules.get("numpy.lib._format_impl") or sys.modules["numpy.lib.format"]  # NumPy 2, 1
    _patch(module.__dict__, "isfileobj", _array_file)


SEAMS: dict[str, Callable[[ModuleType], None]] = {
    "urllib3": _patch_urllib3,
    "fsspec": _patch_fsspec,
    "webdataset": _patch_webdataset,
    "numpy": _patch_numpy,
}


def _patched_safely(patch: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def then(module: ModuleType) -> None:
        try:
            patch(module)
        except Exception as error:  # a version whose seams differ: its reads stay uncaptured
            print(f"stallwatch: {module.__name__} reads uncaptured: {error!r}", file=sys.stderr)
    return then


def start(env: Mapping[str, str] = os.environ) -> None:
    """Capture the remote reads of this process: its libraries' seams patched, now or once imported."""
    _settings.spokes = spoke_urls(env)
    if _settings.patched or _settings.finders:
        return
    for name, patch in SEAMS.items():
        finder = after_import(name, _patched_safely(patch))
        if finder is not None:
            _settings.finders.append(finder)


def stop() -> None:
    """The libraries as they were: what they read from then on is not captured, webdataset's shards opened
    before excepted."""
    for finder in _settings.finders:
        with contextlib.suppress(ValueError):  # its module was imported: it took itself out
            sys.meta_path.remove(finder)
    for owner, name, original in reversed(_settings.patched):
        if isinstance(owner, dict):
            owner[name] = original
        else:
            setattr(owner, name, original)
    _settings.finders.clear()
    _settings.patched.clear()
