"""The install commands of the docs, run for real and offline.

`make dist` builds the two distributions; the client's wheels (one for any platform, one with its C parts
for this one) install alone into a fresh virtualenv without a package index (they need
nothing) and send a job's steps and reads to a socket from there; the agent's wheel installs beside the
client and answers `stallwatch --version` with the revision it was built from.
"""

from __future__ import annotations

import fnmatch
import re
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from stallwatch.client.keys import read_key
from stallwatch.exporters.events_decode import decode
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
CLIENT_WHEEL = f"stallwatch_client-{VERSION}-py3-none-any.whl"
# Each distribution's wheel with its C parts, for this interpreter and platform (as setuptools tags it).
PYTHON_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
PLATFORM_TAG = f"{PYTHON_TAG}-{PYTHON_TAG}-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}"
CLIENT_PLATFORM_WHEEL = f"stallwatch_client-{VERSION}-{PLATFORM_TAG}.whl"
AGENT_WHEEL = f"stallwatch-{VERSION}-py3-none-any.whl"
AGENT_PLATFORM_WHEEL = f"stallwatch-{VERSION}-{PLATFORM_TAG}.whl"  # with the correlator's C kernels
# What the agent brings and a training image must not get from the client.
AGENT_ONLY = ("numpy", "streamz", "torch", "prometheus_client", "yaml")
INSTALL_DOCS = sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("docs/*.yaml"), ROOT / "README.md",
                       *ROOT.glob("clients/*/README.md")])
