"""Remote read capture (`stallwatch.client.remote`), tested with the libraries a user has against real servers:
requests through a real nginx spoke, boto3 and s3fs against moto's S3 server on loopback whose bodies come a
hub's distance after their headers, webdataset shards over HTTP in a DataLoader with workers, and an unchanged
script under `stallwatch run --spoke-url` whose reads a real agent counts and books. Each read is an event with
its key, bytes, start and end (the body's time in it) and verdict, read as it was without capture."""

from __future__ import annotations

import io
import os
import socket
import ssl
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import fsspec
import pytest
import requests
import s3fs
import webdataset as wds
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from torch.utils.data import DataLoader
from werkzeug.serving import make_server

from stallwatch import catalogue as c
from stallwatch.client import capture, reads, remote, transport, wire
from stallwatch.client.keys import read_key
from stallwatch.client.torch import instrument
from stallwatch.demo import hub as demo_hub
from stallwatch.demo.spoke import spoke_server_block
from stallwatch.harness import AgentProcess, free_port, scrape, total, wait_for
from tests.realspoke import Hub, Nginx
from tests.test_client_open import Datagrams
from tests.test_live_stalls import stalls
from tests.test_run import Settled, finished, run
from tests.test_security import self_signed

SOURCE = wire.Source("remote", rank=0, worker=3)
BODY_DELAY = 0.25  # seconds between an object's headers and its body: the hub's distance, as moto is on loopback
OBJECT = bytes(range(256)) * 300  # 75 KiB: several of requests' 10 KiB body reads


@pytest.fixture
def datagrams(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Datagrams]:
    path = str(tmp_path_factory.mktemp("events") / "events.sock")  # short: a socket's path has 107 bytes at most
    received = Datagrams(path)
    transport.configure(path)
    yield received
    transport.sender().close()
    received.close()


