"""spoke_openmetrics scraping real HTTP servers on 127.0.0.1 that serve recorded or documented
exposition text (tests/data/SOURCES.md), and ones that are slow, broken or absent."""

from __future__ import annotations

import importlib.resources
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as strict_openmetrics

from stallwatch.exporters.collector import collected
from stallwatch.exporters.openmetrics_mapping import (
    BUILTIN_MAPPINGS,
    MAX_LINES,
    MappingError,
    load_mapping,
    mapping_text,
)
from stallwatch.exporters.spoke_openmetrics import OpenMetricsSpokeCollector
from stallwatch.harness import AgentProcess, scrape, total

DATA = Path(__file__).parent / "data"
JUICEFS = (DATA / "juicefs-1.4.2-gateway.prom").read_bytes()
HISTOGRAM = b"# TYPE juicefs_object_request_durations_histogram_seconds histogram\n"
BUCKET = b'juicefs_object_request_durations_histogram_seconds_bucket{method="GET",le="%s"} %s\n'
SUM = b'juicefs_object_request_durations_histogram_seconds_sum{method="GET"} 0.5\n'
COUNTER = b"# TYPE juicefs_blockcache_hits counter\njuicefs_blockcache_hits %s\n"
# What a hostile (or broken) endpoint can serve that our own exposition cannot carry, and its reason.
HOSTILE = {
    "nan-bound-no-inf": (HISTOGRAM + BUCKET % (b"NaN", b"3") + SUM, "invalid_histogram"),
    "no-inf": (HISTOGRAM + BUCKET % (b"0.1", b"3") + SUM, "invalid_histogram"),
    "negative-bound": (HISTOGRAM + BUCKET % (b"-1", b"1") + BUCKET % (b"+Inf", b"3") + SUM, "invalid_histogram"),
    "decreasing-buckets": (HISTOGRAM + BUCKET % (b"0.1", b"5") + BUCKET % (b"+Inf", b"3") + SUM, "invalid_histogram"),
    "fractional-bucket": (HISTOGRAM + BUCKET % (b"+Inf", b"2.5") + SUM, "invalid_value"),
    "negative-counter": (COUNTER % b"-5", "invalid_value"),
    "nan-counter": (COUNTER % b"NaN", "invalid_value"),
    "inf-counter": (COUNTER % b"+Inf", "invalid_value"),
    "nan-gauge": (b"# TYPE juicefs_blockcache_bytes gauge\njuicefs_blockcache_bytes NaN\n", "invalid_value"),
    "duplicated-family": (COUNTER % b"5" + COUNTER % b"5", "duplicate_family"),
    "duplicated-series": (COUNTER % b"5" + b"juicefs_blockcache_hits 5\n", "duplicate_family"),
    "flood": (b"".join(b'juicefs_blockcache_hits{i="%d"} 1\n' % i for i in range(MAX_LINES + 1)), "too_many_series"),
}


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[int, bytes, float]]] = {}

    def do_GET(self) -> None:
        status, body, delay = self.routes.get(self.path, (404, b"not found\n", 0.0))
        time.sleep(delay)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the slow route: the client gave up, as it should

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # 1M series of another family after JuiceFS's own, 16 MB (under the 16 MiB limit): parsed whole, 587 MiB traced.
    million = JUICEFS + b"".join(b'm{i="%06d"} 1\n' % i for i in range(1_000_000))
    _Handler.routes = {
        "/juicefs": (200, JUICEFS, 0.0),
        "/million": (200, million, 0.0),
        **{f"/hostile/{case}": (200, body, 0.0) for case, (body, _) in HOSTILE.items()},
        "/alluxio": (200, (DATA / "alluxio-client-cache.prom").read_bytes(), 0.0),
        "/qumulo": (200, (DATA / "qumulo-metrics.prom").read_bytes(), 0.0),
        "/slow": (200, (DATA / "juicefs-1.4.2-gateway.prom").read_bytes(), 2.0),
        "/garbage": (200, b"<html><body>{not: metrics}</body></html>\n\x00\xff", 0.0),
        "/broken": (500, b"internal error\n", 0.0),
    }
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def collector(url: str, mapping: str, timeout: float = 2.0) -> OpenMetricsSpokeCollector:
    text, origin = mapping_text(mapping)
    return OpenMetricsSpokeCollector(url, load_mapping(text, origin), "spoke-a", timeout=timeout)