# The arguments of a `pip install`, up to the end of its line, code span, shell string or command.
PIP_INSTALL = re.compile(r"pip install ([^`\n\"&;#]+)")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make dist` into a folder of the test's, with this interpreter; the dev install is taken as done."""
    out = tmp_path_factory.mktemp("dist")
    command = ["make", "--no-print-directory", "-o", ".venv/.installed", "dist", f"PY={sys.executable}",
               f"STAGE={out / 'stage'}", f"DIST={out / 'dist'}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return out / "dist"


def wheel_names(wheel: Path) -> set[str]:
    return {name for name in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in name}


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(archive.read(metadata).decode())
    return [value for value in message.get_all("Requires-Dist") or [] if "extra ==" not in value]


def venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, capture_output=True, timeout=300)
    return where / "bin"


def pip_install(bin_dir: Path, *args: str) -> None:
    done = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-index",
                           "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_make_dist_builds_a_wheel_and_an_sdist_of_each(dist: Path) -> None:
    assert sorted(path.name for path in dist.iterdir()) == sorted(
        [AGENT_WHEEL, AGENT_PLATFORM_WHEEL, f"stallwatch-{VERSION}.tar.gz", CLIENT_WHEEL, CLIENT_PLATFORM_WHEEL,
         f"stallwatch_client-{VERSION}.tar.gz"])


def test_each_module_is_in_exactly_one_wheel_and_the_client_in_its_own(dist: Path) -> None:
    client, agent = wheel_names(dist / CLIENT_WHEEL), wheel_names(dist / AGENT_WHEEL)
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "stallwatch").rglob("*.py")}
    assert {name for name in client | agent if name.endswith(".py")} == modules
    assert not client & agent
    client_modules = {name for name in modules if name.startswith("stallwatch/client/")}
    assert {name for name in client if name.endswith(".py")} == client_modules
    assert client - client_modules <= {"stallwatch/client/py.typed", "stallwatch/client/_speedups.pyi"}
    hook = {name for name in wheel_names(dist / CLIENT_PLATFORM_WHEEL) - client if not name.endswith(".py")}
    assert [Path(name).name.split(".")[0] for name in hook] == ["_speedups"], hook  # the C parts, compiled
    kernels = wheel_names(dist / AGENT_PLATFORM_WHEEL) - agent
    assert [name.split(".")[0] for name in kernels] == ["stallwatch/correlator/_kernels"], kernels
    for member in ("stallwatch/__init__.py", "stallwatch/py.typed", "stallwatch/_revision",
                   "stallwatch/exporters/mappings/juicefs.yaml", "stallwatch/exporters/kubelet/api.proto"):
        assert member in agent, member


def test_the_docs_install_stallwatch_only_from_what_make_dist_builds(dist: Path) -> None:
    built = [path.name for path in dist.iterdir()]
    named = []
    for doc in INSTALL_DOCS:
        for arguments in PIP_INSTALL.findall(doc.read_text()):
            for argument in arguments.split():
                wheel = argument.strip("'").split("[")[0]
                if "stallwatch" in argument and not argument.startswith("-"):
                    named.append(wheel)
                    assert fnmatch.filter(built, Path(wheel).name), f"{doc.name}: pip install {arguments}"
    assert {Path(wheel).name.split("-")[0] for wheel in named} == {"stallwatch", "stallwatch_client"}


def test_the_client_requires_nothing_and_the_agent_the_client_of_its_version(dist: Path) -> None:
    assert requirements(dist / CLIENT_WHEEL) == []
    agent = requirements(dist / AGENT_WHEEL)
    assert f"stallwatch-client=={VERSION}" in agent
    assert not any(requirement.startswith("torch") for requirement in agent)


def test_the_client_wheel_installs_alone_without_an_index_and_brings_nothing_else(dist: Path, tmp_path: Path) -> None:
    bin_dir = venv(tmp_path / "training")
    pip_install(bin_dir, str(dist / CLIENT_WHEEL))  # no --no-deps: a dependency would fail without an index
    probe = "import importlib.util as u, sys; print(*(u.find_spec(m) is not None for m in sys.argv[1:]))"
    found = subprocess.run([str(bin_dir / "python"), "-c", probe, "stallwatch.client", *AGENT_ONLY],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path, check=True).stdout.split()
    assert found == ["True"] + ["False"] * len(AGENT_ONLY)


@pytest.mark.parametrize(("wheel", "parts"), [
    (CLIENT_PLATFORM_WHEEL, ["OpenHook", "stallwatch.client._speedups", "True"]),
    (CLIENT_WHEEL, ["function", "stallwatch.client.reads", "False"])])
def test_read_capture_runs_the_c_parts_from_the_platform_wheel_and_python_from_the_other(
        dist: Path, tmp_path: Path, wheel: str, parts: list[str]) -> None:
    bin_dir = venv(tmp_path / "training")
    pip_install(bin_dir, str(dist / wheel))
    script = ("import builtins, sys\n"
              "from stallwatch.client import capture, reads, wire\n"
              "capture.start({})\n"
              "with reads.reads_as(wire.Source('install-check', rank=0, worker=0)):\n"
              "    with open(sys.argv[1], 'rb') as captured, open(capture.__file__, 'rb') as skipped:\n"
              "        print(type(builtins.open).__name__, type(captured.raw).__name__, type(skipped.raw).__name__,\n"
              "              reads.recorded(captured.raw), reads.recorded(skipped.raw))\n"
              "        recorder = type(reads.recorder(captured.raw))\n"
              "print(recorder.__module__, capture.accelerated())\n")
    shard = tmp_path / "shard.bin"
    shard.write_bytes(b"x" * 64)
    done = subprocess.run([str(bin_dir / "python"), "-c", script, str(shard)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    [hook, captured, skipped, captured_recorded, skipped_recorded, recorder, accelerated] = done.stdout.split()
    assert [hook, recorder, accelerated] == parts
    assert [captured, skipped, captured_recorded, skipped_recorded] == ["FileIO", "FileIO", "True", "False"]


def test_the_client_alone_sends_a_jobs_steps_and_reads(dist: Path, tmp_path: Path) -> None:
    bin_dir = venv(tmp_path / "training")
    pip_install(bin_dir, str(dist / CLIENT_WHEEL))
    shard = tmp_path / "shard-0001.bin"
    shard.write_bytes(b"x" * 4096)
    script = ("import sys\n"
              "from stallwatch.client import monitor, open_recorded\n"
              "for _ in monitor(range(5)):\n"
              "    with open_recorded(sys.argv[1]) as f:\n"
              "        f.read()\n")
    path = tmp_path / "events.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
        agent.bind(str(path))
        env = {"STALLWATCH_SOCKET": str(path), "STALLWATCH_JOB": "install-check", "PATH": "/usr/bin:/bin"}
        done = subprocess.run([str(bin_dir / "python"), "-c", script, str(shard)], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
        agent.settimeout(0.5)  # the client flushed before it exited: what it sent is queued here
        batches = []
        with pytest.raises(TimeoutError):
            while True:
                batches.append(decode(agent.recv(1 << 20), time.monotonic_ns(), time.time_ns()))
    assert {batch.source.job for batch in batches} == {"install-check"}
    assert sum(len(batch.steps) for batch in batches) == 5
    keys = [int(key) for batch in batches for key in batch.reads["key"]]
    assert keys == [read_key(str(shard))] * 5


@pytest.mark.parametrize(("wheel", "kernels"), [(AGENT_PLATFORM_WHEEL, "True"), (AGENT_WHEEL, "False")])
def test_the_agent_wheel_beside_the_client_runs_with_its_revision(dist: Path, tmp_path: Path, wheel: str,
                                                                  kernels: str) -> None:
    bin_dir = venv(tmp_path / "agent")
    # The agent's dependencies are this interpreter's (no index here): on the path after the venv's own.
    pip_install(bin_dir, "--no-deps", str(dist / CLIENT_WHEEL), str(dist / wheel))
    purelib = subprocess.run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {"PATH": "/usr/bin:/bin"}
    version = subprocess.run([str(bin_dir / "stallwatch"), "--version"], capture_output=True, text=True, timeout=120,
                             cwd=tmp_path, env=env)
    assert version.returncode == 0, version.stderr
    # The commit `make dist` was run at, which others' commits may have followed since.
    built_from = zipfile.ZipFile(dist / wheel).read("stallwatch/_revision").decode().strip()
    assert subprocess.run(["git", "merge-base", "--is-ancestor", built_from, "HEAD"], cwd=ROOT).returncode == 0
    assert version.stdout.startswith(f"stallwatch, version {VERSION} (revision: {built_from[:12]},")
    probe = ("import stallwatch as s, stallwatch.client as c, stallwatch.exporters.agent as a;"
             "from stallwatch.correlator import native;"
             "print(s.__file__, c.__file__, a.__file__, native.kernels is not None)")
    where = subprocess.run([str(bin_dir / "python"), "-c", probe], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path, env=env)
    assert where.returncode == 0, where.stderr
    *paths, with_kernels = where.stdout.split()
    assert all(path.startswith(purelib) for path in paths)
    assert with_kernels == kernels  # the platform wheel's correlator runs its C kernels, the other NumPy
