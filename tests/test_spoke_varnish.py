"""spoke_varnish against a real varnishd (Debian varnish, run in the foreground by the test) in front of
a real hub, and its parser on broken input."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from stallwatch.exporters.collector import collected
from stallwatch.exporters.spoke_varnish import VarnishSpokeCollector, counter_values
from stallwatch.harness import find_binary, wait_for
from tests.realspoke import Hub, free_port, get

VARNISHD = find_binary("varnishd") or "/usr/sbin/varnishd"
needs_varnish = pytest.mark.skipif(not Path(VARNISHD).exists() or not find_binary("varnishstat"),
                                   reason="varnish not installed")


def samples(c: VarnishSpokeCollector) -> dict[tuple[str, ...], float]:
    """What a scrape serves of the collector (its error counts too when its source failed)."""
    return {(s.name, *(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
            for family in collected(c, "spoke")[0] for s in family.samples}


def listens(port: int) -> bool:
    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()  # raises until it does
    return True


@pytest.fixture
def varnish(tmp_path: Path) -> Iterator[tuple[str, int, Hub]]:
    files = tmp_path / "hub"
    files.mkdir()
    for name in ("a", "b", "c"):
        (files / name).write_bytes(name.encode() * 100)
    hub, port, workdir = Hub(files), free_port(), tmp_path / "varnish"
    # -j none: no privilege-separation jail, so the test runs the same as root or as a user.
    process = subprocess.Popen([VARNISHD, "-F", "-j", "none", "-n", str(workdir), "-a", f"127.0.0.1:{port}",
                                "-b", f"127.0.0.1:{hub.port}", "-s", "malloc,16m"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for("varnishd to listen", lambda: listens(port), 30, process)
        yield str(workdir), port, hub
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        hub.close()


@needs_varnish
@pytest.mark.slow
def test_counts_agree_with_known_hits_and_misses(varnish: tuple[str, int, Hub]) -> None:
    workdir, port, hub = varnish
    for path in ("/a", "/a", "/b", "/a", "/b"):  # misses: first /a, first /b
        assert get(f"http://127.0.0.1:{port}{path}")[0] == 200
    hub.close()
    assert get(f"http://127.0.0.1:{port}/c")[0] == 503  # a miss whose fetch from the hub fails
    seen = samples(VarnishSpokeCollector("spoke-v", workdir))
    assert seen[("stallwatch_spoke_requests_total", "result=hit", "spoke=spoke-v")] == 3
    assert seen[("stallwatch_spoke_requests_total", "result=miss", "spoke=spoke-v")] == 3
    assert seen[("stallwatch_spoke_hub_errors_total", "spoke=spoke-v")] == 1
    assert seen[("stallwatch_spoke_evictions_total", "spoke=spoke-v")] == 0
    assert 0 < seen[("stallwatch_spoke_cache_size_bytes", "spoke=spoke-v")] < 16 << 20
    assert seen[("stallwatch_spoke_cache_capacity_bytes", "spoke=spoke-v")] == 16 << 20


def test_older_flat_json_layout() -> None:
    flat = '{"timestamp": "2020-01-01T00:00:00", "MAIN.cache_hit": {"value": 4}, "MAIN.cache_miss": {"value": 1}}'
    assert counter_values(flat) == {"MAIN.cache_hit": 4, "MAIN.cache_miss": 1}


def test_broken_output_and_missing_program_are_counted() -> None:
    def garbage(command: Sequence[str], timeout: float) -> str:
        return "Could not get hold of varnishd, is it running?"

    seen = samples(VarnishSpokeCollector("spoke-v", run=garbage))
    assert seen == {("stallwatch_spoke_collector_errors_total", "reason=parse_error", "spoke=spoke-v"): 1}
    absent = VarnishSpokeCollector("spoke-v", varnishstat="/nonexistent/varnishstat")
    assert samples(absent) == {
        ("stallwatch_spoke_collector_errors_total", "reason=varnishstat_failed", "spoke=spoke-v"): 1}
    # Failure, not "no data": the scrape reports the collector failed and still serves its error counts.
    for broken in (absent, VarnishSpokeCollector("spoke-v", run=garbage)):
        families, succeeded = collected(broken, "spoke_varnish")
        assert not succeeded and [f.name for f in families] == ["stallwatch_spoke_collector_errors"]
