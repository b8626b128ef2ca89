"""Outbound HTTP as the agent and the report make it (hub probes, spoke endpoints, Qumulo, Prometheus): one
total deadline per call, bounded reads, no redirect followed.

urllib's timeout holds for each socket read, so a server that trickles a byte at a time, or answers
`100 Continue` without end, holds a call for ever (spinning a core on the 1xx answers); it follows a
redirect to any host with the caller's Authorization header; and it reads a body of any size. Here:

- a `Deadline` covers the whole call: connect, TLS handshake, request, answer head and body. Each blocking
  step waits at most what is left of it (CPython's connect and TLS handshake keep one deadline over their
  own retries), so a trickle ends when the deadline does.
- the answer's head, 1xx answers included, is `HEAD_BYTES` at most: endless `100 Continue`s are a protocol
  error after a few thousand, in milliseconds.
- the body is read up to the caller's limit (a longer one is `TooLargeError`, before reading it when its length
  is declared); an answer of 300 or more keeps its first `ERROR_BODY_BYTES` only, enough for a message.
- a redirect is an answer like any other, left to the caller: no credential leaves the host it was given
  for (Go's net/http drops them when a redirect changes host; not following is simpler still).

The host's name is resolved by the system's resolver before the deadline's steps (getaddrinfo takes no
timeout).
"""

from __future__ import annotations

import http.client
import io
import mmap
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

HEAD_BYTES = 64 << 10
ERROR_BODY_BYTES = 4 << 10
_CHUNK = 1 << 20


class TooLargeError(Exception):
    """The body is longer than the caller's limit."""


class Deadline:
    """One time limit over every step of a call."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        """The seconds left; none left is a TimeoutError, as a socket's own timeout is."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete answer within {self.seconds:g} s")
        return left


@dataclass(frozen=True)
class Reply:
    status: int
    reason: str
    headers: http.client.HTTPMessage
    body: bytes


class _Reader(io.RawIOBase):
    """The answer as http.client reads it: each read waits at most what is left of the deadline, and the head
    (1xx answers included) is `HEAD_BYTES` at most until `head_read()`. Closing it closes the socket."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        super().__init__()
        self._sock, self._deadline = sock, deadline
        self._head_left: int | None = HEAD_BYTES

    def head_read(self) -> None:
        self._head_left = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        if self._head_left is not None:
            if not self._head_left:
                raise http.client.HTTPException(f"no final answer in its first {HEAD_BYTES} bytes")
            view = view[:self._head_left]
        self._sock.settimeout(self._deadline.left())
        read = self._sock.recv_into(view)
        if self._head_left is not None:
            self._head_left -= read
        return read

    def close(self) -> None:
        self._sock.close()
        super().close()


class _Socket:
    """What http.client uses of its socket: sendall (within the deadline), makefile (the reader, which owns
    the socket from then on) and close."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self._sock, self._deadline = sock, deadline
        self.reader = _Reader(sock, deadline)

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._deadline.left())
        self._sock.sendall(data)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(self.reader)

    def close(self) -> None:
        """Nothing: http.client closes its connection as soon as the answer's head is read (`Connection:
        close`), and the answer reads its body from the socket after that."""


def connect(host: str, port: int, deadline: Deadline,
            clock: Callable[[], float] = time.perf_counter) -> tuple[socket.socket, float]:
    """A TCP connection to the first of the host's addresses that answers (IPv6 and IPv4 alike), and the
    seconds of its handshake."""
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        start = clock()
        try:
            sock.settimeout(deadline.left())
            sock.connect(address)
        except OSError as failed:
            sock.close()
            error = failed
            continue
        return sock, clock() - start
    raise error


def send(sock: socket.socket, url: urllib.parse.SplitResult, method: str, headers: Mapping[str, str],
         deadline: Deadline, tls: ssl.SSLContext | None = None) -> http.client.HTTPResponse:
    """The answer's head to one request on a connected socket (after the TLS handshake, for https); its body
    is left to read, and closing the answer closes the socket."""
    host = url.hostname or ""
    try:
        if url.scheme == "https":
            sock.settimeout(deadline.left())
            sock = (tls or ssl.create_default_context()).wrap_socket(sock, server_hostname=host)
        wrapped = _Socket(sock, deadline)
        connection = http.client.HTTPConnection(host, url.port)
        connection.sock = cast(socket.socket, wrapped)
        connection.request(method, (url.path or "/") + (f"?{url.query}" if url.query else ""),
                           headers={"Connection": "close", **headers})
        response = connection.getresponse()
    except BaseException:
        sock.close()
        raise
    wrapped.reader.head_read()
    return response


def read_body(response: http.client.HTTPResponse, limit: int) -> bytes:
    """The answer's body, `limit` bytes at most: a longer one is TooLargeError."""
    if response.length is not None and response.length > limit:
        raise TooLargeError(f"a body of {response.length} bytes, over the limit of {limit}")
    # Into one mapping of the limit's size, whose pages take memory only once written: a buffer grown a chunk
    # at a time may be copied as it grows, and a 256 MiB answer then took 724 MiB at its peak.
    with mmap.mmap(-1, limit + 1) as buffer, memoryview(buffer) as view:
        size = 0
        while count := response.readinto(view[size:size + _CHUNK]):
            size += count
            if size > limit:
                raise TooLargeError(f"a body over the limit of {limit} bytes")
        if response.length:  # http.client's partial reads end quietly where the server hung up
            raise http.client.IncompleteRead(bytes(view[:size]), response.length)
        return bytes(view[:size])


def fetch(url: str, headers: Mapping[str, str], deadline: Deadline, *, limit: int,
          tls: ssl.SSLContext | None = None) -> Reply:
    """GET `url` within `deadline`: the answer, whatever its status, with its body (`limit` bytes at most; of
    an answer of 300 or more, its first ERROR_BODY_BYTES). Failures are raised as sockets and http.client
    raise them: TimeoutError, ssl.SSLError, another OSError (refused, unreachable, no such host),
    http.client.HTTPException (not an HTTP answer, or a cut one); and TooLargeError."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as error:
        raise http.client.InvalidURL(f"{url}: {error}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise http.client.InvalidURL(f"not an http(s) URL: {url}")
    sock, _ = connect(parts.hostname, port, deadline)
    with send(sock, parts, "GET", headers, deadline, tls) as response:
        body = response.read(ERROR_BODY_BYTES) if response.status >= 300 else read_body(response, limit)
        return Reply(response.status, response.reason, response.headers, body)
