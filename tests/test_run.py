"""`stallwatch run -- python train.py`: a script that never imports stallwatch has its DataLoaders instrumented
and the reads its dataset makes through NumPy, torch, PIL and `open()` captured, in fork- and spawn-started
loader workers and in the main process; a real agent counts the reads and books the stall to reading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from stallwatch import catalogue as c
from stallwatch.client import capture, wire
from stallwatch.client.keys import read_key
from stallwatch.harness import AgentProcess, scrape, total, wait_for
from tests.conftest import ROOT
from tests.test_client_open import Datagrams
from tests.test_live_stalls import stalls

# What a user writes: no stallwatch anywhere. Samples of four kinds, read by the libraries that read them.
TRAIN = '''
import json, os, sys, time
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

KINDS = ("npy", "pt", "png", "txt")


class Samples(Dataset):
    def __init__(self, folder, items):
        self.folder, self.items = folder, items

    def __len__(self):
        return self.items

    def __getitem__(self, index):
        kind = KINDS[index % 4]
        path = os.path.join(self.folder, f"{index % 8}.{kind}")
        if kind == "npy":
            return float(np.load(path)[0])
        if kind == "pt":
            return float(torch.load(path)[0])
        if kind == "png":
            with Image.open(path) as image:
                return float(np.asarray(image)[0, 0])
        with open(path, encoding="utf-8") as f:
            return float(len(f.read()))


if __name__ == "__main__":
    folder, items, workers, context, train_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(
        sys.argv[5])
    loader = DataLoader(Samples(folder, items), batch_size=4, num_workers=workers,
                        multiprocessing_context=context or None)
    batches, deadline = 0, time.monotonic() + train_s
    while True:
        for batch in loader:
            batches += 1
        if time.monotonic() >= deadline:
            break
    print(json.dumps({"batches": batches, "loader": type(loader).__name__, "open": open.__module__,
                      "imported": sorted(name for name in sys.modules if name.startswith("stallwatch"))}))
'''


def samples(folder: Path, scale: int = 1) -> dict[str, int]:
    """Eight sample files, two of each kind; their sizes by path. `scale` makes the arrays bigger."""
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(8):
        kind = ("npy", "pt", "png", "txt")[index % 4]
        path = folder / f"{index}.{kind}"
        if kind == "npy":
            np.save(path, np.arange(5000 * scale))
        elif kind == "pt":
            torch.save(torch.arange(5000 * scale), path)
        elif kind == "png":
            Image.fromarray((np.arange(64 * 64) % 251).astype(np.uint8).reshape(64, 64)).save(path)
        else:
            path.write_text("\u00e9" * 3000, encoding="utf-8")
    return {str(path): path.stat().st_size for path in folder.iterdir()}


def run(socket: str, script: Path, *args: str, options: tuple[str, ...] = (), job: str = "run",
        ) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "stallwatch", "run", *options, "--", sys.executable, str(script), *args]
    return subprocess.Popen(command, cwd=script.parent, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, STALLWATCH_SOCKET=socket, STALLWATCH_JOB=job))


def finished(process: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out
    reply: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return reply


@pytest.fixture
def socket() -> str:
    return os.path.join(tempfile.mkdtemp(prefix="sw-"), "events.sock")  # short: sun_path holds 108 bytes


@pytest.fixture
def datagrams(socket: str) -> Iterator[Datagrams]:
    received = Datagrams(socket)
    yield received
    received.close()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


@pytest.mark.parametrize(("workers", "context", "mounted"), [(2, "fork", False), (0, "", True), (2, "spawn", False)])
def test_an_unchanged_script_has_its_steps_and_every_librarys_reads_recorded(
        datagrams: Datagrams, script: Path, tmp_path: Path, workers: int, context: str, mounted: bool) -> None:
    folder = tmp_path / "data"
    sizes = samples(folder)
    options = ("--spoke-mount", str(folder)) if mounted else ()
    reply = finished(run(datagrams_path(datagrams), script, str(folder), "16", str(workers), context, "0",
                         options=options))
    assert reply["batches"] == 4 and reply["loader"] == "InstrumentedDataLoader"
    assert "stallwatch.client.torch" in reply["imported"]
    # With workers, the trainer's own open() is the original: capture is in the workers alone.
    assert reply["open"].startswith("stallwatch") == (workers == 0), reply
    wait_for("the steps and reads", lambda: len(datagrams.rows("steps")) == 4
             and covered(datagrams, sizes) == sizes, 20)
    steps = {step["batch"] for step in datagrams.rows("steps")}
    read_sources = {(d.source.worker, int(row["batch"]), int(row["verdict"])) for d in datagrams.decoded
                    for row in d.reads}
    assert {worker for worker, _, _ in read_sources} == ({0, 1} if workers else {-1})
    assert {batch for _, batch, _ in read_sources} == steps
    assert {verdict for _, _, verdict in read_sources} == {wire.VERDICT_UNKNOWN if mounted else wire.VERDICT_DIRECT}


def datagrams_path(datagrams: Datagrams) -> str:
    name: str = datagrams._socket.getsockname()  # where the client sends
    return name


def covered(datagrams: Datagrams, sizes: dict[str, int]) -> dict[str, int]:
    """Per sample file, how many of its bytes some read event covers (a key names a path and an offset)."""
    places = {read_key(path, offset): (path, offset) for path, size in sizes.items() for offset in range(size)}
    seen: dict[str, set[int]] = defaultdict(set)
    for row in datagrams.rows("reads"):
        path, offset = places.get(row["key"], ("", 0))
        seen[path].update(range(offset, offset + row["bytes"]))
    # torch.load and PIL leave a few bytes of a file unread (a zip's trailing records, the PNG end chunk).
    return {path: size for path, size in sizes.items() if len(seen[path]) >= 0.95 * size}


def test_without_read_capture_the_steps_alone_are_recorded(datagrams: Datagrams, script: Path, tmp_path: Path) -> None:
    samples(tmp_path / "data")
    reply = finished(run(datagrams_path(datagrams), script, str(tmp_path / "data"), "16", "2", "", "0",
                         options=("--no-capture-reads",)))
    assert reply["batches"] == 4
    wait_for("the steps", lambda: len(datagrams.rows("steps")) == 4, 20)
    assert not datagrams.rows("reads")


def test_the_command_is_required_and_one_that_cannot_run_is_one_line() -> None:
    for argv, code, said in ((["run"], 2, "no command to run"), (["run", "--", "/nonexistent/python"], 127,
                                                                   "/nonexistent/python: No such file or directory")):
        process = subprocess.run([sys.executable, "-m", "stallwatch", *argv], capture_output=True, text=True,
                                 cwd=ROOT, check=False)
        assert process.returncode == code and said in process.stderr, process.stderr


def test_the_command_runs_with_the_python_it_would_have_and_its_own_sitecustomize(tmp_path: Path) -> None:
    """A `sitecustomize` the command's environment had still runs; the command's exit status is its own."""
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_RAN = True\n")
    code = ("import builtins, sys; "
            "sys.exit(0 if builtins.SITE_RAN and 'stallwatch.client.bootstrap' in sys.modules else 3)")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "stallwatch", "run", "--", sys.executable, "-c", code], env=env,
                          check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    off = subprocess.run([sys.executable, "-m", "stallwatch", "run", "--", sys.executable, "-c", "exit(5)"],
                         env=dict(env, **{capture.CAPTURE_ENV: "0"}), check=False)
    assert off.returncode == 5


@pytest.mark.slow
def test_a_real_agent_counts_the_captured_reads_and_books_the_stall_to_reading(
        agent_factory: Callable[..., AgentProcess], script: Path, socket: str, tmp_path: Path) -> None:
    """The same job twice under `stallwatch run`, its samples on a spoke's mount, against an agent with a spoke
    collector: with capture off (as before capture existed) no read is counted and none of the stall is booked
    to reading or preprocessing, much of it is `other`; captured, every sample's reads are counted, part of the
    stall is booked to reading (their verdicts from the agent's latency split) and preprocessing, and a smaller
    share of it to `other`."""
    spoke_log = tmp_path / "spoke.log"
    spoke_log.touch()
    agent = agent_factory("--events.socket", socket, "--no-collector.gpu", "--no-collector.host",
                          "--collector.spoke_nginx", "--spoke_nginx.log", str(spoke_log))
    folder = tmp_path / "spoke"
    samples(folder, scale=200)
    batches = {}
    for job, options in (("uncaptured", ("--no-capture-reads",)), ("captured", ())):
        reply = finished(run(socket, script, str(folder), "128", "2", "", "4", job=job,
                             options=("--spoke-mount", str(folder), *options)))
        batches[job] = reply["batches"]
    settled = Settled(lambda: sum(stalls(scrape(agent.url), "captured").values()))
    wait_for("the captured job's stall on /metrics, settled", settled.check, 30)
    metrics = scrape(agent.url)
    reads = {job: total(metrics, c.DATASET_READS.name, training_job=job) for job in batches}
    booked = {job: stalls(metrics, job) for job in batches}
    reading = {job: sum(booked[job][cause] for cause in READ_CAUSES) for job in batches}
    print(f"reads counted {reads}; stall seconds by cause {booked}")
    assert reads["uncaptured"] == 0 and reading["uncaptured"] == 0, booked
    assert reads["captured"] >= 4 * batches["captured"]  # every sample read at least once
    # Unseen, the workers' reads and the work between them were `other`; seen, they are reading and preprocessing.
    # (The files sit in the page cache: reading them is a small part of the stall, handing batches over on two
    # busy cores a large one.)
    stalled = {job: sum(booked[job].values()) for job in batches}
    assert reading["captured"] >= 0.05 * stalled["captured"] > 0, booked
    seen = reading["captured"] + booked["captured"][c.PREPROCESS.name]
    assert seen >= 0.15 * stalled["captured"] and booked["uncaptured"][c.PREPROCESS.name] == 0, booked
    other_share = {job: booked[job][c.OTHER.name] / stalled[job] for job in batches}
    assert other_share["captured"] < other_share["uncaptured"], booked


@pytest.mark.slow
def test_local_reads_on_a_node_with_a_spoke_are_direct_reads(
        agent_factory: Callable[..., AgentProcess], script: Path, socket: str, tmp_path: Path) -> None:
    """Files under no spoke's mount cross no spoke, whatever their latency: booked `direct_read`, never
    `remote_fetch` or `cache_read`, though the node has a spoke."""
    spoke_log = tmp_path / "spoke.log"
    spoke_log.touch()
    agent = agent_factory("--events.socket", socket, "--no-collector.gpu", "--no-collector.host",
                          "--collector.spoke_nginx", "--spoke_nginx.log", str(spoke_log))
    samples(tmp_path / "data", scale=200)
    finished(run(socket, script, str(tmp_path / "data"), "128", "2", "", "2", job="local"))
    settled = Settled(lambda: sum(stalls(scrape(agent.url), "local").values()))
    wait_for("the job's stall on /metrics, settled", settled.check, 30)
    metrics = scrape(agent.url)
    booked = stalls(metrics, "local")
    assert total(metrics, c.DATASET_READS.name, training_job="local", verdict="direct") > 0
    assert booked[c.DIRECT_READ.name] > 0 and booked[c.REMOTE_FETCH.name] == booked[c.CACHE_READ.name] == 0, booked


READ_CAUSES = (c.REMOTE_FETCH.name, c.CACHE_READ.name, c.DIRECT_READ.name)


class Settled:
    """A check that holds once a value has stayed the same, and above zero, for SETTLED_S."""

    SETTLED_S = 2.0

    def __init__(self, value: Callable[[], float]) -> None:
        self._value = value
        self._last: tuple[float, float] | None = None  # (value, since)

    def check(self) -> bool:
        value, now = self._value(), time.monotonic()
        if self._last is None or self._last[0] != value:
            self._last = (value, now)
        return value > 0 and now - self._last[1] >= self.SETTLED_S
