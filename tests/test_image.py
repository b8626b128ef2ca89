"""The agent's image: built by `make image`'s script with the real buildah, run, and scraped over HTTP.

No registry is needed: the script builds its Debian base with debootstrap (cached under build/image/)
and installs the package from wheels built here. The first run takes about a minute longer.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest
import yaml

from stallwatch import __version__
from stallwatch.harness import free_port
from tests.conftest import ROOT, require_binary

IMAGE = "localhost/stallwatch:test"
BUILDAH_ENV = dict(os.environ, BUILDAH_ISOLATION="chroot", STORAGE_DRIVER="vfs")


def buildah(*args: str, timeout: float = 120) -> str:
    result = subprocess.run([require_binary("buildah", "buildah"), *args], capture_output=True, text=True,
                            env=BUILDAH_ENV, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_chart_defaults_to_the_image_make_image_builds() -> None:
    chart = yaml.safe_load((ROOT / "helm" / "stallwatch" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "helm" / "stallwatch" / "values.yaml").read_text())
    script = (ROOT / "scripts" / "build-image.sh").read_text()
    [default] = re.findall(r"image=\$\{1:-([^:}]+):\$version\}", script)
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert version is not None
    assert values["image"]["repository"] == default
    assert values["image"]["tag"] in ("", chart["appVersion"])
    assert chart["appVersion"] == version.group(1)


@pytest.fixture(scope="module")
def container() -> Iterator[str]:
    build = subprocess.run([str(ROOT / "scripts" / "build-image.sh"), IMAGE], capture_output=True, text=True,
                           cwd=ROOT, timeout=900)
    assert build.returncode == 0, build.stdout + build.stderr
    name = buildah("from", IMAGE)
    yield name
    buildah("rm", name)


@pytest.mark.slow
def test_the_image_runs_the_agent_as_nobody_without_torch(container: str) -> None:
    assert buildah("run", container, "--", "id", "-u") == "65534"
    probe = ("import importlib.util as u; from stallwatch.correlator import native;"
             "print(*(bool(u.find_spec(m)) for m in ('torch', 'grpc', 'stallwatch')), native.kernels is not None)")
    # the last: the agent's wheel with the correlator's C kernels, the one for the image's Python
    assert buildah("run", container, "--", "python3", "-c", probe) == "False True True True"
    size = buildah("images", "--format", "{{.Size}}", IMAGE)
    print(f"image size: {size}")


@pytest.mark.slow
def test_the_agent_in_the_image_is_scraped_over_http(container: str) -> None:
    port = free_port()
    command = [require_binary("buildah", "buildah"), "run", container, "--", "stallwatch", "agent",
               f"--web.listen-address=127.0.0.1:{port}", "--gpu.fake-devices=2", "--no-collector.events"]
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=BUILDAH_ENV, start_new_session=True)
    try:
        body, deadline = "", time.monotonic() + 60
        while time.monotonic() < deadline and agent.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                    body = reply.read().decode()
                if 'stallwatch_gpu_up{gpu="1"} 1.0' in body:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        exited = agent.stdout is not None and agent.poll() is not None
        assert 'stallwatch_gpu_up{gpu="1"} 1.0' in body, agent.stdout.read() if exited and agent.stdout else body
        revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                                  check=True).stdout.strip()
        # the image names the commit it was built from (stallwatch_build_info shows it abbreviated)
        [shown] = re.findall(rf'stallwatch_build_info{{revision="(\w+)",version="{__version__}"}} 1.0', body)
        assert len(shown) >= 7 and revision.startswith(shown)
        assert 'stallwatch_scrape_collector_success{collector="host"} 1.0' in body
    finally:
        stop_group(agent)


def stop_group(process: subprocess.Popen[str]) -> None:
    """buildah run and the agent under it, started in a session of their own."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
