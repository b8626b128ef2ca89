"""Security of a real agent process: the event socket's permissions, no network listener but /metrics,
TLS and basic auth through `--web.config.file` with a real TLS client, and the Qumulo token kept out of
logs and metrics. The Helm chart's policy check (no privileged container, no host network, read-only
root filesystem) is in test_helm.py."""

from __future__ import annotations

import base64
import os
import socket
import ssl
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import bcrypt
import psutil
import pytest

from stallwatch.exporters.collector import registered
from stallwatch.exporters.config import build_parser
from stallwatch.harness import AgentProcess
from tests.conftest import ROOT
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
    assert any(c.laddr.endswith("events.sock") for c in unix)


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
])
def test_bad_web_configs_are_one_line_and_exit_2(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "web.yml"
    config.write_text(text)
    result = subprocess.run([sys.executable, "-m", "stallwatch", "agent", "--web.config.file", str(config)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "plaintext-password" not in result.stderr


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
