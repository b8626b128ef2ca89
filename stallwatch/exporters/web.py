"""The agent's HTTP endpoint: /metrics, a landing page, and health checks for probes.

With a web config (`web_config`), every path needs basic auth and/or the server speaks TLS. The TLS
handshake runs in the request's own thread, under the handler's timeout, so a client that connects
and never completes its handshake cannot stall the accept loop for everyone else.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from stallwatch.exporters.web_config import WebConfig

log = logging.getLogger(__name__)

LANDING_PAGE = """<!doctype html>
<html><head><title>stallwatch agent</title></head>
<body><h1>stallwatch agent</h1>
<p>Training input stalls, GPU and spoke cache metrics for this node.</p>
<ul><li><a href="{path}">{path}</a></li><li><a href="/-/healthy">/-/healthy</a></li></ul>
</body></html>
"""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry
    telemetry_path: str
    web_config: WebConfig
    wedged: Callable[[], list[str]]  # collectors stuck past their deadlines: /-/healthy fails while any are

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed handshake or a client gone mid-reply is the client's problem, not a traceback on stderr.
        log.debug("request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "stallwatch"
    timeout = 10.0  # seconds a client may take for its handshake and request

    def setup(self) -> None:
        super().setup()
        if self.server.web_config.tls is not None:
            self.request.do_handshake()

    def do_GET(self) -> None:
        auth = self.server.web_config.auth
        if auth is not None and not auth.allows(self.headers.get("Authorization")):
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="stallwatch"')
            self.send_header("Content-Length", "13")
            self.end_headers()
            self.wfile.write(b"unauthorized\n")
            return
        path = self.path.split("?", 1)[0]
        if path == self.server.telemetry_path:
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._reply(200, content_type, encoder(self.server.registry))
        elif path == "/":
            page = LANDING_PAGE.format(path=self.server.telemetry_path)
            self._reply(200, "text/html; charset=utf-8", page.encode())
        elif path == "/-/healthy" and (wedged := self.server.wedged()):
            self._reply(503, "text/plain; charset=utf-8", f"wedged collectors: {', '.join(wedged)}\n".encode())
        elif path in ("/-/healthy", "/-/ready"):
            self._reply(200, "text/plain; charset=utf-8", b"OK\n")
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found\n")

    def _reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, host: str, port: int, telemetry_path: str = "/metrics",
                 web_config: WebConfig | None = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_BoundServer", (_Server,), {"address_family": family})
        self._server: _Server = server_class((host, port), _Handler)
        self._server.registry = registry
        self._server.telemetry_path = telemetry_path
        self._server.web_config = web_config or WebConfig()
        self._server.wedged = list
        if self._server.web_config.tls is not None:
            self._server.socket = self._server.web_config.tls.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread = threading.Thread(target=self._server.serve_forever, name="stallwatch-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        shown = "localhost" if host in ("0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)
        scheme = "https" if self._server.web_config.tls is not None else "http"
        return f"{scheme}://{shown}:{port}{self._server.telemetry_path}"

    def report_wedged(self, wedged: Callable[[], list[str]]) -> None:
        """Where /-/healthy learns which collectors are wedged (by default: none ever are)."""
        self._server.wedged = wedged

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever(), forever if it never ran
            self._server.shutdown()
        self._server.server_close()
