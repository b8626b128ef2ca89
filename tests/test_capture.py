"""Read capture (`stallwatch.client.capture`): files read through `open()` recorded where they are read, the
files themselves unchanged: same bytes, positions and exceptions, pickling and fork as before."""

from __future__ import annotations

import builtins
import contextlib
import copy
import errno
import functools
import inspect
import io
import itertools
import math
import os
import pickle
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.capture_overhead import measure
from stallwatch.client import ReadSpan, capture, keys, reads, transport, wire
from stallwatch.client.keys import read_key
from stallwatch.harness import wait_for
from tests.test_client_open import Datagrams

SOURCE = wire.Source("capture", rank=2, worker=1)


@pytest.fixture(params=["c", "python"])
def hook(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test of capture twice: with the C parts where the client was built with them (`make` builds them
    here: the hook `start()` installs and the raw file's `readinto`), and with Python alone, as a client
    built without a compiler has them."""
    if request.param == "c" and not capture.accelerated():
        pytest.skip("the client was built without its C hook (no C compiler or Python headers)")
    if request.param == "python":
        monkeypatch.setattr(capture, "_speedups", None)
        monkeypatch.setattr(reads, "record_reads_of", reads.record_in_dict)
    return str(request.param)


@pytest.fixture
def capturing(tmp_path: Path, hook: str) -> Iterator[Path]:
    """Capture on, reads bound as a loader worker's; the folder `spoke/` under tmp_path is a spoke's mount."""
    spoke = tmp_path / "spoke"
    spoke.mkdir()
    assert capture.start({capture.SPOKE_MOUNTS_ENV: str(spoke)})
    try:
        with reads.reads_as(SOURCE):
            yield spoke
    finally:
        capture.stop()


@pytest.fixture
def datagrams(tmp_path: Path) -> Iterator[Datagrams]:
    path = str(tmp_path / "events.sock")
    received = Datagrams(path)
    transport.configure(path)
    yield received
    transport.sender().close()
    received.close()


def outcome(action: Callable[[], Any]) -> Any:
    """What an action returns, or the exception it raises, comparable between two files."""
    try:
        result = action()
    except Exception as error:
        return type(error), str(error)
    return bytes(result) if isinstance(result, bytearray | memoryview) else result


def into(read: Callable[[bytearray], Any], size: int) -> Callable[[], Any]:
    def action() -> Any:
        buffer = bytearray(size)
        count = read(buffer)
        return count, bytes(buffer)
    return action


BINARY_ACTIONS: dict[str, Callable[[Any, int, int], Callable[[], Any]]] = {
    "read": lambda f, n, _: lambda: f.read(n),
    "read_all": lambda f, _, __: f.read,
    "read1": lambda f, n, _: lambda: f.read1(n),
    "readinto": lambda f, n, _: into(f.readinto, max(n, 0)),
    "readinto1": lambda f, n, _: into(f.readinto1, max(n, 0)),
    "readline": lambda f, n, _: lambda: f.readline(n),
    "readlines": lambda f, n, _: lambda: f.readlines(n),
    "next": lambda f, _, __: lambda: next(f),
    "lines": lambda f, n, _: lambda: list(itertools.islice(f, n % 4)),
    "peek": lambda f, n, _: lambda: len(f.peek(n)) > 0,
    "seek": lambda f, n, whence: lambda: f.seek(n if whence == os.SEEK_SET else n - 100, whence),
    "tell": lambda f, _, __: f.tell,
    "close": lambda f, _, __: f.close,
}
TEXT_ACTIONS: dict[str, Callable[[Any, int, int], Callable[[], Any]]] = {
    "read": lambda f, n, _: lambda: f.read(n),
    "readline": lambda f, n, _: lambda: f.readline(n),
    "readlines": lambda f, n, _: lambda: f.readlines(n),
    "next": lambda f, _, __: lambda: next(f),
    "lines": lambda f, n, _: lambda: list(itertools.islice(f, n % 4)),
    "rewind": lambda f, _, __: lambda: f.seek(0),
    "seek_end": lambda f, _, __: lambda: f.seek(0, os.SEEK_END),
    "tell": lambda f, _, __: f.tell,
    "close": lambda f, _, __: f.close,
}


def actions(names: dict[str, Any]) -> st.SearchStrategy[list[tuple[str, int, int]]]:
    return st.lists(st.tuples(st.sampled_from(sorted(names)), st.integers(-1, 300), st.sampled_from([0, 1, 2])),
                    max_size=30)


def a_file_io(raw: Any) -> bool:
    """A captured raw file is an io.FileIO named as one: in C a subclass of it until its close."""
    return isinstance(raw, io.FileIO) and (type(raw).__module__, type(raw).__qualname__) == ("_io", "FileIO")


def replay(file: Any, steps: list[tuple[str, int, int]], table: dict[str, Any]) -> list[Any]:
    seen = []
    for name, number, whence in steps:
        seen.append((name, outcome(table[name](file, number, whence))))
        seen.append(("position", outcome(file.tell)))
    return seen


@settings(max_examples=150, deadline=None)
@given(content=st.binary(max_size=1500).map(lambda data: data.replace(b"\x00", b"\n")),
       buffering=st.sampled_from([-1, 16, 4096]), steps=actions(BINARY_ACTIONS))
def test_a_captured_binary_file_reads_exactly_as_the_file(content: bytes, buffering: int,
                                                          steps: list[tuple[str, int, int]]) -> None:
    folder = Path(os.environ.get("TMPDIR", "/tmp"))
    path = folder / f"capture-binary-{os.getpid()}"
    path.write_bytes(content)
    plain = open(path, "rb", buffering=buffering)  # noqa: SIM115  # the actions close it
    capture.start({})
    try:
        with reads.reads_as(SOURCE):  # `open(path, "rb")` is the C hook's own capture, where it has one
            captured: Any = open(str(path), "rb") if buffering == -1 else open(path, "rb", buffering=buffering)  # noqa: SIM115
        assert type(captured) is io.BufferedReader and a_file_io(captured.raw) and reads.recorded(captured.raw)
        assert (captured.mode, captured.name) == (plain.mode, plain.name)
        assert replay(captured, steps, BINARY_ACTIONS) == replay(plain, steps, BINARY_ACTIONS)
    finally:
        capture.stop()
        plain.close()
        path.unlink()


@settings(max_examples=80, deadline=None)
@given(content=st.text(alphabet="ab\u00e9\u4e2d\n\r", max_size=600), newline=st.sampled_from([None, "", "\n", "\r\n"]),
       steps=actions(TEXT_ACTIONS))
def test_a_captured_text_file_decodes_exactly_as_the_file(content: str, newline: str | None,
                                                          steps: list[tuple[str, int, int]]) -> None:
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"capture-text-{os.getpid()}"
    path.write_bytes(content.encode())
    plain = open(path, encoding="utf-8", newline=newline)  # noqa: SIM115
    capture.start({})
    try:
        with reads.reads_as(SOURCE):
            captured = open(path, encoding="utf-8", newline=newline)  # noqa: SIM115
        assert type(captured) is io.TextIOWrapper and type(captured.buffer) is io.BufferedReader
        assert a_file_io(captured.buffer.raw) and reads.recorded(captured.buffer.raw)
        assert (captured.mode, captured.encoding, captured.name) == (plain.mode, plain.encoding, plain.name)
        assert replay(captured, steps, TEXT_ACTIONS) == replay(plain, steps, TEXT_ACTIONS)
    finally:
        capture.stop()
        plain.close()
        path.unlink()


def test_each_read_of_the_file_system_is_an_event_at_its_offset_with_the_workers_batch(
        capturing: Path, datagrams: Datagrams, tmp_path: Path) -> None:
    """An event a read the buffer makes (its refills), none for the reads it serves from memory."""
    local, remote = tmp_path / "local.bin", capturing / "remote.bin"
    for path in (local, remote):
        path.write_bytes(bytes(range(256)) * 4)
    reads.set_batch(7)
    with open(local, "rb", buffering=256) as f:  # a Path, as datasets pass them
        f.read(100)  # the buffer's first 256 bytes
        f.read(100)  # served by the buffer
        f.seek(512)
        assert isinstance(f, io.BufferedReader) and f.readinto(bytearray(24)) == 24  # the buffer refilled from 512
    with open(str(remote), encoding="latin-1") as text:
        text.read()
    reads.set_batch(-1)
    transport.sender().flush_all()
    wait_for("the reads", lambda: len(datagrams.rows("reads")) >= 3, 10)
    events = [(d.source.job, d.source.rank, d.source.worker, row["batch"], row["key"], row["bytes"], row["verdict"])
              for d in datagrams.decoded for row in d.reads]
    expected = [(str(local), 0, 256, wire.VERDICT_DIRECT), (str(local), 512, 256, wire.VERDICT_DIRECT),
                (str(remote), 0, 1024, wire.VERDICT_UNKNOWN)]  # text: the whole file, one read to its end
    assert events == [("capture", 2, 1, 7, read_key(path, offset), size, verdict)
                      for path, offset, size, verdict in expected]


def test_reads_past_several_full_channels_arrive_once_each_in_order(capturing: Path, datagrams: Datagrams,
                                                                    tmp_path: Path) -> None:
    """More reads than a channel holds, three times over, beside flushes of part of them: every one is an event,
    once, in the order read (the records packed back to back in the channel's buffer, flushed from its front)."""
    path = tmp_path / "many.bin"
    content = bytes(range(256)) * (3 * transport.FULL * 8 // 256 + 1)
    path.write_bytes(content)
    reads.set_batch(3)
    with open(path, "rb") as f:
        raw, offsets = f.raw, list(range(0, 3 * transport.FULL * 8 + 8, 8))
        for offset in offsets:
            assert raw.read(8) == content[offset:offset + 8]
            if offset % 2056 == 0:
                transport.sender().flush_all()  # part of a channel, at odd places among the full ones
    reads.set_batch(-1)
    transport.sender().flush_all()
    wait_for("the reads", lambda: len(datagrams.rows("reads")) >= len(offsets), 10)
    assert [row["key"] for row in datagrams.rows("reads")] == [read_key(str(path), offset) for offset in offsets]
    assert {row["bytes"] for row in datagrams.rows("reads")} == {8}


def test_the_c_hooks_own_captures_record_as_capturing_opens(capturing: Path, datagrams: Datagrams,
                                                            tmp_path: Path) -> None:
    """`open(path)` and `open(path, mode)` of an absolute path, which the C hook captures itself, record the
    events the same open written another way records through capturing_open, a spoke's mount or not."""
    files = {tmp_path / "local.bin": wire.VERDICT_DIRECT, capturing / "remote.bin": wire.VERDICT_UNKNOWN}
    seen = 0

    def events(path: Path, *args: Any, **kwargs: Any) -> list[tuple[int, int, int]]:
        nonlocal seen
        with open(str(path), *args, **kwargs) as f:
            f.read(10)
            f.seek(1000)
            f.read()
        transport.sender().flush_all()
        wait_for("the reads", lambda: len(datagrams.rows("reads")) > seen, 10)
        rows = datagrams.rows("reads")[seen:]
        seen += len(rows)
        return [(row["key"], row["bytes"], row["verdict"]) for row in rows]

    # Each form the C hook captures, beside one capturing_open captures (a keyword, a third argument).
    pairs: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("rb",), {"mode": "rb"}), ((), {"mode": "r"}), (("r",), {"mode": "r", "buffering": -1})]
    for path, verdict in files.items():
        path.write_bytes(b"abc\n" * 300)
        for in_c, in_python in pairs:
            recorded = events(path, *in_c)
            assert recorded == events(path, **in_python)
            assert recorded[0] == (read_key(str(path), 0), len(b"abc\n" * 300), verdict)


def test_a_captured_file_nobody_closes_is_closed_when_dropped(capturing: Path, tmp_path: Path) -> None:
    """The recording holds its file weakly: no cycle through the file's dict keeps a dropped file open."""
    path = tmp_path / "item.bin"
    path.write_bytes(b"x" * 64)
    for args in (("rb",), ("rb", -1)):  # the C hook's own capture, capturing_open's
        f: Any = open(str(path), *args)  # noqa: SIM115  # dropped unclosed, as careless code does
        assert reads.recorded(f.raw)
        descriptor, readinto = f.fileno(), f.raw.readinto
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del f
        with pytest.raises(OSError):
            os.fstat(descriptor)
        with pytest.raises(ValueError, match="closed file"):
            readinto(bytearray(8))


def test_a_captured_file_is_an_io_fileio_again_once_closed_however_it_is_closed(capturing: Path, hook: str,
                                                                                  tmp_path: Path) -> None:
    """In C a captured raw file is a subclass of io.FileIO from open() to its close (closed, dropped, or closed
    through its buffer), then an io.FileIO that reads as a closed one does; each type's references are where
    they were (none lost or left behind), and a file closed by io.FileIO.close itself lets its state go when
    it is dropped."""
    path = tmp_path / "item.bin"
    path.write_bytes(b"x" * 64)
    with open(str(path), "rb") as first:
        types = {io.FileIO, type(first.raw)}  # in C, two
    before = [sys.getrefcount(kind) for kind in types]
    for _ in range(200):
        with open(str(path), "rb") as closed:
            raw = closed.raw
            assert reads.recorded(raw) and raw.read(4) == b"xxxx"
        assert type(raw) is io.FileIO and raw.closed
        assert outcome(lambda: raw.read(4)) == (ValueError, "I/O operation on closed file")  # noqa: B023
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            open(str(path), "rb").read(4)  # noqa: SIM115  # dropped unclosed
            open(str(path)).readline()  # noqa: SIM115
        behind = open(str(path), "rb")  # noqa: SIM115
        io.FileIO.close(behind.raw)  # type: ignore[arg-type]  # past the captured type's close: let go when dropped
        recorder = reads.recorder(behind.raw)
        del behind
        if hook == "c":
            assert sys.getrefcount(recorder) == 2  # this name's and the call's
    assert [sys.getrefcount(kind) for kind in types] == before


@pytest.mark.parametrize("seed", range(4))
def test_many_files_open_at_once_each_record_as_themselves_until_closed_in_any_order(capturing: Path, hook: str,
                                                                                   tmp_path: Path, seed: int) -> None:
    """Hundreds of captured files open together (in C, beyond the first size of the table that keeps their reads'
    state), read and closed or dropped in a random order: each reads its own bytes and records as its own path
    at its own position throughout, and a closed file's state is released (in C, nothing held for it)."""
    rng = random.Random(seed)
    paths = [str(tmp_path / f"{index}.bin") for index in range(rng.randrange(100, 300))]
    for index, path in enumerate(paths):
        Path(path).write_bytes(bytes([index % 256]) * 3 + b"end")
    files = {path: open(path, "rb") for path in paths}  # noqa: SIM115
    read = dict.fromkeys(paths, 0)
    for path in rng.sample(paths, len(paths)):
        for open_path in rng.sample(sorted(files), min(len(files), 5)):  # the others, read on
            if read[open_path] < 3:
                assert files[open_path].raw.read(1) == bytes([paths.index(open_path) % 256])  # beneath its buffer
                read[open_path] += 1
            recorder = reads.recorder(files[open_path].raw)
            assert (recorder._path, recorder._position) == (open_path, read[open_path])
        file = files.pop(path)
        recorder = reads.recorder(file.raw)
        if rng.random() < 0.5:
            file.close()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                del file  # dropped unclosed: closed as it goes
        if hook == "c":
            assert sys.getrefcount(recorder) == 2  # this name's and the call's: the closed file's state let go
        del recorder


def test_a_captured_read_is_seen_in_flight_while_it_waits(capturing: Path, tmp_path: Path) -> None:
    """A read that waits (a FIFO whose writer pauses, as a read of a hub that went away) is in the open
    records a flush sends, from its start, until it ends."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    resume = threading.Event()

    def write() -> None:
        with open(fifo, "wb", buffering=0) as writer:
            writer.write(b"a" * 10)
            resume.wait(10)
            writer.write(b"b" * 10)

    writer = threading.Thread(target=write)
    writer.start()
    channel = reads.context.target()
    with open(str(fifo), "rb") as f:  # the C hook's own capture where it has one
        reader = threading.Thread(target=f.read)
        reader.start()
        wait_for("the read in flight", lambda: any(
            record[0] == wire.OPEN_READ for record in reads.context.open_records(channel, time.monotonic_ns())), 10)
        (_, _, key, since, _), = [record for record in reads.context.open_records(channel, time.monotonic_ns())
                                       if record[0] == wire.OPEN_READ]
        assert key == read_key(str(fifo), 0) and since <= time.monotonic_ns()
        resume.set()
        reader.join(10)
        writer.join(10)
    assert not [record for record in reads.context.open_records(channel, time.monotonic_ns())
                if record[0] == wire.OPEN_READ]


@pytest.mark.parametrize(("folder", "url"), [("a:", True), ("b:c::a:", True), ("a:b", False), ("a", False)])
def test_a_path_is_keyed_as_read_key_keys_it_whatever_its_colons(capturing: Path, datagrams: Datagrams,
                                                                 tmp_path: Path, folder: str, url: bool) -> None:
    """A file's path is its resource, unless it holds `://` (keys.resource_of): the C recording leaves
    those to read_key, found past any colons before them."""
    (tmp_path / folder).mkdir()
    name = f"/{tmp_path}/{folder}//item:"  # `//tmp/...`: as a URL, its host `tmp`
    Path(name).write_bytes(b"z" * 64)
    with open(name, "rb") as f:
        f.read(10)  # the buffer's refill: the raw file's readinto
    transport.sender().flush_all()
    wait_for("the read", lambda: len(datagrams.rows("reads")) >= 1, 10)
    assert (keys.resource_of(name) != name) == url
    assert [row["key"] for d in datagrams.decoded for row in d.reads] == [read_key(name, 0)]


def test_a_read_that_finds_the_end_at_once_is_no_event(capturing: Path, datagrams: Datagrams,
                                                       tmp_path: Path) -> None:
    """A read past the buffer reads until the file system has no more: that last, empty read is no event."""
    path = tmp_path / "item.bin"
    path.write_bytes(b"w" * 1000)
    with open(path, "rb", buffering=256) as f:
        assert len(f.read(2000)) == 1000
    transport.sender().flush_all()
    wait_for("the read", lambda: len(datagrams.rows("reads")) >= 1, 10)
    time.sleep(0.3)  # a second event would have come with the first
    assert [(row["key"], row["bytes"]) for row in datagrams.rows("reads")] == [(read_key(str(path), 0), 1000)]


def test_a_read_that_fails_is_an_event_of_no_bytes_and_raises_as_it_would(capturing: Path,
                                                                          datagrams: Datagrams) -> None:
    """A read the file system fails (here its descriptor closed under it; a FUSE spoke's EIO with the hub out) raises
    the same error as without capture and is one event of no bytes at its offset: a failed fetch, whose worker's
    back-off the correlator books to the hub when the file is a spoke's."""
    path = capturing / "shard.bin"
    path.write_bytes(b"s" * 4096)
    errors = []
    for captured in (False, True):
        file = open(path, "rb", buffering=256) if captured else io.BufferedReader(io.FileIO(path), 256)  # noqa: SIM115
        assert file.read(100) == b"s" * 100  # the buffer's first 256 bytes
        os.close(file.fileno())
        with pytest.raises(OSError) as raised:
            file.read(1000)  # the rest of the buffer, then a read of the file system
        errors.append((type(raised.value), raised.value.errno))
        with contextlib.suppress(OSError):
            file.close()
    assert errors[0] == errors[1] == (OSError, errno.EBADF)
    transport.sender().flush_all()
    wait_for("the reads", lambda: len(datagrams.rows("reads")) >= 2, 10)
    time.sleep(0.3)
    assert [(row["key"], row["bytes"]) for row in datagrams.rows("reads")] == [
        (read_key(str(path), 0), 256), (read_key(str(path), 256), 0)]


def test_files_it_skips_are_the_originals_and_record_nothing(capturing: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine.bin"
    mine.write_bytes(b"x" * 10)
    python_file = os.__file__  # the installation: never a dataset
    opened: list[Any] = [open(python_file, "rb"), open("/proc/self/status", "rb"), open(python_file),  # noqa: SIM115
              open(mine, "r+b"), open(mine, "ab"), open(mine, "rb", buffering=0),  # noqa: SIM115
              open(os.open(mine, os.O_RDONLY), "rb")]  # noqa: SIM115  # a descriptor: no path
    with reads.reads_as(SOURCE):
        pass
    try:
        assert [type(f).__name__ for f in opened] == ["BufferedReader", "BufferedReader", "TextIOWrapper",
                                                       "BufferedRandom", "BufferedWriter", "FileIO", "BufferedReader"]
        assert type(opened[2].buffer) is io.BufferedReader
    finally:
        for f in opened:
            f.close()


def test_a_path_skipped_once_is_skipped_again_and_a_relative_one_judged_where_it_is_opened(
        capturing: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Skipped absolute paths are remembered; a relative name means another file once the directory moves."""
    for _ in range(2):
        with open(os.__file__, "rb") as f:
            assert type(f) is io.BufferedReader
    monkeypatch.chdir(os.path.dirname(os.__file__))
    with open("os.py", "rb") as f:
        assert type(f) is io.BufferedReader
    (tmp_path / "os.py").write_bytes(b"data")
    monkeypatch.chdir(tmp_path)
    with open("os.py", "rb") as f:
        assert reads.recorded(f.raw) and f.read() == b"data"


def test_a_process_whose_reads_have_no_source_is_not_captured(tmp_path: Path, hook: str) -> None:
    """The trainer outside a loop without workers: its own files (checkpoints, configs) stay as they are."""
    path = tmp_path / "config.txt"
    path.write_text("x")
    capture.start({})
    try:
        assert not reads.bound()
        with open(path, "rb") as f:
            assert type(f) is io.BufferedReader
    finally:
        capture.stop()


def test_a_read_the_dataset_records_itself_is_one_event(capturing: Path, datagrams: Datagrams,
                                                        tmp_path: Path) -> None:
    path = tmp_path / "item.bin"
    path.write_bytes(b"y" * 300)
    with ReadSpan("https://hub/item", 0) as span:
        span.bytes = len(path.read_bytes())
    transport.sender().flush_all()
    wait_for("the read", lambda: len(datagrams.rows("reads")) >= 1, 10)
    assert [(row["key"], row["bytes"]) for row in datagrams.rows("reads")] == [(read_key("https://hub/item", 0), 300)]


def test_another_threads_open_read_hides_no_read_of_this_one(capturing: Path, datagrams: Datagrams,
                                                             tmp_path: Path) -> None:
    """A dataset reading in a thread pool: a read open in one thread (a `ReadSpan` waiting on its storage)
    is not the outer read of the files another thread reads meanwhile."""
    path = tmp_path / "item.bin"
    path.write_bytes(b"v" * 128)
    span_open, span_may_end = threading.Event(), threading.Event()

    def slow_read() -> None:
        with reads.reads_as(SOURCE), ReadSpan("https://hub/slow", 0) as span:
            span_open.set()
            span_may_end.wait(10)
            span.bytes = 1

    other = threading.Thread(target=slow_read)
    other.start()
    try:
        assert span_open.wait(10)
        with open(path, "rb") as f:
            f.read()
    finally:
        span_may_end.set()
        other.join(10)
    transport.sender().flush_all()
    wait_for("both reads", lambda: len(datagrams.rows("reads")) >= 2, 10)
    assert sorted((row["key"], row["bytes"]) for row in datagrams.rows("reads")) == sorted(
        [(read_key(str(path), 0), 128), (read_key("https://hub/slow", 0), 1)])


def opening(*args: Any, **kwargs: Any) -> Callable[[], Any]:
    return lambda: open(*args, **kwargs)  # expected to fail


def test_opening_fails_and_refuses_to_pickle_as_the_file_does(capturing: Path, tmp_path: Path) -> None:
    path = tmp_path / "item.bin"
    path.write_bytes(b"z")
    failures = [opening(tmp_path / "missing"), opening(path, "r" + "q"), opening(path, "rb", encoding="utf-8"),
                opening(tmp_path, "rb")]
    captured_failures = [outcome(fail) for fail in failures]
    capture.stop()
    assert captured_failures == [outcome(fail) for fail in failures]
    with open(path, "rb") as plain:
        refused = [outcome(lambda: pickle.dumps(plain)), outcome(lambda: copy.copy(plain))]
    capture.start({})
    with open(path, "rb") as captured:
        assert reads.recorded(captured.raw)
        assert [outcome(lambda: pickle.dumps(captured)), outcome(lambda: copy.copy(captured))] == refused
    assert refused[0][0] is TypeError


def test_a_forked_child_reads_on_where_the_parent_was_and_records_as_itself(capturing: Path, datagrams: Datagrams,
                                                                           tmp_path: Path) -> None:
    path = tmp_path / "shared.bin"
    path.write_bytes(bytes(range(200)))
    with open(path, "rb", buffering=16) as f:
        f.read(48)  # a multiple of the buffer: read from the file system, nothing left in the buffer
        transport.sender().flush_all()
        wait_for("the parent's read", lambda: len(datagrams.rows("reads")) == 1, 10)
        child = os.fork()
        if child == 0:
            reads.bind_worker(wire.Source("capture", rank=2, worker=5))
            ok = f.read() == bytes(range(48, 200))
            transport.sender().flush_all()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    wait_for("the child's read", lambda: len(datagrams.rows("reads")) >= 2, 10)
    (child_read,) = [row for d in datagrams.decoded if d.source.worker == 5 for row in d.reads]
    assert (child_read["key"], child_read["bytes"]) == (read_key(str(path), 48), 152)


def test_recording_that_fails_never_reaches_the_reader(capturing: Path, tmp_path: Path) -> None:
    path = tmp_path / "item.bin"
    path.write_bytes(b"w" * 64)
    transport.configure(str(tmp_path / "no-agent" / "events.sock"))  # nowhere to send: events are dropped
    try:
        with open(path, "rb") as f:
            assert [f.read(10), f.read()] == [b"w" * 10, b"w" * 54]
    finally:
        transport.sender().close()


def test_a_read_that_cannot_be_packed_is_counted_as_dropped_and_the_reader_reads_on(
        capturing: Path, datagrams: Datagrams, tmp_path: Path) -> None:
    """The recording packs a read's record as it records it: a batch past 64 bits loses that event, counted
    in the channel's drops, and the next batch's events go as before."""
    path = tmp_path / "item.bin"
    path.write_bytes(b"w" * 64)
    channel = reads.context.target()
    reads.set_batch(2**64)
    try:
        with open(path, "rb") as f:
            assert f.read() == b"w" * 64
    finally:
        reads.set_batch(3)
    assert channel.dropped_total == 1
    with open(path, "rb") as f:
        f.read()
    reads.set_batch(-1)
    transport.sender().flush_all()
    wait_for("the good read", lambda: len(datagrams.rows("reads")) >= 1, 10)
    assert [(row["batch"], row["key"], row["bytes"]) for d in datagrams.decoded for row in d.reads] == [
        (3, read_key(str(path), 0), 64)]
    assert sum(d.dropped for d in datagrams.decoded) == 1


def test_a_file_whose_name_has_no_utf8_is_read_and_its_reads_counted_as_dropped(
        capturing: Path, datagrams: Datagrams, tmp_path: Path) -> None:
    """A name of bytes that are not UTF-8 decodes with surrogates, which have no UTF-8 to hash: each read of the
    file (its path hashed once a file) is counted as dropped, the reader gets its bytes, and a read of another
    file after it is keyed as before."""
    strange = os.fsdecode(os.fsencode(tmp_path) + b"/item\xff.bin")
    good = tmp_path / "item.bin"
    for path in (strange, good):
        Path(path).write_bytes(b"w" * 64)
    channel = reads.context.target()
    reads.set_batch(5)
    with open(strange, "rb", buffering=32) as f:
        assert f.read(32) == b"w" * 32 and f.read(32) == b"w" * 32
    assert channel.dropped_total == 2
    with open(good, "rb", buffering=32) as f:
        f.read(32)
        f.read(32)
    reads.set_batch(-1)
    transport.sender().flush_all()
    wait_for("the good reads", lambda: len(datagrams.rows("reads")) >= 2, 10)
    assert [(row["key"], row["bytes"]) for d in datagrams.decoded for row in d.reads] == [
        (read_key(str(good), 0), 32), (read_key(str(good), 32), 32)]


def test_a_file_records_all_four_of_its_calls_or_none(hook: str, tmp_path: Path) -> None:
    """Putting the recorder's methods on a file fails partway (out of memory): none is left behind, so the file
    reads on as it was, uncaptured, rather than recording some calls and not others. In C the file's type
    changes, all four at once, and only an exact io.FileIO's (what `open()` makes): a subclass is refused."""
    class Failing(io.FileIO):
        def __setattr__(self, name: str, value: Any) -> None:
            if name == "read":  # the third of the four
                raise MemoryError("no room")
            super().__setattr__(name, value)

    path = tmp_path / "item.bin"
    path.write_bytes(b"w" * 64)
    with Failing(path) as raw:
        with pytest.raises(TypeError if hook == "c" else MemoryError):
            reads.record_reads(raw, str(path), wire.VERDICT_DIRECT)
        assert not reads.recorded(raw)
        assert not set(reads.RECORDED_METHODS) & set(vars(raw)) and type(raw) is Failing
        assert raw.read() == b"w" * 64


class _Context:
    __slots__ = ("source",)

    def __init__(self, source: Any) -> None:
        self.source = source


_NOWHERE = os.open(os.devnull, os.O_RDONLY)  # the spies' raw files read it; none of them closes it


class _Opened(tuple):
    """What a spy returns: (its name, args, kwargs), with a raw file beneath as `open()`'s result has."""

    def __init__(self, _: Any) -> None:
        self.raw = io.FileIO(_NOWHERE, closefd=False)
        self.buffer = self


class _Spy:
    """Stands for `original` or `capturing`: returns its name and the arguments it was called with."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> _Opened:
        return _Opened((self.name, args, kwargs))


def c_hook(context: Any, folders: tuple[str, ...], mounts: tuple[str, ...] = ()) -> Any:
    if not capture.accelerated():
        pytest.skip("the client was built without its C hook")
    from stallwatch.client._speedups import OpenHook
    return OpenHook(_Spy("original"), _Spy("capturing"), context, folders, mounts, wire.VERDICT_UNKNOWN,
                    wire.VERDICT_DIRECT)


def decided(opened: _Opened) -> str:
    """Who opened the file, and whether the hook recorded its reads: `original`, `captured` (the original's
    file, recorded) or `capturing` (capturing_open's to decide)."""
    return "captured" if reads.recorded(opened.raw) else opened[0]


NARROW_CHARACTERS = "/ab.\xe9"  # one byte a character (Latin-1)
WIDE_CHARACTERS = NARROW_CHARACTERS + "\u4e2d\U0001f600"


@settings(max_examples=300, deadline=None)
@given(data=st.data(), source=st.sampled_from([None, SOURCE]), mode=st.sampled_from(["rb", "r", "rt", "wb", "r+b"]))
def test_the_c_hook_decides_as_capturing_open(data: st.DataObject, source: Any, mode: str) -> None:
    """The C hook's own rules are capturing_open's: no source, or a str under a skipped folder, the original;
    an absolute str opened for reading, the original's file recorded, a spoke read under a mount; the rest
    capturing_open's. For any mix of one-byte and wider characters in paths and folders."""
    alphabet = data.draw(st.sampled_from([NARROW_CHARACTERS, WIDE_CHARACTERS]))
    folders, mounts = (tuple(data.draw(st.lists(st.text(alphabet, min_size=1, max_size=6), max_size=4)))
                       for _ in range(2))
    names = st.text(WIDE_CHARACTERS, max_size=6)
    path = data.draw(st.one_of(names, st.tuples(st.sampled_from(folders + mounts), names).map("".join))
                     if folders + mounts else names)
    opened = c_hook(_Context(source), folders, mounts)(path, mode)
    if source is None or path.startswith(folders):
        assert decided(opened) == "original"
    elif path.startswith("/") and mode in ("rb", "r", "rt"):
        assert decided(opened) == "captured" and opened == ("original", (path, mode), {})
        recorder = reads.recorder(opened.raw)
        assert (recorder._path, recorder._position) == (path, 0)
        assert recorder._verdict == (wire.VERDICT_UNKNOWN if path.startswith(mounts) else wire.VERDICT_DIRECT)
    else:
        assert decided(opened) == "capturing"


def test_the_c_hook_passes_every_argument_result_and_error_through_unchanged(tmp_path: Path) -> None:
    hook = c_hook(_Context(SOURCE), (str(tmp_path) + os.sep,))
    skipped, other = str(tmp_path / "a.bin"), "/elsewhere/a.bin"
    assert hook(skipped, "rb", -1, None, None, None, True, None) == (
        "original", (skipped, "rb", -1, None, None, None, True, None), {})
    assert hook(other, mode="r", buffering=1) == ("capturing", (other,), {"mode": "r", "buffering": 1})
    assert hook(file=skipped) == ("capturing", (), {"file": skipped})  # no path to test: capture decides
    for path in (Path(skipped), skipped.encode(), type("Sub", (str,), {})(skipped), 3):
        assert hook(path)[0] == "capturing"  # only an exact str is tested here; capturing_open judges the rest
    original = capture.original_open
    real = type(hook)(original, original, _Context(SOURCE), (str(tmp_path) + os.sep,), (), wire.VERDICT_UNKNOWN,
                      wire.VERDICT_DIRECT)
    assert outcome(lambda: real(skipped, "rb")) == outcome(lambda: original(skipped, "rb"))  # FileNotFoundError
    assert outcome(lambda: real(skipped, "rb", bad=1)) == outcome(lambda: original(skipped, "rb", bad=1))


def test_the_c_hook_reads_the_source_slot_and_refuses_while_it_is_unset() -> None:
    context = _Context(SOURCE)
    hook = c_hook(context, ())
    assert decided(hook("/data/a")) == "captured"
    context.source = None
    assert decided(hook("/data/a")) == "original"
    del context.source  # capturing_open's own test would raise, and refuse
    assert decided(hook("/data/a")) == "original"

    class Unslotted:
        source = None

    with pytest.raises(TypeError, match="__slots__"):
        c_hook(Unslotted(), ())
    with pytest.raises(TypeError, match="str"):
        c_hook(_Context(SOURCE), (b"/data/",))  # type: ignore[arg-type]


def test_open_keeps_its_signature_and_pickles_as_itself_under_either_hook(capturing: Path) -> None:
    assert inspect.signature(builtins.open) == inspect.signature(capture.capturing_open)
    assert pickle.loads(pickle.dumps(builtins.open)) is builtins.open  # a dataset holding `open`, sent to a worker
    assert pickle.loads(pickle.dumps(functools.partial(builtins.open, mode="rb"))).func is builtins.open


def test_capture_is_off_when_the_environment_says_so() -> None:
    assert not capture.start({capture.CAPTURE_ENV: "0"})
    assert not capture.installed()


def test_the_cost_benchmark_measures_every_side() -> None:
    """benchmarks/capture_overhead.py, one short round: every figure it prints is measured (the figures
    themselves are the benchmark's to judge, never a test's), and it leaves the process as it found it."""
    figures = measure(rounds=1, open_rounds=2, opens=50)
    assert len(figures) == 15 and all(math.isfinite(value) for value in figures.values()), figures
    assert figures["captured 16 KiB read"] > 0 and figures["recording an event"] > 0
    assert not capture.installed() and not reads.bound()
