"""The agent's HTTP server as a Prometheus exporter's: HEAD, gzip, `name[]`, and IPv6 with IPv4 on `:PORT`."""

from __future__ import annotations

import gzip
import socket
import time
import urllib.parse
from collections.abc import Callable

import psutil
import pytest
import requests

from stallwatch import catalogue
from stallwatch.exporters.web import MAX_CONNECTIONS
from stallwatch.harness import AgentProcess, parse_samples


def raw_exchange(host: str, port: int, request: bytes, family: int = socket.AF_INET) -> tuple[bytes, bytes]:
    """The head and the body of the reply to one request, as sent on the wire (HTTP/1.0: read to the close)."""
    with socket.socket(family, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect((host, port))
        client.sendall(request)
        reply = b""
        while chunk := client.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head, body


def address(agent: AgentProcess) -> tuple[str, int]:
    netloc = urllib.parse.urlsplit(agent.url).netloc
    host, port = netloc.rsplit(":", 1)
    return host, int(port)


def header(head: bytes, name: str) -> str | None:
    for line in head.decode().split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def test_head_is_answered_like_get_without_a_body(agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--no-collector.gpu")
    host, port = address(agent)
    for path in ("/metrics", "/", "/-/healthy", "/-/ready", "/nope"):
        get_head, get_body = raw_exchange(host, port, f"GET {path} HTTP/1.0\r\n\r\n".encode())
        head, body = raw_exchange(host, port, f"HEAD {path} HTTP/1.0\r\n\r\n".encode())
        assert head.split(b"\r\n")[0] == get_head.split(b"\r\n")[0], path  # the same status line
        assert header(head, "Content-Type") == header(get_head, "Content-Type"), path
        assert body == b"" and int(header(head, "Content-Length") or 0) > 0 and get_body, path
    assert requests.head(agent.url, timeout=10).status_code == 200


def test_gzip_when_the_scraper_accepts_it(agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--no-collector.gpu")
    host, port = address(agent)
    request = "GET /metrics HTTP/1.0\r\nAccept-Encoding: {}\r\n\r\n"
    head, body = raw_exchange(host, port, request.format("gzip").encode())
    assert header(head, "Content-Encoding") == "gzip" and int(header(head, "Content-Length") or 0) == len(body)
    page = gzip.decompress(body).decode()
    assert catalogue.BUILD_INFO.name in {name for name, _ in parse_samples(page)}
    print(f"/metrics: {len(page)} bytes, {len(body)} gzipped")
    assert len(body) < len(page) / 3
    for refused in ("identity", "gzip;q=0", "gzip; q=0.0, identity", "*;q=0"):
        head, body = raw_exchange(host, port, request.format(refused).encode())
        assert header(head, "Content-Encoding") is None and catalogue.BUILD_INFO.name in body.decode(), refused
    head, body = raw_exchange(host, port, request.format("br;q=1, *;q=0.5").encode())
    assert header(head, "Content-Encoding") == "gzip"


def test_other_methods_are_not_allowed_and_http_0_9_is_refused_at_once(
        agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--no-collector.gpu")
    host, port = address(agent)
    for method in ("POST", "PUT", "DELETE", "OPTIONS", "BREW"):
        head, _ = raw_exchange(host, port, f"{method} /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n".encode())
        assert head.split(b"\r\n")[0].split(b" ")[1] == b"405" and header(head, "Allow") == "GET, HEAD", method
    started = time.monotonic()
    head, _ = raw_exchange(host, port, b"GET /metrics\r\n")  # HTTP/0.9: it sent no headers and waits
    assert head.startswith(b"HTTP/1.0 400 ") and time.monotonic() - started < 2.0


def test_slow_connections_beyond_the_cap_are_closed_and_scrapes_go_on(
        agent_factory: Callable[..., AgentProcess]) -> None:
    """1,100 connections from 127.0.0.2 that never send a request (the shipped unit's 1,024 descriptors once took
    the agent off the air): past the caps they are closed at once, the agent's threads stay bounded and a scrape
    from another address is answered."""
    agent = agent_factory("--no-collector.gpu")
    host, port = address(agent)
    idle = []
    try:
        for _ in range(1100):
            idle.append(socket.create_connection((host, port), timeout=10, source_address=("127.0.0.2", 0)))
        started = time.monotonic()
        reply = requests.get(agent.url, timeout=10)
        scrape_s = time.monotonic() - started
        threads = psutil.Process(agent.process.pid).num_threads()
    finally:
        for connection in idle:
            connection.close()
    assert reply.status_code == 200 and catalogue.BUILD_INFO.name in reply.text
    assert threads < MAX_CONNECTIONS + 64, threads
    print(f"1,100 idle connections: the agent at {threads} threads, a scrape answered in {scrape_s:.2f} s")


def test_name_filters_the_page(agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--no-collector.gpu")
    wanted = {catalogue.BUILD_INFO.name, catalogue.HOST_CPUS.name}
    reply = requests.get(agent.url, params={"name[]": sorted(wanted)}, timeout=10)
    assert reply.status_code == 200
    assert {name for name, _ in parse_samples(reply.text)} == wanted
    assert len({name for name, _ in parse_samples(requests.get(agent.url, timeout=10).text)}) > len(wanted)


def test_an_empty_host_listens_on_ipv6_and_ipv4(agent_factory: Callable[..., AgentProcess]) -> None:
    if not socket.has_dualstack_ipv6():
        pytest.skip("this kernel has no dual-stack IPv6 sockets")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    agent = agent_factory("--no-collector.gpu", "--web.listen-address", ":0")  # the last flag wins
    _, port = address(agent)
    for host, family in (("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)):
        head, body = raw_exchange(host, port, b"GET /metrics HTTP/1.0\r\n\r\n", family)
        assert head.startswith(b"HTTP/1.0 200") and catalogue.BUILD_INFO.name.encode() in body, host