@pytest.fixture
def spoke(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A real nginx caching a hub of three shards: (spoke URL, hub URL)."""
    hub_root = tmp_path / "hub"
    hub_root.mkdir()
    (hub_root / "object.bin").write_bytes(OBJECT)
    for index in range(2):
        (hub_root / f"shard-{index}.tar").write_bytes(shard(index))
    hub = Hub(hub_root)
    nginx = Nginx(tmp_path / "nginx", spoke_server_block(f"http://127.0.0.1:{hub.port}"))
    try:
        yield nginx.url(), f"http://127.0.0.1:{hub.port}"
    finally:
        nginx.close()
        hub.close()


class _BodyAfterHeaders:
    """WSGI middleware: a GET's body `BODY_DELAY` after its headers, as from a bucket far away."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = self.app(environ, start_response)
        if environ["REQUEST_METHOD"] != "GET" or "/slow" not in environ["PATH_INFO"]:
            return body
        chunks = list(body)
        return self._late(chunks)

    @staticmethod
    def _late(chunks: list[bytes]) -> Iterator[bytes]:
        yield b""  # werkzeug sends the headers with the first chunk
        time.sleep(BODY_DELAY)
        yield from chunks


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """moto's S3 server on loopback, holding bucket `data` with `slow/object.bin` (readable by anyone, so over
    plain HTTP too): its endpoint URL."""
    server = make_server("127.0.0.1", 0, _BodyAfterHeaders(DomainDispatcherApplication(create_backend_app)),
                         threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    client(endpoint).create_bucket(Bucket="data")
    client(endpoint).put_object(Bucket="data", Key="slow/object.bin", Body=OBJECT, ACL="public-read")  # for plain HTTP
    yield endpoint
    server.shutdown()
    server.server_close()


def client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                        aws_secret_access_key="test")


def events(datagrams: Datagrams, count: int) -> list[dict[str, int]]:
    transport.sender().flush_all()
    wait_for(f"{count} reads", lambda: len(datagrams.rows("reads")) >= count, 10)
    return datagrams.rows("reads")


def shard(index: int) -> bytes:
    """A webdataset tar shard of four samples, each a `.txt` naming it."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for sample in range(4):
            text = f"shard {index} sample {sample}".encode()
            member = tarfile.TarInfo(f"{index:02d}{sample:02d}.txt")
            member.size = len(text)
            tar.addfile(member, io.BytesIO(text))
    return data.getvalue()


def started(spokes: str = "") -> None:
    assert capture.start({remote.SPOKE_URLS_ENV: spokes})


def test_requests_through_the_spoke_reads_with_its_verdict_others_direct(spoke: tuple[str, str],
                                                                         datagrams: Datagrams) -> None:
    spoke_url, hub_url = spoke
    started(spoke_url)
    try:
        with reads.reads_as(SOURCE):
            reads.set_batch(4)
            fetched = [requests.get(url, timeout=10).content for url in
                       (f"{spoke_url}/object.bin", f"{spoke_url}/object.bin", f"{hub_url}/object.bin")]
    finally:
        capture.stop()
    assert fetched == [OBJECT] * 3
    body_reads = {read_key("/object.bin", offset) for offset in range(0, len(OBJECT), 10240)}
    # The hub in this process reads its file through open(), captured too: only the replies' reads here.
    rows = [row for row in events(datagrams, 3) if row["key"] in body_reads]
    assert {(row["batch"], row["end_ns"] >= row["start_ns"]) for row in rows} == {(4, True)}
    replies: list[list[dict[str, int]]] = []  # each reply's body reads, the first at offset 0
    for row in rows:
        if row["key"] == read_key("/object.bin", 0):
            replies.append([])
        replies[-1].append(row)
    assert [{row["verdict"] for row in reply} for reply in replies] == [
        {wire.VERDICT_MISS}, {wire.VERDICT_HIT}, {wire.VERDICT_DIRECT}]
    for reply in replies:  # requests reads a body 10 KiB at a time: one event each, at its offset
        offsets = [sum(row["bytes"] for row in reply[:index]) for index in range(len(reply))]
        assert [row["key"] for row in reply] == [read_key("/object.bin", offset) for offset in offsets]
        assert sum(row["bytes"] for row in reply) == len(OBJECT)


def test_boto3_reads_the_body_of_get_object_in_one_event_that_includes_it(s3: str, datagrams: Datagrams) -> None:
    s3_client = client(s3)
    started()
    try:
        with reads.reads_as(SOURCE):
            sent = time.monotonic_ns()
            body = s3_client.get_object(Bucket="data", Key="slow/object.bin")["Body"]
            headers = time.monotonic_ns()
            data = body.read()
            ranged = s3_client.get_object(Bucket="data", Key="slow/object.bin", Range="bytes=1000-1999")["Body"]
            part = ranged.read()
    finally:
        capture.stop()
    assert (data, part) == (OBJECT, OBJECT[1000:2000])
    assert headers - sent < BODY_DELAY * 1e9  # what a span ending at the headers would see
    row, ranged_row = events(datagrams, 2)
    assert [(r["key"], r["bytes"], r["verdict"]) for r in (row, ranged_row)] == [
        (read_key("/data/slow/object.bin", 0), len(OBJECT), wire.VERDICT_DIRECT),  # path-style on an IP endpoint
        (read_key("/data/slow/object.bin", 1000), 1000, wire.VERDICT_DIRECT)]
    assert sent <= row["start_ns"] < headers and row["end_ns"] - row["start_ns"] >= BODY_DELAY * 1e9


def test_s3fs_reads_through_the_spoke_include_the_body(s3: str, datagrams: Datagrams) -> None:
    fs = s3fs.S3FileSystem(endpoint_url=s3, key="test", secret="test", skip_instance_cache=True,
                           client_kwargs={"region_name": "us-east-1"})
    started(s3)  # the endpoint as a spoke: a read through it with no verdict of its own is the agent's to judge
    try:
        with reads.reads_as(SOURCE), fs.open("data/slow/object.bin", "rb") as file:
            head = file.read(1000)
            rest = file.read()
    finally:
        capture.stop()
    assert head + rest == OBJECT
    rows = events(datagrams, 2)
    assert [(row["key"], row["bytes"], row["verdict"]) for row in rows] == [
        (read_key("s3://data/slow/object.bin", offset), size, wire.VERDICT_UNKNOWN)
        for offset, size in ((0, 1000), (1000, len(OBJECT) - 1000))]
    assert rows[0]["end_ns"] - rows[0]["start_ns"] >= BODY_DELAY * 1e9  # the first read fetched the object


def test_webdataset_shards_over_http_are_read_in_the_workers_for_their_batches(
        spoke: tuple[str, str], datagrams: Datagrams, monkeypatch: pytest.MonkeyPatch) -> None:
    spoke_url, _ = spoke
    monkeypatch.setenv(remote.SPOKE_URLS_ENV, spoke_url)  # as `stallwatch run --spoke-url` sets it
    urls = [f"{spoke_url}/shard-{index}.tar" for index in range(2)]
    dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).to_tuple("txt")
    loader = instrument(DataLoader(dataset, batch_size=2, num_workers=2), job="remote", rank=0)
    capture.stop()  # as a trainer that has run no loader without workers (which captures in this process)
    served = [text for batch in loader for text in batch[0]]  # each worker starts capture itself
    assert sorted(served) == sorted(f"shard {i} sample {s}".encode() for i in range(2) for s in range(4))
    assert not capture.installed()  # the trainer's own reads stay as they were

    def of(worker: int) -> list[dict[str, int]]:
        return [{name: int(row[name]) for name in ("key", "bytes", "batch", "verdict")}
                for d in datagrams.decoded if d.source.worker == worker for row in d.reads]

    wait_for("each shard's bytes", lambda: [sum(row["bytes"] for row in of(w)) for w in range(2)] ==
             [len(shard(w)) for w in range(2)], 10)
    # webdataset gives worker w the shard w; the worker builds the epoch's batch w, then w + 2, from it. Batch
    # numbers count on over the process's whole run, whichever loader served it: this one's start at `first`.
    first = min(row["batch"] for worker in range(2) for row in of(worker))
    for worker in range(2):
        rows = of(worker)
        assert rows[0]["key"] == read_key(f"/shard-{worker}.tar", 0) and rows[0]["batch"] == first + worker
        assert {row["verdict"] for row in rows} == {wire.VERDICT_UNKNOWN}
        assert {row["batch"] for row in rows} <= {first + worker, first + worker + 2}


def test_bytes_read_are_the_same_with_and_without_capture(spoke: tuple[str, str], s3: str,
                                                          datagrams: Datagrams) -> None:
    spoke_url, _ = spoke
    fs = s3fs.S3FileSystem(endpoint_url=s3, key="test", secret="test", skip_instance_cache=True)

    def read_all() -> list[bytes]:
        stream = requests.get(f"{spoke_url}/object.bin", stream=True, timeout=10)
        with fs.open("data/slow/object.bin", "rb", block_size=5000) as file:
            return [b"".join(stream.iter_content(3000)), client(s3).get_object(Bucket="data",
                    Key="slow/object.bin", Range="bytes=10-99")["Body"].read(), file.read(7000), file.read(),
                    bytes(stream.raw.read(10))]

    plain = read_all()
    started(spoke_url)
    try:
        with reads.reads_as(SOURCE):
            captured = read_all()
    finally:
        capture.stop()
    assert captured == plain == [OBJECT, OBJECT[10:100], OBJECT[:7000], OBJECT[7000:], b""]
    expected = {read_key("/object.bin", 0), read_key("/data/slow/object.bin", 10),
                read_key("s3://data/slow/object.bin", 0), read_key("s3://data/slow/object.bin", 7000)}
    transport.sender().flush_all()
    wait_for("a read of each library", lambda: expected <= {row["key"] for row in datagrams.rows("reads")}, 10)


def test_recording_that_fails_never_reaches_the_reader(spoke: tuple[str, str], s3: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spoke_url, _ = spoke

    calls: list[object] = []

    def broken(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        raise RuntimeError("recording broke")

    started(spoke_url)
    transport.configure(str(tmp_path / "no-agent" / "events.sock"))  # nowhere to send
    monkeypatch.setattr(remote, "range_start", broken)
    monkeypatch.setattr(remote, "normal_url", broken)
    try:
        with reads.reads_as(SOURCE):
            fs = s3fs.S3FileSystem(endpoint_url=s3, key="test", secret="test", skip_instance_cache=True)
            assert requests.get(f"{spoke_url}/object.bin", timeout=10).content == OBJECT
            assert client(s3).get_object(Bucket="data", Key="slow/object.bin")["Body"].read() == OBJECT
            with fs.open("data/slow/object.bin", "rb") as file:
                assert file.read() == OBJECT
            with pytest.raises(requests.ConnectionError):  # the library's own errors still reach the caller
                requests.get("http://127.0.0.1:1/nothing", timeout=10)
    finally:
        capture.stop()
        transport.sender().close()
    assert len(calls) >= 3  # each library's reply or file was being followed when recording broke


def test_libraries_imported_later_are_captured_once_imported_and_put_back_by_stop() -> None:
    import urllib3

    read = urllib3.response.HTTPResponse.read
    started()
    try:
        assert urllib3.response.HTTPResponse.read is not read
    finally:
        capture.stop()
    assert urllib3.response.HTTPResponse.read is read
    assert not any(type(finder).__name__ == "_AfterImport" for finder in __import__("sys").meta_path)


def test_a_reply_urllib3_reads_on_arrival_is_one_read(spoke: tuple[str, str], datagrams: Datagrams) -> None:
    import urllib3

    spoke_url, _ = spoke
    started(spoke_url)
    try:
        with reads.reads_as(SOURCE):
            data = urllib3.request("GET", f"{spoke_url}/object.bin").data  # preload_content: read in getresponse
    finally:
        capture.stop()
    assert data == OBJECT
    transport.sender().flush_all()
    wait_for("the reply's read", lambda: any(row["key"] == read_key("/object.bin") for row in datagrams.rows("reads")),
             10)
    rows = [row for row in datagrams.rows("reads") if row["verdict"] != wire.VERDICT_DIRECT]  # not the hub's file
    assert [(row["key"], row["bytes"], row["verdict"]) for row in rows] == [
        (read_key("/object.bin"), len(OBJECT), wire.VERDICT_MISS)]


def test_an_error_reply_is_one_failed_fetch_with_no_bytes(tmp_path: Path, datagrams: Datagrams) -> None:
    """The hub gone, nginx answers 502 at once: requests' GET (its body read 10 KiB at a time) and urllib3's (read on
    arrival) are each one read of no bytes, a failed fetch (the correlator books its worker's back-off to the hub),
    from the request to the reply, and the error page counts no bytes."""
    import urllib3

    hub_root = tmp_path / "hub"
    hub_root.mkdir()
    hub = Hub(hub_root)
    nginx = Nginx(tmp_path / "nginx", spoke_server_block(f"http://127.0.0.1:{hub.port}"))
    hub.close()
    started(nginx.url())
    try:
        with reads.reads_as(SOURCE):
            sent = time.monotonic_ns()
            statuses = [requests.get(f"{nginx.url()}/object.bin", timeout=10).status_code,
                        urllib3.request("GET", f"{nginx.url()}/object.bin").status]
            answered = time.monotonic_ns()
    finally:
        capture.stop()
        nginx.close()
    assert statuses == [502, 502]
    transport.sender().flush_all()
    wait_for("the failed fetches", lambda: len(datagrams.rows("reads")) >= 2, 10)
    time.sleep(0.2)
    rows = datagrams.rows("reads")
    assert [(row["key"], row["bytes"]) for row in rows] == [(read_key("/object.bin"), 0)] * 2
    assert all(sent <= row["start_ns"] <= row["end_ns"] <= answered for row in rows)


class _HeadersThenSilence(BaseHTTPRequestHandler):
    """A reply's headers, then nothing for 2 s: a hub that went away mid-body."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(OBJECT)))
        self.end_headers()
        self.wfile.flush()
        time.sleep(2.0)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_body_read_that_times_out_is_one_failed_fetch_and_raises_as_it_would(datagrams: Datagrams) -> None:
    """requests' read timeout fires in the body's first read: that read is one event of no bytes, from the request
    to the timeout, and requests raises as without capture."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HeadersThenSilence)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/far/object.bin"
    raised = []
    try:
        for captured in (False, True):
            if captured:
                started()
            try:
                with reads.reads_as(SOURCE):
                    sent = time.monotonic_ns()
                    with pytest.raises(requests.ConnectionError) as error:
                        requests.get(url, timeout=(2, 0.3))  # the body is read in get()
                    failed = time.monotonic_ns()
                raised.append(type(error.value))
            finally:
                capture.stop()
    finally:
        server.shutdown()
        server.server_close()
    assert raised[0] is raised[1]
    transport.sender().flush_all()
    wait_for("the failed read", lambda: len(datagrams.rows("reads")) >= 1, 10)
    time.sleep(0.2)
    rows = datagrams.rows("reads")
    assert [(row["key"], row["bytes"]) for row in rows] == [(read_key("/far/object.bin"), 0)]
    assert sent <= rows[0]["start_ns"] and rows[0]["end_ns"] - rows[0]["start_ns"] >= 0.3e9
    assert rows[0]["end_ns"] <= failed


class _SilentForAWhile(BaseHTTPRequestHandler):
    """Takes a request and answers nothing for 2 s: a hub gone quiet before its reply's headers."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        time.sleep(2.0)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_request_with_no_reply_is_an_open_read_while_it_waits_then_one_failed_fetch(datagrams: Datagrams) -> None:
    """A GET waiting for its reply's headers is its thread's open read from when it was sent (what the client
    reports in flight: a quiet hub is a read under way, not the worker's own work); one that gets no reply, a
    timeout waiting for the headers or a refused connection, is one failed fetch of no bytes, and raises as
    without capture. Nothing of it stays open after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SilentForAWhile)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    quiet, refused = f"http://127.0.0.1:{server.server_port}/quiet.bin", f"http://127.0.0.1:{free_port()}/gone.bin"
    raised: list[list[type[requests.RequestException]]] = []
    seen_open: list[dict[int, tuple[str, int, int]]] = []
    try:
        for captured in (False, True):
            if captured:
                started(f"http://127.0.0.1:{server.server_port}")
            errors: list[type[requests.RequestException]] = []
            try:
                with reads.reads_as(SOURCE):
                    waiting = threading.Timer(0.2, lambda: seen_open.append(dict(reads.context.reading)))
                    waiting.start()
                    sent = time.monotonic_ns()
                    for url, timeout in ((quiet, (2.0, 0.5)), (refused, 2.0)):
                        with pytest.raises(requests.RequestException) as error:
                            requests.get(url, timeout=timeout)
                        errors.append(type(error.value))
                    failed = time.monotonic_ns()
                    waiting.join()
            finally:
                capture.stop()
            raised.append(errors)
    finally:
        server.shutdown()
        server.server_close()
    assert raised[0] == raised[1]
    assert seen_open[0] == {}  # without capture nothing is known in flight
    (location, offset, since), = seen_open[1].values()
    assert (location, offset) == (remote.normal_url(quiet), 0) and sent <= since < failed
    assert reads.context.reading == {}
    rows = events(datagrams, 2)
    assert [(row["key"], row["bytes"], row["verdict"]) for row in rows] == [
        (read_key("/quiet.bin"), 0, wire.VERDICT_UNKNOWN), (read_key("/gone.bin"), 0, wire.VERDICT_DIRECT)]
    assert rows[0]["start_ns"] == since and rows[0]["end_ns"] - rows[0]["start_ns"] >= 0.5e9
    assert rows[1]["end_ns"] <= failed


def test_a_request_whose_reply_is_never_asked_for_leaves_nothing_open(spoke: tuple[str, str],
                                                                       datagrams: Datagrams) -> None:
    """urllib3 may send a GET and not ask for its reply (a read timeout of 0): the thread's next GET is its open
    read then, and once answered nothing stays open, so later reads of the thread are recorded as their own."""
    import urllib3

    spoke_url, _ = spoke
    host, port = spoke_url.removeprefix("http://").split(":")
    started(spoke_url)
    try:
        with reads.reads_as(SOURCE):
            urllib3.connection.HTTPConnection(host, int(port)).request("GET", "/object.bin")  # never answered
            second = urllib3.connection.HTTPConnection(host, int(port))
            second.request("GET", "/object.bin", preload_content=False)
            assert [location for location, _, _ in reads.context.reading.values()] == [f"{spoke_url}/object.bin"]
            reply = second.getresponse()
            assert reply.read() == OBJECT and reads.context.reading == {}
    finally:
        capture.stop()
    # The hub in this process reads its file through open(), captured too: only the reply's reads here.
    def replies() -> list[int]:
        return [row["bytes"] for row in datagrams.rows("reads") if row["key"] == read_key("/object.bin")]
    transport.sender().flush_all()
    wait_for("the reply's read", lambda: bool(replies()), 10)
    time.sleep(0.2)
    assert replies() == [len(OBJECT)]


class _SlowHandshake(ThreadingHTTPServer):
    """An HTTPS server whose TLS handshake starts `HANDSHAKE_S` after it accepts: a far hub's connect."""

    daemon_threads = True

    def __init__(self, certificate: tuple[Path, Path]) -> None:
        super().__init__(("127.0.0.1", 0), _Objects)
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.tls.load_cert_chain(str(certificate[1]), str(certificate[0]))

    def get_request(self) -> tuple[Any, Any]:
        connection, address = self.socket.accept()
        time.sleep(HANDSHAKE_S)
        return self.tls.wrap_socket(connection, server_side=True), address


class _Objects(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(OBJECT)))
        self.end_headers()
        self.wfile.write(OBJECT)

    def log_message(self, format: str, *args: Any) -> None:
        pass


HANDSHAKE_S = 0.3


def test_an_https_gets_read_includes_its_connect_and_a_connect_that_fails_is_a_failed_fetch(
        tmp_path: Path, datagrams: Datagrams) -> None:
    """An HTTPS connection connects and shakes hands before its request is sent: the GET's read starts there (a
    far hub's handshake is part of fetching from it), and while the connect hangs its thread has that read open.
    A connect that gets no handshake in time (an address that accepts and answers nothing) is one failed fetch of
    no bytes, raising as without capture."""
    certificate = self_signed(tmp_path, "hub")
    server = _SlowHandshake(certificate)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never shakes hands
    silent_at = f"https://127.0.0.1:{silent.getsockname()[1]}/"
    good, dead = f"https://127.0.0.1:{server.server_port}/far/object.bin", f"{silent_at}far/object.bin"
    seen_open: list[list[tuple[str, int, int]]] = []
    try:
        started()
        with reads.reads_as(SOURCE):
            watch = threading.Timer(0.1, lambda: seen_open.append(list(reads.context.reading.values())))
            watch.start()
            sent = time.monotonic_ns()
            assert requests.get(good, timeout=10, verify=str(certificate[1])).content == OBJECT
            watch.join()
            with pytest.raises(requests.Timeout):  # urllib3 calls a handshake that times out a read timeout
                requests.get(dead, timeout=(0.5, 5), verify=str(certificate[1]))
            failed = time.monotonic_ns()
    finally:
        capture.stop()
        server.shutdown()
        server.server_close()
        silent.close()
    assert [[(location, offset) for location, offset, _ in reading] for reading in seen_open] == [
        [(f"https://127.0.0.1:{server.server_port}/", 0)]]  # in the handshake: the server's, from the connect
    transport.sender().flush_all()
    wait_for("the failed connect", lambda: any(row["bytes"] == 0 for row in datagrams.rows("reads")), 10)
    time.sleep(0.2)
    *body, dead_row = datagrams.rows("reads")  # requests reads a body 10 KiB at a time: one event each
    assert body[0]["key"] == read_key("/far/object.bin") and sum(row["bytes"] for row in body) == len(OBJECT)
    assert body[0]["start_ns"] == seen_open[0][0][2] and body[0]["end_ns"] - body[0]["start_ns"] >= HANDSHAKE_S * 1e9
    assert (dead_row["key"], dead_row["bytes"]) == (read_key(silent_at), 0)
    assert sent <= dead_row["start_ns"] and dead_row["end_ns"] - dead_row["start_ns"] >= 0.5e9
    assert dead_row["end_ns"] <= failed


class _ChunkedCDN(BaseHTTPRequestHandler):
    """Three chunks of `OBJECT`, `BODY_DELAY` apart after the headers, as a CDN's edge (`X-Cache`) streams them."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Cache", "Hit from cloudfront")
        self.end_headers()
        for part in (OBJECT[:25600], OBJECT[25600:51200], OBJECT[51200:]):
            time.sleep(BODY_DELAY / 3)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_chunked_reply_is_read_chunk_by_chunk_with_the_verdict_of_its_x_cache(datagrams: Datagrams) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChunkedCDN)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    started()
    try:
        with reads.reads_as(SOURCE):
            sent = time.monotonic_ns()
            data = requests.get(f"http://127.0.0.1:{server.server_port}/edge/object.bin", timeout=10).content
    finally:
        capture.stop()
        server.shutdown()
        server.server_close()
    assert data == OBJECT
    transport.sender().flush_all()
    wait_for("the chunks", lambda: sum(row["bytes"] for row in datagrams.rows("reads")) == len(OBJECT), 10)
    rows = datagrams.rows("reads")
    offsets = [sum(row["bytes"] for row in rows[:index]) for index in range(len(rows))]
    assert [row["key"] for row in rows] == [read_key("/edge/object.bin", offset) for offset in offsets]
    assert {row["verdict"] for row in rows} == {wire.VERDICT_HIT}
    # The first read waited for the headers and the first chunk; together the reads span the whole body.
    assert rows[0]["start_ns"] - sent < BODY_DELAY / 3 * 1e9 and rows[-1]["end_ns"] - sent >= BODY_DELAY * 1e9


# What a user writes: no stallwatch anywhere; each sample is fetched with requests.
TRAIN = """
import json, sys
import requests
from torch.utils.data import DataLoader, Dataset


class Remote(Dataset):
    def __init__(self, base, items):
        self.base, self.items = base, items

    def __len__(self):
        return self.items

    def __getitem__(self, index):
        return len(requests.get(f"{self.base}/sample-{index % 8}.bin", timeout=30).content)


if __name__ == "__main__":
    loader = DataLoader(Remote(sys.argv[1], int(sys.argv[2])), batch_size=4, num_workers=2)
    print(json.dumps({"batches": sum(1 for _ in loader)}))
"""


def test_a_real_agent_books_an_unchanged_scripts_http_reads_by_the_spokes_verdicts(
        agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> None:
    """`stallwatch run --spoke-url` over a script whose Dataset fetches its samples with requests, through a real
    nginx in front of the demo's hub (a round trip of 100 ms): the agent counts a miss for each of the eight
    samples' first fetch and a hit for every other, and books stall to remote_fetch."""
    root = tmp_path / "hub"
    root.mkdir()
    for index in range(8):
        (root / f"sample-{index}.bin").write_bytes(os.urandom(8192))
    far = demo_hub.Hub(root, rtt_seconds=0.1).start()
    nginx = Nginx(tmp_path / "nginx", spoke_server_block(far.url))
    socket = os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")  # short: sun_path holds 108 bytes
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    try:
        agent = agent_factory("--events.socket", socket, "--no-collector.gpu", "--no-collector.host")
        reply = finished(run(socket, script, nginx.url(), "32", job="http", options=("--spoke-url", nginx.url())))
        settled = Settled(lambda: sum(stalls(scrape(agent.url), "http").values()))
        wait_for("the job's stall on /metrics, settled", settled.check, 30)
        metrics = scrape(agent.url)
    finally:
        nginx.close()
        far.close()
    assert reply["batches"] == 8
    counted = {verdict: total(metrics, c.DATASET_READS.name, training_job="http", verdict=verdict)
               for verdict in ("hit", "miss", "unknown", "direct")}
    booked = stalls(metrics, "http")
    print(f"reads counted {counted}; stall seconds by cause {booked}")
    assert counted == {"hit": 24, "miss": 8, "unknown": 0, "direct": 0}
    assert booked[c.REMOTE_FETCH.name] > 0, booked


def test_fsspec_http_files_read_with_a_read_of_their_own_are_captured(s3: str, datagrams: Datagrams) -> None:
    """fsspec's HTTPFile fetches a whole file in its own `read`, before its base's: that read is the event."""
    url = f"{s3}/data/slow/object.bin"  # moto serves ranges, as fsspec's HTTP files need
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    started(s3)
    try:
        with reads.reads_as(SOURCE):
            with fs.open(url, "rb", block_size=4096) as file:
                parts = [file.read(100), file.read()]
            with fs.open(url, "rb", block_size=4096) as whole:
                parts.append(whole.read())  # larger than a block: fetched whole by HTTPFile.read itself
    finally:
        capture.stop()
    assert parts == [OBJECT[:100], OBJECT[100:], OBJECT]
    rows = events(datagrams, 3)
    assert [(row["key"], row["bytes"], row["verdict"]) for row in rows] == [
        (read_key("/data/slow/object.bin", offset), size, wire.VERDICT_UNKNOWN)
        for offset, size in ((0, 100), (100, len(OBJECT) - 100), (0, len(OBJECT)))]
    assert rows[2]["end_ns"] - rows[2]["start_ns"] >= BODY_DELAY * 1e9