def samples(c: OpenMetricsSpokeCollector) -> dict[tuple[str, ...], float]:
    """What a scrape serves of the collector (its error counts too when its source failed)."""
    return {(s.name, *(f"{k}={v}" for k, v in sorted(s.labels.items()))): s.value
            for family in collected(c, "spoke")[0] for s in family.samples}


def test_juicefs_recorded_from_a_real_gateway(server: str) -> None:
    seen = samples(collector(server + "/juicefs", "juicefs"))
    assert seen[("stallwatch_spoke_requests_total", "result=hit", "spoke=spoke-a")] == 13
    assert seen[("stallwatch_spoke_requests_total", "result=miss", "spoke=spoke-a")] == 5
    assert seen[("stallwatch_spoke_bytes_total", "source=cache", "spoke=spoke-a")] == 5836962
    assert seen[("stallwatch_spoke_bytes_total", "source=hub", "spoke=spoke-a")] == 9194304
    assert seen[("stallwatch_spoke_evictions_total", "spoke=spoke-a")] == 0
    assert seen[("stallwatch_spoke_cache_size_bytes", "spoke=spoke-a")] == 5024270
    # GETs only: 3 of them in the recording; the 5 PUTs are write-back, not hub fetches.
    assert seen[("stallwatch_spoke_hub_fetch_duration_seconds_count", "spoke=spoke-a")] == 3
    assert seen[("stallwatch_spoke_hub_fetch_duration_seconds_sum", "spoke=spoke-a")] == pytest.approx(0.00841641)
    assert not any("instance=" in part or "vol_name=" in part for key in seen for part in key)


def test_alluxio_and_qumulo_documented_names(server: str) -> None:
    alluxio = samples(collector(server + "/alluxio", "alluxio"))
    assert alluxio[("stallwatch_spoke_bytes_total", "source=cache", "spoke=spoke-a")] == 7340032
    assert alluxio[("stallwatch_spoke_bytes_total", "source=hub", "spoke=spoke-a")] == 1048576
    assert alluxio[("stallwatch_spoke_evictions_total", "spoke=spoke-a")] == 3
    assert alluxio[("stallwatch_spoke_cache_size_bytes", "spoke=spoke-a")] == 4194304
    qumulo = samples(collector(server + "/qumulo", "qumulo"))
    assert qumulo[("stallwatch_spoke_cache_size_bytes", "spoke=spoke-a")] == 52613349376  # fs_type=spoke only


@pytest.mark.parametrize(("path", "reason"), [
    ("/slow", "timeout"), ("/garbage", "parse_error"), ("/broken", "http_error"), ("/nowhere", "http_error"),
])
def test_failed_scrapes_are_counted_not_raised(server: str, path: str, reason: str) -> None:
    c = collector(server + path, "juicefs", timeout=0.3)
    seen = samples(c)
    assert seen == {("stallwatch_spoke_collector_errors_total", f"reason={reason}", "spoke=spoke-a"): 1}
    assert samples(c)[("stallwatch_spoke_collector_errors_total", f"reason={reason}", "spoke=spoke-a")] == 2


def test_refused_connection() -> None:
    from tests.realspoke import free_port

    refused = collector(f"http://127.0.0.1:{free_port()}/metrics", "juicefs", timeout=0.5)
    assert samples(refused) == {("stallwatch_spoke_collector_errors_total", "reason=unreachable", "spoke=spoke-a"): 1}
    families, succeeded = collected(refused, "spoke_openmetrics")  # a failure, not "no data"
    assert not succeeded and [f.name for f in families] == ["stallwatch_spoke_collector_errors"]


