"""The demo's hub: an HTTP server holding a sharded dataset behind an emulated region boundary.

Every response first waits one round trip, then streams at a capped bandwidth, as a bucket in another
region would. The hub can be cut (`/-/outage?seconds=N` or `Hub.cut_for()`): during an outage it
accepts connections and answers nothing until the outage ends, the way a broken long-haul link looks
to a cache in front of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BufferedIOBase
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import parse_qs, urlsplit

CHUNK = 64 * 1024


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def make_dataset(directory: Path, shards: int, shard_bytes: int) -> list[str]:
    """Write `shards` files of deterministic bytes; return their names (sorted)."""
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for index in range(shards):
        name = shard_name(index)
        path = directory / name
        if not path.exists() or path.stat().st_size != shard_bytes:
            seed = hashlib.sha256(name.encode()).digest()
            path.write_bytes((seed * (shard_bytes // len(seed) + 1))[:shard_bytes])
        names.append(name)
    return names


@dataclass
class HubSettings:
    """The dataset the hub serves and how far away it is: the part of each demo's settings about the hub."""

    shards: int
    shard_mib: float
    rtt_seconds: float
    bandwidth_mbit: float

    @property
    def shard_bytes(self) -> int:
        return int(self.shard_mib * 2**20)

    @property
    def dataset_bytes(self) -> int:
        return self.shards * self.shard_bytes


def start_hub(stack: contextlib.ExitStack, work: Path, settings: HubSettings) -> Hub:
    """A fresh `work` folder holding the dataset, and the hub serving it until `stack` closes."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    make_dataset(work / "dataset", settings.shards, settings.shard_bytes)
    hub = Hub(work / "dataset", settings.rtt_seconds, settings.bandwidth_mbit * 1e6 / 8).start()
    stack.callback(hub.close)
    return hub


class Hub:
    def __init__(
        self,
        root: Path,
        rtt_seconds: float = 0.06,
        bandwidth_bytes_per_second: float = 300e6 / 8,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.rtt_seconds = rtt_seconds
        self.bandwidth = bandwidth_bytes_per_second
        self._clock = clock
        self._outage_until = 0.0
        self._refusing = False
        self.requests = 0
        self.bytes_sent = 0
        self._lock = threading.Lock()
        handler = type("_BoundHandler", (_HubHandler,), {"hub": self})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Hub:
        self._thread.start()
        return self

    def close(self) -> None:
        self._outage_until = 0.0
        self._server.shutdown()
        self._server.server_close()

    def cut_for(self, seconds: float, refuse: bool = False) -> None:
        """Out for `seconds`: answering nothing until then, or with `refuse`, closing each connection a round trip
        after it asks (the spoke answers its client 502 at once)."""
        self._refusing = refuse
        self._outage_until = self._clock() + seconds

    def in_outage(self) -> bool:
        return self._clock() < self._outage_until

    def wait_out_outage(self) -> None:
        """Return once the hub is back, or raise `RefusedError` while it refuses."""
        if self._refusing and self.in_outage():
            time.sleep(self.rtt_seconds)
            raise RefusedError
        while self.in_outage():
            time.sleep(0.05)

    def account(self, sent: int) -> None:
        with self._lock:
            self.bytes_sent += sent

    def send(self, out: BufferedIOBase, handle: BinaryIO, size: int) -> None:
        """Stream `size` bytes of `handle` to `out` at the hub's bandwidth, and count them."""
        started = time.monotonic()
        sent = 0
        while sent < size and (chunk := handle.read(min(CHUNK, size - sent))):
            out.write(chunk)
            sent += len(chunk)
            ahead = sent / self.bandwidth - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
        self.account(sent)


class RefusedError(Exception):
    """The hub refuses a request: its connection closes unanswered."""


class OutageHandler(BaseHTTPRequestHandler):
    """A handler whose requests an outage holds: by the time the hub answers, the spoke may have given up on one
    (nginx closes it at its read timeout), and writing to it fails. Nothing is left to answer, and the demo's
    terminal gets no traceback for it. A request the hub refuses ends its connection the same way."""

    def handle(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, RefusedError):
            super().handle()


class _HubHandler(OutageHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        if parts.path == "/-/outage":
            seconds = float(parse_qs(parts.query).get("seconds", ["30"])[0])
            self.hub.cut_for(seconds)
            self._reply_small(200, f"hub cut for {seconds} s\n")
            return
        self.hub.wait_out_outage()
        path = (self.hub.root / parts.path.lstrip("/")).resolve()
        if self.hub.root.resolve() not in path.parents or not path.is_file():
            self._reply_small(404, "no such shard\n")
            return
        with self.hub._lock:
            self.hub.requests += 1
        time.sleep(self.hub.rtt_seconds)
        size = path.stat().st_size
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.send_header("Cache-Control", "public, max-age=86400")
        self.end_headers()
        with path.open("rb") as handle:
            self.hub.send(self.wfile, handle, size)

    def do_HEAD(self) -> None:
        # What the agent's hub probe asks: one round trip, no body, not counted as a fetch.
        self.hub.wait_out_outage()
        time.sleep(self.hub.rtt_seconds)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _reply_small(self, status: int, text: str) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass
