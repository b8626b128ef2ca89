"""Real servers for spoke tests: a hub (Python http.server serving files), a real nginx spoke, and a
real `stallwatch agent` process, all on 127.0.0.1 with ephemeral ports and temp directories."""

from __future__ import annotations

import functools
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from stallwatch.demo.spoke import Nginx, nginx_binary
from stallwatch.harness import free_port, scrape, start_agent, stop_agent
from tests.conftest import ROOT

NGINX = nginx_binary()
__all__ = ["NGINX", "ROOT", "Agent", "Hub", "Nginx", "free_port", "get"]


class _HubHandler(SimpleHTTPRequestHandler):
    """Serves files; those named slow-* take SLOW_SECONDS, so a cache update is still running when the
    next request arrives (how nginx's UPDATING status happens)."""

    SLOW_SECONDS = 1.0

    def do_GET(self) -> None:
        if "/slow-" in self.path:
            time.sleep(self.SLOW_SECONDS)
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Hub:
    """An HTTP file server on 127.0.0.1:0, in a thread."""

    def __init__(self, directory: Path) -> None:
        handler = functools.partial(_HubHandler, directory=str(directory))
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def get(url: str, headers: Mapping[str, str] | None = None) -> tuple[int, bytes, Mapping[str, str]]:
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


class Agent:
    """A real `stallwatch agent` process; `scrape()` returns {(sample name, labels...): value}."""

    def __init__(self, args: Sequence[str]) -> None:
        fd, log = tempfile.mkstemp(prefix="stallwatch-agent-", suffix=".log")
        os.close(fd)
        self._agent = start_agent(["--no-collector.gpu", *args], Path(log))
        self.process = self._agent.process
        self.url = self._agent.url

    @property
    def log(self) -> list[str]:
        return self._agent.stderr().splitlines(keepends=True)

    def scrape(self) -> dict[tuple[str, ...], float]:
        return {(name, *(f"{k}={v}" for k, v in labels)): value for (name, labels), value in scrape(self.url).items()}

    def close(self) -> None:
        stop_agent(self._agent)
        self._agent.log.unlink(missing_ok=True)
