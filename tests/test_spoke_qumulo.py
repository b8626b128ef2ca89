"""spoke_qumulo against local servers that answer like Qumulo's documented metrics endpoint:
bearer-token auth, TLS verified by default, backoff after failures, the token never in logs."""

from __future__ import annotations

import functools
import logging
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from stallwatch.exporters.collector import collected
from stallwatch.exporters.openmetrics_mapping import load_mapping, mapping_text
from stallwatch.exporters.openmetrics_scrape import http_get
from stallwatch.exporters.spoke_qumulo import METRICS_PATH, QumuloSpokeCollector, token_source

DATA = Path(__file__).parent / "data"
TOKEN = "access-v1:s3cr3t-token-value"


class _Qumulo(BaseHTTPRequestHandler):
    requests = 0

    def do_GET(self) -> None:
        type(self).requests += 1
        if self.path != METRICS_PATH:
            body, status = b'{"error_class": "http_not_found"}', 404
        elif self.headers.get("Authorization") != f"Bearer {TOKEN}":
            body, status = b'{"error_class": "http_unauthorized"}', 401
        else:
            body, status = (DATA / "qumulo-metrics.prom").read_bytes(), 200
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(tls: ssl.SSLContext | None = None) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Qumulo)
    httpd.daemon_threads = True
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def cluster() -> Iterator[str]:
    httpd = serve()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def samples(c: QumuloSpokeCollector) -> dict[tuple[str, ...], float]:
    """What a scrape serves of the collector (its error counts too when its source failed)."""
    return {(s.name, *(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
            for family in collected(c, "spoke")[0] for s in family.samples}


def make(url: str, token_file: Path, **kwargs: Any) -> QumuloSpokeCollector:
    return QumuloSpokeCollector(url, token_source(str(token_file), None), "portal-a",
                                load_mapping(*mapping_text("qumulo")), timeout=2, **kwargs)


def test_token_from_file_reaches_the_spoke_metrics(cluster: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    seen = samples(make(cluster, token))
    assert seen[("stallwatch_spoke_cache_size_bytes", "spoke=portal-a")] == 52613349376


def test_token_from_environment(cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUMULO_TOKEN", TOKEN)
    c = QumuloSpokeCollector(cluster, token_source(None, "QUMULO_TOKEN"), "portal-a",
                             load_mapping(*mapping_text("qumulo")))
    assert ("stallwatch_spoke_cache_size_bytes", "spoke=portal-a") in samples(c)


def test_wrong_token_backs_off_and_is_never_logged(
    cluster: str, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    token, now = tmp_path / "token", [100.0]
    token.write_text("access-v1:wrong-secret")
    c = make(cluster, token, clock=lambda: now[0], max_backoff=4)
    caplog.set_level(logging.DEBUG)
    _Qumulo.requests = 0
    for _ in range(3):  # one attempt, then waiting out the 1 s backoff without asking again
        seen = samples(c)
    assert _Qumulo.requests == 1
    assert seen == {("stallwatch_spoke_collector_errors_total", "reason=unauthorized", "spoke=portal-a"): 1}
    for step in (1, 2, 4, 4):  # exponential, capped
        now[0] += step
        samples(c)
    assert _Qumulo.requests == 5
    token.write_text(TOKEN)  # a rotated token is read on the next attempt
    now[0] += 4
    assert ("stallwatch_spoke_cache_size_bytes", "spoke=portal-a") in samples(c)
    assert "wrong-secret" not in caplog.text and "s3cr3t" not in caplog.text


def test_missing_token_file_is_counted(cluster: str, tmp_path: Path) -> None:
    seen = samples(make(cluster, tmp_path / "absent"))
    assert seen == {("stallwatch_spoke_collector_errors_total", "reason=no_token", "spoke=portal-a"): 1}


def test_tls_is_verified_by_default(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    httpd = serve(server_tls)
    url = f"https://127.0.0.1:{httpd.server_address[1]}"
    token = tmp_path / "token"
    token.write_text(TOKEN)
    try:
        untrusted = samples(make(url, token))  # the system's CAs do not know this certificate
        assert untrusted == {("stallwatch_spoke_collector_errors_total", "reason=tls_error", "spoke=portal-a"): 1}
        trusting = functools.partial(http_get, context=ssl.create_default_context(cafile=str(cert)))
        trusted = samples(make(url, token, get=trusting))
        assert trusted[("stallwatch_spoke_cache_size_bytes", "spoke=portal-a")] == 52613349376
    finally:
        httpd.shutdown()
        httpd.server_close()
