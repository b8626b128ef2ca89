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

# Connections served at once. Under the 1,024 file descriptors a default unit gets, with room for the
# collectors' files; node_exporter caps parallel scrapes at 40 (`--web.max-requests`).
MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_ADDRESS = 32

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
    problems: Callable[[], list[str]]  # why the agent is unhealthy, a line each: /-/healthy fails while any are
    dual_stack = False
    connections: dict[str, int]  # open connections by client address
    connections_lock: threading.Lock

    def server_bind(self) -> None:
        if self.dual_stack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, up to `MAX_CONNECTIONS` and `MAX_CONNECTIONS_PER_ADDRESS`: past either a
        connection is closed at once, so slow or idle clients cannot take every thread and file descriptor,
        nor, from one address, the scrapes' turn."""
        source = client_address[0]
        with self.connections_lock:
            mine = self.connections.get(source, 0)
            admitted = mine < MAX_CONNECTIONS_PER_ADDRESS and sum(self.connections.values()) < MAX_CONNECTIONS
            if admitted:
                self.connections[source] = mine + 1
        if not admitted:
            log.warning("too many connections at once (%d from %s); closing one", mine, source)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.connections_lock:
                self.connections[client_address[0]] -= 1
                if not self.connections[client_address[0]]:
                    del self.connections[client_address[0]]

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A failed handshake or a client gone mid-reply is the client's problem, not a traceback on stderr.
        log.debug("request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    raw_requestline: bytes
    server_version = "stallwatch"
    timeout = 10.0  # seconds a client may take for its handshake and request

    def setup(self) -> None:
        tls = self.server.web_config.tls
        if tls is not None:  # here, in the request's thread: loading a certificate never holds the accept loop
            self.request = tls.context().wrap_socket(self.request, server_side=True, do_handshake_on_connect=False)
        super().setup()
        if tls is not None:
            self.request.do_handshake()

    def finish(self) -> None:
        super().finish()
        if self.server.web_config.tls is not None:
            self.request.close()  # the TLS socket made in setup(); the server closes the plain one it accepted

    def parse_request(self) -> bool:
        if len(self.raw_requestline.split()) == 2:  # HTTP/0.9: no headers follow, so none are waited for
            self.request_version, self.close_connection = "HTTP/1.0", True
            self.command, self.requestline = "", self.raw_requestline.decode("latin-1").rstrip("\r\n")
            self.send_error(400, "HTTP/0.9 is not served")
            return False
        if not super().parse_request():
            return False
        if self.command not in ("GET", "HEAD"):  # a method it does not allow, rather than 501 "unsupported"
            self._reply(405, "text/plain; charset=utf-8", b"method not allowed\n", [("Allow", "GET, HEAD")])
            return False
        return True

    def do_GET(self) -> None:
        auth = self.server.web_config.auth
        if auth is not None and not auth.allows(self.headers.get("Authorization"), self.client_address[0]):
            self._reply(401, "text/plain; charset=utf-8", b"unauthorized\n",
                        [("WWW-Authenticate", 'Basic realm="stallwatch"')])
            return
        path, _, query = self.path.partition("?")
        if path == self.server.telemetry_path:
            self._metrics(query)
        elif path == "/":
            page = LANDING_PAGE.format(path=self.server.telemetry_path)
            self._reply(200, "text/html; charset=utf-8", page.encode())
        elif path == "/-/healthy" and (problems := self.server.problems()):
            self._reply(503, "text/plain; charset=utf-8", "".join(f"{line}\n" for line in problems).encode())
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
                   "HTTP_ACCEPT_ENCODING": "gzip" if _accepts_gzip(self.headers.get("Accept-Encoding", "")) else ""}
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


def _accepts_gzip(accept_encoding: str) -> bool:
    """Whether `Accept-Encoding` allows gzip (RFC 9110: `gzip` or `*` with a q-value above 0)."""
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        coding, *parameters = (part.strip() for part in item.split(";"))
        weight = 1.0
        for parameter in parameters:
            name, _, value = parameter.partition("=")
            if name.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        weights[coding.lower()] = weight
    return weights.get("gzip", weights.get("*", 0.0)) > 0


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
        self._server.problems = list
        self._server.connections, self._server.connections_lock = {}, threading.Lock()
        self._thread = threading.Thread(target=self._server.serve_forever, name="stallwatch-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        shown = "localhost" if host in ("0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)
        scheme = "https" if self._server.web_config.tls is not None else "http"
        return f"{scheme}://{shown}:{port}{self._server.telemetry_path}"

    def report_problems(self, problems: Callable[[], list[str]]) -> None:
        """Where /-/healthy learns why the agent is unhealthy (by default it never is)."""
        self._server.problems = problems

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever(), forever if it never ran
            self._server.shutdown()
        self._server.server_close()