def test_a_million_other_series_are_skipped_not_parsed(server: str) -> None:
    """Only the families the mapping reads are parsed: the other 1M series cost no object each."""
    c = collector(server + "/million", "juicefs")
    tracemalloc.start()
    started = time.process_time()
    try:
        seen = samples(c)
        cpu = time.process_time() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen[("stallwatch_spoke_requests_total", "result=hit", "spoke=spoke-a")] == 13
    assert seen[("stallwatch_spoke_hub_fetch_duration_seconds_count", "spoke=spoke-a")] == 3
    assert peak < 48 << 20, f"{peak / 2**20:.1f} MiB"  # the body and its decoded text, 16 MB each, and little else
    assert cpu < 2.0, f"{cpu:.2f} s"


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_body_is_refused_whole_and_counted(server: str, case: str) -> None:
    reason = HOSTILE[case][1]
    c = collector(server + f"/hostile/{case}", "juicefs")
    assert samples(c) == {("stallwatch_spoke_collector_errors_total", f"reason={reason}", "spoke=spoke-a"): 1}


def test_the_agent_stays_valid_openmetrics_whatever_its_spoke_serves(
        server: str, agent_factory: Callable[..., AgentProcess]) -> None:
    """Prometheus drops the agent's whole scrape if one sample is invalid: a hostile spoke's values must
    never reach it. The agent's page is read with prometheus_client's strict OpenMetrics parser."""
    agent = agent_factory("--no-collector.gpu", "--no-collector.host", "--no-collector.events",
                          "--collector.spoke_openmetrics", "--spoke_openmetrics.url", server + "/switch",
                          "--spoke_openmetrics.timeout", "1")
    request = urllib.request.Request(agent.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    for case, (body, reason) in HOSTILE.items():
        _Handler.routes["/switch"] = (200, body, 0.0)
        with urllib.request.urlopen(request, timeout=10) as reply:
            page = reply.read().decode()
        families = {f.name: f for f in strict_openmetrics(page)}  # raises on an invalid page
        errors = {s.labels["reason"]: s.value for s in families["stallwatch_spoke_collector_errors"].samples
                  if s.name.endswith("_total")}
        assert errors.get(reason, 0) >= 1, case
        assert not [s for name, f in families.items() for s in f.samples
                    if name.startswith("stallwatch_spoke_") and name != "stallwatch_spoke_collector_errors"], case
    assert "Traceback" not in agent.stderr()


@pytest.mark.parametrize(("text", "message"), [
    ("metrics: {}", "list under 'metrics'"),
    ("metrics: [{source: x, target: nope}]", "target must be one of"),
    ("metrics: [{source: x, target: spoke_requests_total}]", "needs labels ['result']"),
    ("metrics: [{source: '(', target: spoke_evictions_total}]", "regular expression"),
    ("metrics: [{source: x, target: spoke_evictions_total, colour: red}]", "unknown keys colour"),
    ("metrics: [", "not valid YAML"),
    ("metrics: [{source: x, target: spoke_evictions_total, scale: -1}]", "scale must be a positive number"),
    ("metrics: [{source: x, target: spoke_evictions_total, scale: .nan}]", "scale must be a positive number"),
    ("metrics: [{source: '(?P<a>x)', target: spoke_evictions_total},"
     " {source: '(?P<a>y)', target: spoke_evictions_total}]", "cannot be matched together"),
])
def test_bad_mappings_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(MappingError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_mapping(text, "my.yaml")


def test_builtin_mappings_ship_as_package_data() -> None:
    for name in BUILTIN_MAPPINGS:
        assert (importlib.resources.files("stallwatch.exporters") / "mappings" / f"{name}.yaml").is_file()
        assert load_mapping(*mapping_text(name))


def test_an_unreachable_source_is_a_failed_collector_on_the_agent(
        agent_factory: Callable[..., AgentProcess]) -> None:
    """node_exporter tells a failed source from one with no data: the agent reports the collector failed while
    its spoke's endpoint refuses, and serves the count of refusals beside it."""
    from tests.realspoke import free_port

    agent = agent_factory("--no-collector.gpu", "--no-collector.host", "--no-collector.events",
                          "--collector.spoke_openmetrics", "--spoke_openmetrics.url",
                          f"http://127.0.0.1:{free_port()}/metrics", "--spoke_openmetrics.timeout", "0.5")
    metrics = scrape(agent.url)
    assert total(metrics, "stallwatch_scrape_collector_success", collector="spoke_openmetrics") == 0
    assert total(metrics, "stallwatch_scrape_collector_success", collector="correlator") == 1
    assert total(metrics, "stallwatch_spoke_collector_errors_total", reason="unreachable") >= 1
    assert "Traceback" not in agent.stderr()
