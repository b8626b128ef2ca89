"""Security of a real agent process: the event socket's permissions, no network listener but /metrics,
TLS and basic auth through `--web.config.file` with a real TLS client, and the Qumulo token kept out of
logs and metrics. The Helm chart's policy check (no privileged container, no host network, read-only
root filesystem) is in test_helm.py."""

from __future__ import annotations

import base64
import http.client
import itertools
import os
import socket
import ssl
import stat
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import bcrypt
import psutil
import pytest

from stallwatch.exporters import web_config
from stallwatch.exporters.collector import registered
from stallwatch.exporters.config import build_parser
from stallwatch.harness import AgentProcess
from tests.conftest import ROOT, laughs, refused_agent
from tests.test_spoke_qumulo import TOKEN, serve

PASSWORD = "scrape-pass-7"


def get(url: str, context: ssl.SSLContext | None = None, auth: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def self_signed(directory: Path, name: str, ca: tuple[Path, Path] | None = None) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (self-signed, or signed by `ca`), with the openssl CLI."""
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    command = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
               "-days", "1", "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
               "-addext", "subjectAltName=IP:127.0.0.1"]
    if ca is not None:
        command += ["-CA", str(ca[1]), "-CAkey", str(ca[0])]
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    return key, cert


def test_event_socket_is_0660_with_the_group_in_a_0750_directory(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    # A group other than our own: any gid when root, else one we belong to (chown needs no privilege then).
    others = [g for g in os.getgroups() if g != os.getgid()]
    if os.geteuid() != 0 and not others:
        pytest.skip("this user belongs to no second group to hand the socket to")
    group = 4242 if os.geteuid() == 0 else others[0]
    path = tmp_path / "run" / "stallwatch" / "events.sock"
    agent_factory("--no-collector.gpu", "--events.socket", str(path), "--events.socket-group", str(group))
    info, directory = path.stat(), path.parent.stat()
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == group
    assert stat.S_IMODE(directory.st_mode) == 0o750 and directory.st_gid == group
    said = " ".join((ROOT / "docs" / "client.md").read_text().split())
    assert "The socket is created 0660 in a directory made 0750" in said  # the docs say what the agent does
    assert directory.st_uid == info.st_uid == os.getuid()


def test_an_unknown_socket_group_is_a_one_line_error() -> None:
    result = subprocess.run([sys.executable, "-m", "stallwatch", "agent", "--events.socket-group", "no-such-group-x"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "no group named 'no-such-group-x'" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_only_network_listener_is_metrics(agent_factory: Callable[..., AgentProcess]) -> None:
    agent = agent_factory("--gpu.fake-devices", "2")
    port = int(agent.url.rsplit(":", 1)[1].split("/")[0])
    status, _ = get(agent.url)
    assert status == 200
    inet = psutil.Process(agent.process.pid).net_connections(kind="inet")
    listening = [c for c in inet if c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM]
    assert [(c.laddr.ip, c.laddr.port) for c in listening] == [("127.0.0.1", port)]
    unix = psutil.Process(agent.process.pid).net_connections(kind="unix")
    assert any(str(c.laddr).endswith("events.sock") for c in unix)


def test_tls_and_basic_auth_from_a_web_config_file(agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    _, cert = self_signed(tmp_path, "127.0.0.1")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    config = tmp_path / "web.yml"
    config.write_text("tls_server_config:\n  cert_file: 127.0.0.1.crt\n  key_file: 127.0.0.1.key\n"
                      f"  min_version: TLS13\nbasic_auth_users:\n  prometheus: '{hashed}'\n")
    agent = agent_factory("--no-collector.gpu", "--web.config.file", str(config))
    assert agent.url.startswith("https://127.0.0.1:")
    trusting = ssl.create_default_context(cafile=str(cert))
    status, body = get(agent.url, trusting, auth=f"prometheus:{PASSWORD}")
    assert status == 200 and b"stallwatch_build_info" in body
    assert get(agent.url, trusting)[0] == 401
    assert get(agent.url, trusting, auth="prometheus:wrong")[0] == 401
    assert get(agent.url, trusting, auth=f"mallory:{PASSWORD}")[0] == 401
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        get(agent.url, ssl.create_default_context())  # a client that does not trust the certificate
    plain = agent.url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        get(plain)  # plain HTTP on the TLS port gets no metrics
    tls12 = ssl.create_default_context(cafile=str(cert))
    tls12.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((urllib.error.URLError, ssl.SSLError), match="VERSION"):
        get(agent.url, tls12)  # below the configured min_version
    # A client stuck before its handshake does not stop the others from being served.
    with socket.create_connection(("127.0.0.1", int(agent.url.rsplit(":", 1)[1].split("/")[0]))):
        assert get(agent.url, trusting, auth=f"prometheus:{PASSWORD}")[0] == 200
    assert PASSWORD not in agent.stderr() and hashed not in agent.stderr()


def test_a_rotated_certificate_is_served_without_a_restart(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    """As cert-manager renews a Secret: the files are replaced (a new inode), and the next connection gets
    the new certificate. A pair that does not load (a key not matching its certificate, half-way through
    a rotation) is logged once and the certificate before it is served on."""
    issued = {name: self_signed(tmp_path, name) for name in ("first", "second", "third")}

    def install(key_of: str, cert_of: str) -> None:
        for source, target in ((issued[key_of][0], "server.key"), (issued[cert_of][1], "server.crt")):
            staged = tmp_path / f".{target}.new"
            staged.write_bytes(source.read_bytes())
            os.replace(staged, tmp_path / target)

    def served_by(name: str) -> bool:
        try:
            return get(agent.url, ssl.create_default_context(cafile=str(issued[name][1])))[0] == 200
        except (urllib.error.URLError, ssl.SSLError, ConnectionError):
            return False

    install("first", "first")
    config = tmp_path / "web.yml"
    config.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    agent = agent_factory("--no-collector.gpu", "--web.config.file", str(config))
    assert served_by("first") and not served_by("second")
    install("second", "second")
    assert served_by("second") and not served_by("first")
    install("second", "third")  # the certificate is new, its key not yet
    assert served_by("second") and served_by("second")
    assert agent.stderr().count("serving the previous certificate") == 1, agent.stderr()
    install("third", "third")
    assert served_by("third")
    assert agent.process.poll() is None  # the same process all along


def test_client_certificates_are_verified_when_required(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    ca = self_signed(tmp_path, "ca")
    _, server_cert = self_signed(tmp_path, "server", ca)
    client = self_signed(tmp_path, "client", ca)
    stranger = self_signed(tmp_path, "stranger")
    config = tmp_path / "web.yml"
    config.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                      "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.crt\n")
    agent = agent_factory("--no-collector.gpu", "--web.config.file", str(config))

    def context(identity: tuple[Path, Path] | None) -> ssl.SSLContext:
        made = ssl.create_default_context(cafile=str(ca[1]))
        if identity is not None:
            made.load_cert_chain(identity[1], identity[0])
        return made

    assert server_cert.exists() and get(agent.url, context(client))[0] == 200
    for identity in (None, stranger):
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            get(agent.url, context(identity))


@pytest.mark.parametrize(("text", "message"), [
    ("tls_server_config:\n  cert_file: a.crt\n", "cert_file and key_file are both required"),
    ("tls_server_config:\n  cert_file: a.crt\n  key_file: a.key\n", "cannot load cert_file/key_file"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: RequireAnyClientCert\n",
     "is not supported"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  min_version: SSL3\n", "min_version must be one of"),
    ("tls_server_config:\n  certfile: a\n", "unknown key 'certfile'"),
    ("basic_auth_users:\n  prometheus: plaintext-password\n", "is not a bcrypt hash"),
    ("http_server_config:\n  http2: true\n", "unknown key 'http_server_config'"),
    ("- just\n- a list\n", "expected a mapping"),
    (f"basic_auth_users:\n  prometheus: {laughs()}\n", "aliases"),  # 9**9 strings from 400 bytes
    ("basic_auth_users:\n  prometheus: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than"),
])
def test_bad_web_configs_are_one_line_and_exit_2(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "web.yml"
    config.write_text(text)
    ended = refused_agent(["--no-collector.gpu", "--events.socket", str(tmp_path / "e.sock"),
                           "--web.config.file", str(config)])
    assert ended.one_line_error and message in ended.stderr, ended.stderr[-2000:]
    assert len(ended.stderr.strip().splitlines()) == 1 and "plaintext-password" not in ended.stderr
    assert ended.cpu_seconds < 20 and ended.peak_rss_mib < 300


def test_the_qumulo_token_is_never_a_flag_nor_in_logs_or_metrics(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    flags = [opt for action in build_parser(registered())._actions for opt in action.option_strings]
    assert [f for f in flags if "token" in f] == ["--spoke_qumulo.token-file", "--spoke_qumulo.token-env"]
    httpd = serve()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        good, bad = tmp_path / "good", tmp_path / "bad"
        good.write_text(TOKEN)
        bad.write_text("access-v1:wrong-s3cr3t")
        texts = []
        for token_file in (good, bad):
            agent = agent_factory("--no-collector.gpu", "--collector.spoke_qumulo", "--spoke_qumulo.url", url,
                                  "--spoke_qumulo.token-file", str(token_file), "--log.level", "debug")
            for _ in range(2):
                status, body = get(agent.url)
                assert status == 200
                texts.append(body.decode())
            texts.append(agent.stderr())
        assert 'stallwatch_spoke_cache_size_bytes{spoke="qumulo"}' in texts[0]
        assert 'reason="unauthorized"' in texts[3]
        for text in texts:
            assert "s3cr3t" not in text and TOKEN not in text
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_basic_auth_hides_which_users_exist_bounds_guessing_and_answers_non_ascii_with_401(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    agent = agent_factory("--no-collector.gpu", "--web.config.file", str(config))
    host, port = urllib.parse.urlsplit(agent.url).netloc.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic \xc3\xa9t\xe9\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.0 401 ")

    def seconds(auth: str) -> float:
        start = time.perf_counter()
        assert get(agent.url, auth=auth)[0] in (200, 401)
        return time.perf_counter() - start

    unknown = statistics.median(seconds(f"mallory:{PASSWORD}") for _ in range(7))
    wrong = statistics.median(seconds("prometheus:wrong") for _ in range(7))
    assert get(agent.url, auth=f"prometheus:{PASSWORD}")[0] == 200  # from now on a cached success
    idle = statistics.median(seconds(f"prometheus:{PASSWORD}") for _ in range(7))

    stop, process = threading.Event(), psutil.Process(agent.process.pid)

    def guess(thread: int) -> None:
        for attempt in itertools.count():
            if stop.is_set():
                return
            assert get(agent.url, auth=f"prometheus:guess-{thread}-{attempt}")[0] == 401

    guessers = [threading.Thread(target=guess, args=(n,)) for n in range(8)]
    cpu_before, start = sum(process.cpu_times()[:2]), time.monotonic()
    for thread in guessers:
        thread.start()
    time.sleep(0.5)
    under_attack = [seconds(f"prometheus:{PASSWORD}") for _ in range(15)]
    time.sleep(max(0.0, 3 - (time.monotonic() - start)))
    cores = (sum(process.cpu_times()[:2]) - cpu_before) / (time.monotonic() - start)
    stop.set()
    for thread in guessers:
        thread.join(timeout=30)
    print(f"unknown user {unknown * 1e3:.1f} ms, wrong password {wrong * 1e3:.1f} ms; legitimate scrape "
          f"{idle * 1e3:.1f} ms idle, {statistics.median(under_attack) * 1e3:.1f} ms under 8 guessing threads, "
          f"which cost the agent {cores:.2f} cores")
    assert unknown > 0.5 * wrong  # an unknown user costs a bcrypt check too
    assert cores < 0.8  # failed checks: one at a time, and each holds its slot for as long again


def test_guessing_from_one_address_does_not_lock_out_a_correct_password_from_another(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    """bcrypt cost 12; 16 threads guess passwords from 127.0.0.2. Each of five users' correct passwords, checked
    for the first time (not cached) from 127.0.0.1 meanwhile, is let in, and `basic` in lower case is the
    same scheme (RFC 7617)."""
    users = {f"prometheus{n}": f"correct-{n}" for n in range(5)}
    config = tmp_path / "web.yml"
    config.write_text("basic_auth_users:\n" + "".join(
        f"  {user}: '{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=12)).decode()}'\n"
        for user, password in users.items()))
    agent = agent_factory("--no-collector.gpu", "--web.config.file", str(config))
    host, port = urllib.parse.urlsplit(agent.url).netloc.split(":")
    path = urllib.parse.urlsplit(agent.url).path

    def status(auth: str, source: str, scheme: str = "Basic") -> int:
        connection = http.client.HTTPConnection(host, int(port), timeout=30, source_address=(source, 0))
        try:
            connection.request("GET", path, headers={"Authorization": f"{scheme} "
                                                     + base64.b64encode(auth.encode()).decode()})
            return connection.getresponse().status
        finally:
            connection.close()

    stop = threading.Event()

    def guess(thread: int) -> None:
        for attempt in itertools.count():
            if stop.is_set():
                return
            assert status(f"prometheus0:guess-{thread}-{attempt}", "127.0.0.2") == 401

    guessers = [threading.Thread(target=guess, args=(n,)) for n in range(16)]
    for thread in guessers:
        thread.start()
    try:
        time.sleep(1.0)  # the guessers fill the queue
        answers = {user: status(f"{user}:{password}", "127.0.0.1", scheme="basic" if user.endswith("4") else "Basic")
                   for user, password in users.items()}
    finally:
        stop.set()
        for thread in guessers:
            thread.join(timeout=60)
    assert answers == dict.fromkeys(users, 200), answers


def test_the_bcrypt_slot_goes_to_the_check_that_waited_for_it_not_to_a_newcomer() -> None:
    """Released, the slot is the waiting check's: a guesser's next check asking just then does not get it
    (threading's Semaphore gave it to whichever thread ran first). A wait that runs out leaves the line."""
    turns = web_config._Turns()
    assert turns.acquire(1.0)
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(turns.acquire(30.0)))
    waiter.start()
    deadline = time.monotonic() + 30
    while not turns._waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    turns.release()
    assert not turns.acquire(0.0)  # the newcomer
    waiter.join(timeout=30)
    assert waited == [True]
    assert not turns.acquire(0.05)  # still the waiter's
    assert not turns._waiting
    turns.release()
    assert turns.acquire(0.0)


def test_a_certificate_file_that_blocks_on_open_does_not_stop_the_server(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    """A rotation leaves a FIFO (or a hung mount) where the certificate was: opening it blocks. Connections,
    /-/healthy among them, are still answered with the certificate before it, within a second or so."""
    _, cert = self_signed(tmp_path, "127.0.0.1")
    config = tmp_path / "web.yml"
    config.write_text("tls_server_config:\n  cert_file: 127.0.0.1.crt\n  key_file: 127.0.0.1.key\n")
    agent = agent_factory("--no-collector.gpu", "--web.config.file", str(config))
    healthy = agent.url.replace("/metrics", "/-/healthy")
    kept = tmp_path / "kept.crt"
    kept.write_bytes(cert.read_bytes())
    cert.unlink()
    os.mkfifo(cert)
    for _ in range(3):
        started = time.monotonic()
        assert get(healthy, ssl.create_default_context(cafile=str(kept)))[0] == 200
        assert time.monotonic() - started < 3.0
    assert get(agent.url, ssl.create_default_context(cafile=str(kept)))[0] == 200
