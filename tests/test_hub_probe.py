"""The hub probe against real local HTTP(S) servers: phases timed, failures told apart, the rate bounded."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
from prometheus_client.core import Metric

from stallwatch import catalogue as c
from stallwatch.eventbatch import discard
from stallwatch.exporters import agent  # noqa: F401  (registers every collector)
from stallwatch.exporters.collector import CollectorContext, registered
from stallwatch.exporters.config import ConfigError, parse
from stallwatch.exporters.hub_probe import HubProbeCollector, Target, parse_target
from stallwatch.harness import AgentProcess, wait_for
from tests.test_security import self_signed

DELAY = 0.2  # the hub's think time before it answers


class Hub(ThreadingHTTPServer):
    """A hub that answers HEAD and ranged GET after DELAY, with `status`, and records what it was asked."""

    def __init__(self, status: int = 200, refuse_head: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.daemon_threads = True
        self.status, self.refuse_head = status, refuse_head
        self.requests: list[tuple[str, str, str | None]] = []
        self.in_flight = self.most_in_flight = 0
        self.counting = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/data/shard-0?probe=1"


class HubHandler(BaseHTTPRequestHandler):
    server: Hub

    def _answer(self, body: bytes) -> None:
        server = self.server
        with server.counting:
            server.requests.append((self.command, self.path, self.headers.get("Range")))
            server.in_flight += 1
            server.most_in_flight = max(server.most_in_flight, server.in_flight)
        time.sleep(DELAY)
        with server.counting:
            server.in_flight -= 1
        status = 405 if self.command == "HEAD" and self.server.refuse_head else self.server.status
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._answer(b"x" * 1000)

    def do_GET(self) -> None:
        self._answer(b"x")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[Hub]:
    server = Hub()
    yield server
    server.shutdown()
    server.server_close()


def samples(collector: HubProbeCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    families: list[Metric] = list(collector.collect())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def value(collector: HubProbeCollector, metric: c.AnyMetricDef, **labels: str) -> float | None:
    return samples(collector).get((metric.name, tuple(sorted(labels.items()))))


def test_a_head_probe_times_connect_and_http_apart(hub: Hub) -> None:
    collector = HubProbeCollector([Target("s1", hub.url)], start=False)
    assert samples(collector) == {}  # nothing before the first probe
    collector.probe_all()
    connect = value(collector, c.SPOKE_HUB_PROBE_DURATION, spoke="s1", phase="connect")
    answer = value(collector, c.SPOKE_HUB_PROBE_DURATION, spoke="s1", phase="http")
    assert connect is not None and answer is not None
    assert connect < DELAY <= answer  # the handshake does not wait on the hub's think time; the request does
    assert value(collector, c.SPOKE_HUB_PROBE_SUCCESS, spoke="s1") == 1
    assert hub.requests == [("HEAD", "/data/shard-0?probe=1", None)]


def test_the_range_method_asks_for_one_byte_where_head_is_refused(tmp_path: Path) -> None:
    hub = Hub(refuse_head=True)
    try:
        head = HubProbeCollector([Target("s1", hub.url)], start=False)
        head.probe_all()
        assert value(head, c.SPOKE_HUB_PROBE_SUCCESS, spoke="s1") == 0
        assert value(head, c.SPOKE_HUB_PROBE_FAILURES, spoke="s1", reason="status") == 1
        assert value(head, c.SPOKE_HUB_PROBE_DURATION, spoke="s1", phase="http") is not None  # latency still known
        ranged = HubProbeCollector([Target("s1", hub.url)], method="range", start=False)
        ranged.probe_all()
        assert value(ranged, c.SPOKE_HUB_PROBE_SUCCESS, spoke="s1") == 1
        assert hub.requests[-1] == ("GET", "/data/shard-0?probe=1", "bytes=0-0")
    finally:
        hub.shutdown()
        hub.server_close()


def test_failures_are_told_apart_and_counted() -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused_port = closed.getsockname()[1]
    closed.close()
    silent = socket.socket()  # accepts connections (the kernel's backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    garbage = socket.socket()  # answers with something that is not HTTP
    garbage.bind(("127.0.0.1", 0))
    garbage.listen(8)

    def babble() -> None:
        connection, _ = garbage.accept()
        connection.recv(1024)
        connection.sendall(b"hello there\r\n\r\n")
        connection.close()

    threading.Thread(target=babble, daemon=True).start()
    broken = Hub(status=503)
    targets = [Target("refused", f"http://127.0.0.1:{refused_port}/"),
               Target("silent", f"http://127.0.0.1:{silent.getsockname()[1]}/"),
               Target("babble", f"http://127.0.0.1:{garbage.getsockname()[1]}/"),
               Target("broken", broken.url),
               Target("nowhere", "http://no-such-hub.invalid/")]
    try:
        collector = HubProbeCollector(targets, timeout=0.5, start=False)
        collector.probe_all()
        failed = [dict(labels) for name, labels in samples(collector) if name == c.SPOKE_HUB_PROBE_FAILURES.name]
        reasons = {labels["spoke"]: labels["reason"] for labels in failed}
        assert reasons == {"refused": "connect", "silent": "timeout", "babble": "protocol", "broken": "status",
                           "nowhere": "connect"}
        assert all(value(collector, c.SPOKE_HUB_PROBE_SUCCESS, spoke=t.spoke) == 0 for t in targets)
        # the silent hub accepted the connection: its round trip is known even though it never answered
        assert value(collector, c.SPOKE_HUB_PROBE_DURATION, spoke="silent", phase="connect") is not None
        assert value(collector, c.SPOKE_HUB_PROBE_DURATION, spoke="refused", phase="connect") is None
        collector.probe_all()
        assert value(collector, c.SPOKE_HUB_PROBE_FAILURES, spoke="refused", reason="connect") == 2
    finally:
        silent.close()
        garbage.close()
        broken.shutdown()
        broken.server_close()


def test_https_hubs_are_verified(tmp_path: Path) -> None:
    key, cert = self_signed(tmp_path, "hub")
    hub = Hub()
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    hub.socket = server_tls.wrap_socket(hub.socket, server_side=True)
    url = hub.url.replace("http://", "https://")
    try:
        trusting = HubProbeCollector([Target("s1", url)], tls=ssl.create_default_context(cafile=str(cert)),
                                     start=False)
        trusting.probe_all()
        assert value(trusting, c.SPOKE_HUB_PROBE_SUCCESS, spoke="s1") == 1
        strict = HubProbeCollector([Target("s1", url)], timeout=2, start=False)  # the system CAs only
        strict.probe_all()
        assert value(strict, c.SPOKE_HUB_PROBE_FAILURES, spoke="s1", reason="tls") == 1
    finally:
        hub.shutdown()
        hub.server_close()


def test_the_background_probe_is_bounded_in_rate(hub: Hub) -> None:
    # The clock's readings at the start and the end of each round: 0.3 s, then 1.5 s (over the interval),
    # then 0.1 s. Each pause moves the clock on by what it was asked to wait; the third one stops the probe.
    rounds = iter([(0.0, 0.3), (1.5, 2.5), (2.5, 2.6)])
    readings: list[float] = []
    pauses: list[float] = []
    stopped = threading.Event()

    def clock() -> float:
        if not readings:
            readings.extend(next(rounds))
        return readings.pop(0)

    def pause(seconds: float) -> bool:
        pauses.append(seconds)
        if len(pauses) == 3:
            stopped.set()
        return stopped.is_set()

    collector = HubProbeCollector([Target("s1", hub.url), Target("s2", hub.url)], interval=1.0, clock=clock,
                                  pause=pause)
    assert stopped.wait(30), "three rounds did not end"
    collector.close()
    # a round waits out the rest of its interval; one that overran it is followed at once, never overlapped
    assert pauses == pytest.approx([0.7, 0.0, 0.9])
    assert len(hub.requests) == 3 * 2 and hub.most_in_flight == 2  # side by side, never two rounds
    assert value(collector, c.SPOKE_HUB_PROBE_SUCCESS, spoke="s2") == 1


def test_flags_targets_and_the_rate_floor(tmp_path: Path) -> None:
    options = parse(["--collector.hub_probe", "--hub_probe.target", "s1=https://hub.example:8443/healthz",
                     "--hub_probe.interval", "30"], registered())
    assert options.hub_probe_target == [Target("s1", "https://hub.example:8443/healthz")]
    collector = registered()["hub_probe"].factory(CollectorContext(options=options, sink=discard))
    collector.close()
    config = tmp_path / "agent.yaml"
    config.write_text("collector.hub_probe: true\nhub_probe.target: [a=http://hub-a/, b=http://hub-b/]\n")
    from_file = parse(["--config.file", str(config)], registered())
    assert [t.spoke for t in from_file.hub_probe_target] == ["a", "b"]
    for bad, message in ((["--hub_probe.interval", "0.1"], "must be >= 1"),
                         (["--hub_probe.target", "s1=ftp://hub/"], "expected SPOKE=http"),
                         (["--hub_probe.target", "http://hub/"], "expected SPOKE=http")):
        with pytest.raises(ConfigError, match=message):
            parse(bad, registered())
    with pytest.raises(ConfigError, match="required"):
        registered()["hub_probe"].factory(CollectorContext(options=parse([], registered()), sink=discard))
    assert parse_target("s=http://[::1]:8080/").parts.port == 8080


def test_the_agent_serves_the_probe_of_a_real_hub(agent_factory: Callable[..., AgentProcess], hub: Hub) -> None:
    running = agent_factory("--collector.hub_probe", "--hub_probe.target", f"s1={hub.url}", "--hub_probe.interval", "1")
    probed = f'{c.SPOKE_HUB_PROBE_SUCCESS.name}{{spoke="s1"}} 1.0'
    wait_for("a successful probe", lambda: probed in requests.get(running.url, timeout=10).text, 20)
    body = requests.get(running.url, timeout=10).text
    assert f'{c.SPOKE_HUB_PROBE_DURATION.name}{{phase="connect",spoke="s1"}}' in body
    assert 'stallwatch_scrape_collector_success{collector="hub_probe"} 1.0' in body
