"""Real servers for spoke tests: a hub (Python http.server serving files), a real nginx spoke, and a
real `stallwatch agent` process, all on 127.0.0.1 with ephemeral ports and temp directories."""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, free_port, start_agent, stop_agent

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


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


def stallwatch_log_format() -> str:
    """The `log_format stallwatch ...;` directive exactly as docs/nginx-spoke.conf ships it."""
    text = (ROOT / "docs" / "nginx-spoke.conf").read_text()
    match = re.search(r"^\s*(log_format stallwatch .*?;)\s*$", text, re.MULTILINE | re.DOTALL)
    assert match, "docs/nginx-spoke.conf lost its log_format"
    return match.group(1)


class Nginx:
    """A real nginx run as the current user with its own prefix, config and temp paths."""

    def __init__(self, prefix: Path, http_block: str) -> None:
        self.prefix = prefix
        self.port = free_port()
        for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi", "cache", "logs"):
            (prefix / name).mkdir(parents=True, exist_ok=True)
        self.access_log = prefix / "logs" / "access.log"
        self.error_log = prefix / "logs" / "error.log"
        # Unprivileged, nginx runs as the current user; as root it would switch its workers to nobody,
        # who cannot write this prefix, so then it is told to stay root.
        user = "user root;" if os.geteuid() == 0 else ""
        (prefix / "nginx.conf").write_text(f"""
{user}
worker_processes 1;
error_log {self.error_log} info;
events {{ worker_connections 64; }}
http {{
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    {stallwatch_log_format()}
    access_log {self.access_log} stallwatch;
    proxy_cache_path {prefix}/cache levels=1:2 keys_zone=spoke:1m max_size=64m;
    server {{
        listen 127.0.0.1:{self.port};
        {http_block}
    }}
}}
""")
        self._globals = f"daemon off; pid {prefix}/nginx.pid;"
        self.process = subprocess.Popen(
            [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", self._globals],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited: {self.process.stderr.read().decode() if self.process.stderr else ''}"
                                   f"{self.error_log.read_text() if self.error_log.exists() else ''}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("nginx did not start listening")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def reopen(self) -> None:
        """`nginx -s reopen`: what logrotate's postrotate runs after renaming the log."""
        subprocess.run([NGINX, "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf"), "-g", self._globals,
                        "-s", "reopen"], check=True, capture_output=True, timeout=10)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


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
        with urllib.request.urlopen(self.url, timeout=10) as response:
            text = response.read().decode()
        samples: dict[tuple[str, ...], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, *(f"{k}={v}" for k, v in sorted(sample.labels.items())))] = sample.value
        return samples

    def close(self) -> None:
        stop_agent(self._agent)
        self._agent.log.unlink(missing_ok=True)
