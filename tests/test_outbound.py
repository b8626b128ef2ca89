"""Every outbound call (hub probe, spoke endpoints, Qumulo, the report's Prometheus) against hostile local
servers: redirects to another host, trickled answers, endless `100 Continue`, huge and malformed bodies."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stallwatch import catalogue as c
from stallwatch.exporters.hub_probe import HubProbeCollector, Target, probe
from stallwatch.exporters.openmetrics_scrape import ScrapeError, http_get
from stallwatch.report.api import Access, Prometheus, PrometheusError
from stallwatch.report.prometheus import run_from_prometheus
from tests.conftest import ROOT
from tests.test_hub_probe import value
from tests.test_spoke_qumulo import make, samples

Answer = Callable[[socket.socket, threading.Event], None]
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


class Server:
    """A raw HTTP server: it records each request's head, then `answer` writes what it likes until `stop`."""

    def __init__(self, answer: Answer, host: str = "127.0.0.1") -> None:
        self.answer, self.stop = answer, threading.Event()
        self.sock = socket.create_server((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.requests: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            head = b""
            while b"\r\n\r\n" not in head:
                more = connection.recv(4096)
                if not more:
                    return
                head += more
            self.requests.append(head)
            with contextlib.suppress(OSError):  # the client hung up
                self.answer(connection, self.stop)

    def close(self) -> None:
        self.stop.set()
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(answer: Answer, host: str = "127.0.0.1") -> Server:
        servers.append(Server(answer, host))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def send(data: bytes) -> Answer:
    return lambda connection, stop: connection.sendall(data)


def ok(body: bytes) -> Answer:
    return send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def trickle(connection: socket.socket, stop: threading.Event) -> None:
    """A valid answer, one byte every 0.2 s: each read waits far less than any timeout, the whole 10 s."""
    for byte in b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok":
        if stop.wait(0.2):
            return
        connection.sendall(bytes([byte]))


def timed(call: Callable[[], str], limit: float) -> tuple[str, float, float]:
    """`call`'s outcome, its wall seconds and the CPU seconds of its thread; a failure if it runs past `limit`."""
    out: list[tuple[str, float, float]] = []

    def run() -> None:
        wall, cpu = time.monotonic(), time.thread_time()
        outcome = call()
        out.append((outcome, time.monotonic() - wall, time.thread_time() - cpu))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert out, f"still running after {limit} s"
    return out[0]


def spoke(url: str, timeout: float) -> str:
    try:
        http_get(url + "/metrics", {"Authorization": "Bearer s3cret"}, timeout)
    except ScrapeError as error:
        return error.reason
    return "ok"


def hub(url: str, timeout: float) -> str:
    failure = probe(Target("s1", url + "/"), "head", timeout, ssl.create_default_context()).failure
    return failure.reason if failure else "ok"


def report(url: str, timeout: float) -> str:
    try:
        Prometheus(url, timeout=timeout).instant("up", 0)
    except PrometheusError as error:
        return str(error)
    return "ok"


@pytest.mark.parametrize("access", ["bearer", "basic"])
def test_the_report_sends_no_credential_to_the_host_a_redirect_names(
        serve: Callable[..., Server], tmp_path: Path, access: str) -> None:
    elsewhere = serve(ok(b'{"status": "success", "data": {"result": []}}'), "127.0.0.2")
    redirect = f"HTTP/1.1 302 Found\r\nLocation: {elsewhere.url}/api/v1/query\r\nContent-Length: 0\r\n\r\n"
    prometheus = serve(send(redirect.encode()))
    (tmp_path / "secret").write_text("s3cret\n")
    credentials = (Access(bearer_token_file=tmp_path / "secret") if access == "bearer"
                   else Access(basic_auth_user="me", basic_auth_password_file=tmp_path / "secret"))
    with pytest.raises(PrometheusError, match=f"redirected to {elsewhere.url}/api/v1/query .*give that URL"):
        Prometheus(prometheus.url, credentials).instant("up", 0)
    assert b"Authorization: " in prometheus.requests[0]  # its own host got them
    assert elsewhere.requests == []


def test_spoke_endpoints_and_qumulo_count_a_redirect_and_send_no_token_on(
        serve: Callable[..., Server], tmp_path: Path) -> None:
    elsewhere = serve(send(OK), "127.0.0.2")
    portal = serve(send(f"HTTP/1.1 301 Moved\r\nLocation: {elsewhere.url}/\r\nContent-Length: 0\r\n\r\n".encode()))
    assert spoke(portal.url, 2) == "redirect"
    token = tmp_path / "token"
    token.write_text("access-v1:s3cret\n")
    assert samples(make(portal.url, token)) == {
        ("stallwatch_spoke_collector_errors_total", "reason=redirect", "spoke=portal-a"): 1}
    assert len(portal.requests) == 2 and all(b"Bearer" in request for request in portal.requests)
    assert elsewhere.requests == []


def test_a_trickling_hub_fails_by_its_deadline_and_the_others_are_probed_meanwhile(
        serve: Callable[..., Server]) -> None:
    slow, good = serve(trickle), serve(send(OK))
    collector = HubProbeCollector([Target("slow", slow.url + "/"), Target("good", good.url + "/")], timeout=2,
                                  start=False)
    done = threading.Thread(target=collector.probe_all, daemon=True)
    started = time.monotonic()
    done.start()
    while value(collector, c.SPOKE_HUB_PROBE_SUCCESS, spoke="good") is None and time.monotonic() - started < 5:
        time.sleep(0.01)
    assert time.monotonic() - started < 1.5, "the good hub waited on the slow one"
    done.join(5)
    assert not done.is_alive() and time.monotonic() - started < 3  # the 2 s deadline, not the 10 s trickle
    assert value(collector, c.SPOKE_HUB_PROBE_SUCCESS, spoke="slow") == 0
    assert value(collector, c.SPOKE_HUB_PROBE_FAILURES, spoke="slow", reason="timeout") == 1
    assert value(collector, c.SPOKE_HUB_PROBE_SUCCESS, spoke="good") == 1


@pytest.mark.parametrize(("call", "failure"), [(spoke, "timeout"), (hub, "timeout"),
                                                (report, "did not answer within 1 s")])
def test_a_trickled_answer_ends_at_the_deadline(serve: Callable[..., Server], call: Callable[[str, float], str],
                                                failure: str) -> None:
    outcome, wall, _ = timed(lambda: call(serve(trickle).url, 1.0), 5)
    assert failure in outcome and 1.0 <= wall < 2


def continues(pause: float) -> Answer:
    def answer(connection: socket.socket, stop: threading.Event) -> None:
        while not stop.wait(pause):
            connection.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" * (1 if pause else 100))

    return answer


@pytest.mark.parametrize(("call", "failure"), [(spoke, "protocol"), (hub, "protocol"), (report, "broken answer")])
def test_endless_100_continue_is_a_protocol_error_at_once(serve: Callable[..., Server],
                                                          call: Callable[[str, float], str], failure: str) -> None:
    outcome, wall, cpu = timed(lambda: call(serve(continues(0)).url, 5.0), 5)
    assert failure in outcome and wall < 2 and cpu < 1


@pytest.mark.parametrize(("call", "failure"), [(spoke, "timeout"), (hub, "timeout"), (report, "did not answer")])
def test_slow_endless_100_continue_ends_at_the_deadline_without_spinning(
        serve: Callable[..., Server], call: Callable[[str, float], str], failure: str) -> None:
    outcome, wall, cpu = timed(lambda: call(serve(continues(0.005)).url, 1.0), 5)
    assert failure in outcome and 1.0 <= wall < 2 and cpu < 0.3 * wall


def test_a_hub_that_redirects_is_not_a_successful_probe(serve: Callable[..., Server]) -> None:
    moved = serve(send(b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.2/\r\nContent-Length: 0\r\n\r\n"))
    collector = HubProbeCollector([Target("s1", moved.url + "/")], timeout=2, start=False)
    collector.probe_all()
    assert value(collector, c.SPOKE_HUB_PROBE_SUCCESS, spoke="s1") == 0
    assert value(collector, c.SPOKE_HUB_PROBE_FAILURES, spoke="s1", reason="status") == 1
    assert value(collector, c.SPOKE_HUB_PROBE_DURATION, spoke="s1", phase="http") is not None  # it did answer


def endless(status: bytes) -> Answer:
    """An answer of `status` whose body, undeclared in length, runs on at 1 MiB a write for 600 MiB."""
    def answer(connection: socket.socket, stop: threading.Event) -> None:
        connection.sendall(b"HTTP/1.1 " + status + b"\r\nConnection: close\r\n\r\n")
        chunk = b" " * (1 << 20)
        for _ in range(600):
            if stop.is_set():
                return
            connection.sendall(chunk)

    return answer


# The peak of this process's own memory: VmHWM, since getrusage's maxrss also keeps what the forking process
# held (the test runner's, hundreds of MiB late in a full run).
PEAK_RSS = """
import sys
from pathlib import Path
from stallwatch.report.api import Prometheus, PrometheusError
try:
    Prometheus(sys.argv[1]).instant("up", 0)
except PrometheusError as error:
    print(error)
status = Path("/proc/self/status").read_text()
print(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) >> 10)
"""


def test_a_huge_answer_is_refused_at_the_limit_in_bounded_memory(serve: Callable[..., Server]) -> None:
    huge = serve(endless(b"200 OK"))
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, huge.url], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    message, peak_mib = done.stdout.splitlines()
    assert "answered more than 256 MiB: narrow the report" in message, done.stderr
    assert 256 < int(peak_mib) < 420  # the 256 MiB answer and the interpreter, not the 600 MiB sent


def test_a_declared_huge_answer_is_refused_before_reading_it(serve: Callable[..., Server]) -> None:
    declared = serve(send(b"HTTP/1.1 200 OK\r\nContent-Length: 629145600\r\n\r\n{"))
    outcome, wall, _ = timed(lambda: report(declared.url, 5), 5)
    assert "answered more than 256 MiB" in outcome and wall < 1


def test_an_error_body_is_read_a_few_kib_at_most(serve: Callable[..., Server]) -> None:
    outcome, wall, _ = timed(lambda: report(serve(endless(b"500 Oops")).url, 5), 5)
    assert outcome.startswith("Prometheus at http://127.0.0.1:") and ": HTTP 500 Oops" in outcome
    assert wall < 1 and "\n" not in outcome and len(outcome) < 400


@pytest.mark.parametrize(("body", "message"), [
    (b"[]", "not an API answer"),
    (b'{"status": "success"}', "not an API answer"),
    (b'{"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {}, "values": []}]}}',
     "another shape than the API's"),
    (b'{"status": "success", "data": {"resultType": "matrix", "result": [{"metric": {}, "values": [[1]]}]}}',
     "another shape than the API's"),
    (b'{"status": "success", "data": {"result": [{"metric": {}}]}}', "another shape than the API's"),
])
def test_an_answer_of_another_shape_is_one_line(serve: Callable[..., Server], body: bytes, message: str) -> None:
    with pytest.raises(PrometheusError, match=message) as raised:
        run_from_prometheus(serve(ok(body)).url, 0, 600)
    assert "\n" not in str(raised.value)


def test_an_instant_of_another_shape_and_a_cut_answer_are_one_line(serve: Callable[..., Server]) -> None:
    empty = json.dumps({"status": "success", "data": {"result": [{"metric": {}, "value": []}]}}).encode()
    shapeless = serve(ok(empty))
    with pytest.raises(PrometheusError, match="another shape than the API's"):
        Prometheus(shapeless.url).instant("up", 0)
    cut = serve(send(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"status": "success", "da'))
    with pytest.raises(PrometheusError, match="a broken answer: IncompleteRead"):
        Prometheus(cut.url).instant("up", 0)
