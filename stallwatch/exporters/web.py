"""The agent's HTTP endpoint: /metrics, a landing page, and health checks for probes.

/metrics is prometheus_client's own WSGI app (`make_wsgi_app`): the Prometheus or OpenMetrics format
the scraper asks for, gzip when it accepts it, and `name[]` to ask for some metrics only. HEAD is
answered as GET is, without the body. An empty host (`:9842`) listens on IPv6 and IPv4 where the node
has both.

With a web config (`web_config`), every path needs basic auth and/or the server speaks TLS. Each new
connection is wrapped with the config's current TLS context (so a rotated certificate is used from the
next connection on), and the TLS handshake runs in the request's own thread, under the handler's
timeout, so a client that connects and never completes its handshake cannot stall the accept loop for
everyone else.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

from stallwatch.exporters.web_config import WebConfig
from stallwatch.scraper import SCRAPER

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
    # Connections the kernel queues while the accept loop is busy: Python's default of 5 turns a burst of
    # scrapes (many Prometheus replicas, probes) into SYN retries of a second or more; Go servers use 128.
    request_queue_size = 128
    metrics_app: Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
    telemetry_path: str
    web_config: WebConfig
    wedged: Callable[[], list[str]]  # collectors stuck past their deadlines: /-/healthy fails while any are
    dual_stack = False

    def server_bind(self) -> None:
        if self.dual_stack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = super().get_request()
        if self.web_config.tls is not None:  # the handshake waits for setup(), in the request's thread
            connection = self.web_config.tls.context().wrap_socket(connection, server_side=True,
                                                                   do_handshake_on_connect=False)
        return connection, address

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
            self._reply(401, "text/plain; charset=utf-8", b"unauthorized\n",
                        [("WWW-Authenticate", 'Basic realm="stallwatch"')])
            return
        path, _, query = self.path.partition("?")
        if path == self.server.telemetry_path:
            self._metrics(query)
        elif path == "/":
            page = LANDING_PAGE.format(path=self.server.telemetry_path)
            self._reply(200, "text/html; charset=utf-8", page.encode())
        elif path == "/-/healthy" and (wedged := self.server.wedged()):
            self._reply(503, "text/plain; charset=utf-8", f"wedged collectors: {', '.join(wedged)}\n".encode())
        elif path in ("/-/healthy", "/-/ready"):
            self._reply(200, "text/plain; charset=utf-8", b"OK\n")
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found\n")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _metrics(self, query: str) -> None:
        """The page prometheus_client's WSGI app makes, always as a GET (it refuses HEAD)."""
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": self.server.telemetry_path, "QUERY_STRING": query,
                   "HTTP_ACCEPT": self.headers.get("Accept", ""),
                   "HTTP_ACCEPT_ENCODING": self.headers.get("Accept-Encoding", "")}
        started: list[Any] = []
        scraper = SCRAPER.set(f"{self.client_address[0]} {self.connection.getsockname()[0]} "
                              f"{self.headers.get('User-Agent', '')}")
        try:
            body = b"".join(self.server.metrics_app(environ, lambda status, headers: started.extend((status, headers))))
        finally:
            SCRAPER.reset(scraper)
        status, headers = started
        self._reply(int(status.split()[0]), None, body, [*headers, ("Vary", "Accept-Encoding")])

    def _reply(self, status: int, content_type: str | None, body: bytes,
               headers: Iterable[tuple[str, str]] = ()) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class MetricsServer:
    def __init__(self, registry: CollectorRegistry, host: str, port: int, telemetry_path: str = "/metrics",
                 web_config: WebConfig | None = None):
        dual_stack = not host and socket.has_dualstack_ipv6()
        family = socket.AF_INET6 if dual_stack or ":" in host else socket.AF_INET
        server_class = type("_BoundServer", (_Server,), {"address_family": family, "dual_stack": dual_stack})
        self._server: _Server = server_class(("::" if dual_stack else host, port), _Handler)
        self._server.metrics_app = make_wsgi_app(registry)
        self._server.telemetry_path = telemetry_path
        self._server.web_config = web_config or WebConfig()
        self._server.wedged = list
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
