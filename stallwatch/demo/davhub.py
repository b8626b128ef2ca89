"""The hub as an object store: a WebDAV server over a folder, what JuiceFS's `webdav` storage speaks.

A JuiceFS spoke keeps its blocks in the hub's bucket; every request (PROPFIND, MKCOL, PUT, GET, DELETE)
first waits the hub's round trip, and GET bodies stream at its bandwidth, as `Hub` serves shards. Only
what JuiceFS's client (gowebdav) sends is answered: `Depth: 0` and `1` listings, byte ranges, and
collections made with their parents.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit
from xml.sax.saxutils import escape

from stallwatch.demo.hub import Hub, OutageHandler


class DavHub:
    """A WebDAV bucket under `root`, as far away as `hub` (its round trip, its bandwidth, its outages)."""

    def __init__(self, root: Path, hub: Hub, host: str = "127.0.0.1", port: int = 0) -> None:
        self.root, self.hub = root, hub
        self.gets = 0  # object reads: each one a block the spoke did not have
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)
        handler = type("_BoundDavHandler", (_DavHandler,), {"dav": self})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="dav-hub", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> DavHub:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """`bytes=A-B` or `bytes=A-` -> (start, length) within `size`; None for no (or another) range."""
    if not header or not header.startswith("bytes="):
        return None
    first, _, last = header[len("bytes="):].partition("-")
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    return start, max(end - start + 1, 0)


class _DavHandler(OutageHandler, BaseHTTPRequestHandler):  # named too: lint knows do_* by it
    dav: DavHub
    protocol_version = "HTTP/1.1"

    def _path(self) -> Path:
        path = (self.dav.root / unquote(urlsplit(self.path).path).lstrip("/")).resolve()
        root = self.dav.root.resolve()
        if path != root and root not in path.parents:
            raise PermissionError(self.path)
        return path

    def _distance(self) -> None:
        self.dav.hub.wait_out_outage()
        time.sleep(self.dav.hub.rtt_seconds)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _reply(self, status: int, body: bytes = b"", content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._distance()
        path = self._path()
        if not path.is_file():
            self._reply(404)
            return
        with self.dav._lock:
            self.dav.gets += 1
        size = path.stat().st_size
        wanted = _byte_range(self.headers.get("Range"), size)
        start, length = wanted if wanted is not None else (0, size)
        self.send_response(206 if wanted is not None else 200)
        if wanted is not None:
            self.send_header("Content-Range", f"bytes {start}-{start + length - 1}/{size}")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.end_headers()
        with path.open("rb") as handle:
            handle.seek(start)
            # The client may hang up early: JuiceFS's storage check reads part of an object.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.dav.hub.send(self.wfile, handle, length)

    def do_PUT(self) -> None:
        body = self._body()
        self._distance()
        path = self._path()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_bytes(body)
        partial.replace(path)  # a reader never sees half an object
        self._reply(201)

    def do_MKCOL(self) -> None:
        self._body()
        self._distance()
        self._path().mkdir(parents=True, exist_ok=True)
        self._reply(201)

    def do_DELETE(self) -> None:
        self._distance()
        path = self._path()
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            self._reply(404)
            return
        self._reply(204)

    def do_PROPFIND(self) -> None:
        self._body()
        self._distance()
        path = self._path()
        if not path.exists():
            self._reply(404)
            return
        entries = [path]
        if path.is_dir() and self.headers.get("Depth", "1") != "0":
            entries += sorted(child for child in path.iterdir() if not child.name.endswith(".partial"))
        responses = "".join(self._propstat(entry) for entry in entries)
        body = f'<?xml version="1.0" encoding="utf-8"?><D:multistatus xmlns:D="DAV:">{responses}</D:multistatus>'
        self._reply(207, body.encode(), "application/xml; charset=utf-8")

    def _propstat(self, path: Path) -> str:
        relative = path.relative_to(self.dav.root.resolve()).as_posix()
        href = "/" + quote("" if relative == "." else relative) + ("/" if path.is_dir() else "")
        stat = path.stat()
        kind = "<D:resourcetype><D:collection/></D:resourcetype>" if path.is_dir() else "<D:resourcetype/>"
        return (f"<D:response><D:href>{escape(href)}</D:href><D:propstat><D:prop>"
                f"<D:displayname>{escape(path.name)}</D:displayname>{kind}"
                f"<D:getcontentlength>{0 if path.is_dir() else stat.st_size}</D:getcontentlength>"
                f"<D:getlastmodified>{formatdate(stat.st_mtime, usegmt=True)}</D:getlastmodified>"
                "</D:prop><D:status>HTTP/1.1 200 OK</D:status></D:propstat></D:response>")

    def log_message(self, format: str, *args: Any) -> None:
        pass
