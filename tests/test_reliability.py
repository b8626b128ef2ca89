"""Faults while the agent runs: client label floods, collector flags, an agent crash under training,
NVML faults seen by the alert rules, and spoke logs and endpoints that vanish and come back."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from stallwatch import catalogue as c
from stallwatch.client import monitor, transport, wire
from stallwatch.client.identity import source_from_environment
from stallwatch.eventbatch import Interner
from stallwatch.exporters.collector import ScrapeCollector, collected
from stallwatch.exporters.events import EventsCollector
from stallwatch.exporters.gpu import GpuCollector
from stallwatch.exporters.host import HostCollector
from stallwatch.exporters.nvml_fake import FakeGpu, FakeNVML
from stallwatch.exporters.openmetrics_mapping import load_mapping, mapping_text
from stallwatch.exporters.receive_relay import RECEIVE_BUFFER
from stallwatch.exporters.spoke_nginx import MalformedLineError, NginxSpokeCollector, parse_entry
from stallwatch.exporters.spoke_openmetrics import OpenMetricsSpokeCollector
from stallwatch.exporters.web import MetricsServer
from stallwatch.harness import AgentProcess, Samples, parse_samples, scrape, stop_agent, total, wait_for
from tests.conftest import laughs, refused_agent
from tests.test_alert_rules import RULE_FILES, Case, promtool_test

DATA = Path(__file__).parent / "data"


# --- a client cannot blow up the series count ----------------------------------------------------
def test_ten_thousand_jobs_and_ranks_stay_under_the_series_bound(tmp_path: Path) -> None:
    collector = EventsCollector(str(tmp_path / "events.sock"), jobs=Interner(64), rank_limit=64)
    try:
        now = time.monotonic_ns()
        batches = [wire.encode(wire.Source(f"job-{n}-" + "x" * 100, n), [(0, now - 3, now - 2, now - 1, -1)], [], 1, 0,
                               0, now, time.time_ns()) for n in range(10_000)]
        collector.process(batches)
        registry = CollectorRegistry()
        registry.register(collector)
        samples = parse_samples(generate_latest(registry).decode())
    finally:
        collector.close()
    print(f"{len(samples)} samples from 10,000 distinct jobs and ranks")
    pairs = {(dict(ls)["training_job"], dict(ls)["rank"]) for (n, ls) in samples
             if n == "stallwatch_loader_wait_seconds_count"}
    assert len(pairs) == 65 and ("__other__", "__other__") in pairs  # 64 kept, everything else in one
    per_pair = 3 * (len(c.LATENCY_BUCKETS) + 3) + 3 + 1 + 1  # 3 histograms, reads by verdict, bytes, drops
    assert len(samples) <= (64 + 64 + 1) * per_pair + 50, len(samples)
    assert total(samples, "stallwatch_loader_wait_seconds_count") == 10_000  # folded, not lost
    assert total(samples, "stallwatch_receiver_folded_label_values_total", label="training_job") == 10_000 - 64
    assert total(samples, "stallwatch_receiver_folded_label_values_total", label="rank") == 10_000 - 64


def test_no_client_can_name_its_job_like_the_overflow_bucket(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    path = str(tmp_path / "events.sock")
    agent = agent_factory("--no-collector.gpu", "--no-collector.host", "--events.socket", path)
    now = time.monotonic_ns()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        for job in ("__other__", "honest"):  # a hand-made datagram: the client library would rename it
            sender.sendto(wire.encode(wire.Source(job, 0), [(0, now - 3, now - 2, now - 1, -1)], [], 1, 0, 0, now,
                                      time.time_ns()), path)
    samples = scrape_after(agent.url, 2)
    assert total(samples, "stallwatch_receiver_batches_total", result="bad_string") == 1
    jobs = {dict(labels).get("training_job") for (name, labels) in samples if name.startswith("stallwatch_loader_")}
    assert jobs - {None} == {"honest"}
    assert source_from_environment(job="__other__", env={}).job == "unknown"


def send_datagrams(path: str, datagrams: list[bytes]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # room for the oversized one
        for data in datagrams:
            sender.sendto(data, path)


def scrape_after(url: str, batches: int) -> Samples:
    """A scrape once the agent has counted `batches` batches (accepted or not)."""
    wait_for(f"{batches} batches counted", lambda: total(scrape(url), "stallwatch_receiver_batches_total") >= batches,
             10)
    return scrape(url)


def test_counters_count_only_what_was_really_received(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    path = str(tmp_path / "events.sock")
    agent = agent_factory("--no-collector.gpu", "--no-collector.host", "--events.socket", path)
    now, wall = time.monotonic_ns(), time.time_ns()

    def header(steps: int, reads: int, dropped: int = 0, job: bytes = b"forger", opens: int = 0) -> bytes:
        return (wire.HEADER.pack(wire.VERSION, 1, 0, -1, -1, 0, steps, reads, opens, dropped, now, wall)
                + wire.STRING_LENGTH.pack(len(job)) + job)

    def read(size: int) -> bytes:
        return wire.READ.pack(0, 1, size, now - 2, now - 1, wire.VERDICT_HIT)

    # A batch that fills the receive buffer exactly, then 1 kB more: cut by the kernel, valid if cut.
    prefix = RECEIVE_BUFFER - wire.HEADER.size - wire.STRING_LENGTH.size
    job = b"j" * (prefix % wire.READ.size or wire.READ.size)
    count = (prefix - len(job)) // wire.READ.size
    oversized = header(0, count, job=job) + read(1) * count
    assert len(oversized) == RECEIVE_BUFFER
    forged = [
        header(2**32 - 1, 0),  # 4 billion steps claimed in a 57-byte datagram
        header(0, 0, opens=2**32 - 1),  # and as many open records
        header(0, 4) + read(2**62 - 1) * 4,  # reads whose bytes add past int64
        header(0, 0, dropped=2**64 - 1),  # a client claiming 2**64 - 1 dropped events
        oversized + b"\0" * 1000,
    ]
    genuine = wire.encode(wire.Source("honest", 0), [(0, now - 3, now - 2, now - 1, -1)], [], 1, 0, 5, now, wall)
    send_datagrams(path, [*forged * 50, genuine])
    samples = scrape_after(agent.url, len(forged) * 50 + 1)
    print({f"{name}{labels}": total(samples, f"stallwatch_{name}", **labels) for name, labels in [
        ("receiver_batches_total", {"result": "accepted"}), ("receiver_dropped_events_total", {"reason": "rejected"}),
        ("receiver_dropped_events_total", {"reason": "queue_full"}), ("dataset_read_bytes_total", {}),
        ("client_dropped_events_total", {})]})
    assert total(samples, "stallwatch_receiver_batches_total", result="accepted") == 1
    assert total(samples, "stallwatch_receiver_batches_total") == len(forged) * 50 + 1
    assert total(samples, "stallwatch_receiver_dropped_events_total", reason="queue_full") == 0
    # Rejected events are counted as what the datagrams could hold, not what their headers claim.
    assert total(samples, "stallwatch_receiver_dropped_events_total", reason="rejected") <= 50 * (count + 1000 + 4)
    assert total(samples, "stallwatch_dataset_read_bytes_total") == 0
    assert total(samples, "stallwatch_client_dropped_events_total") == 5
    assert total(samples, "stallwatch_receiver_events_total") == 1


def test_a_second_agent_does_not_take_a_live_agents_socket(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    path = str(tmp_path / "events.sock")
    first = agent_factory("--no-collector.gpu", "--no-collector.host", "--events.socket", path)
    second = agent_factory("--no-collector.gpu", "--no-collector.host", "--events.socket", path)
    assert total(scrape(second.url), "stallwatch_receiver_up") == 0
    assert "another running agent" in second.stderr()
    stop_agent(second)  # and its exit must not remove the first agent's socket either
    now = time.monotonic_ns()
    send_datagrams(path, [wire.encode(wire.Source("job", 0), [(0, now - 3, now - 2, now - 1, -1)], [], 1, 0, 0, now,
                                      time.time_ns())])
    samples = scrape_after(first.url, 1)
    assert total(samples, "stallwatch_receiver_up") == 1
    assert total(samples, "stallwatch_receiver_batches_total", result="accepted") == 1
    # Taken anyway (deleted and bound by someone else): the first agent reports that it receives nothing.
    os.unlink(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as thief:
        thief.bind(path)
        assert total(scrape(first.url), "stallwatch_receiver_up") == 0


# --- collector flags and configuration files ------------------------------------------------------
@pytest.mark.parametrize(("flags", "message"), [
    (["--events.queue-limit", "0"], "must be a positive integer"),
    (["--events.rank-limit", "many"], "invalid"),
    (["--events.job-limit", "-3"], "must be a positive integer"),
    (["--events.queue-limit", "1" + "0" * 30], "--events.queue-limit"),
    (["--spoke_nginx.interval", "soon"], "--spoke_nginx.interval"),
    (["--spoke_nginx.interval", "-1"], "must be in [0, 604800]"),
    (["--spoke_nginx.rotate-wait", "inf"], "--spoke_nginx.rotate-wait"),
    (["--spoke_nginx.max-line-bytes", "0"], "--spoke_nginx.max-line-bytes"),
    (["--collector.spoke_qumulo"], "--spoke_qumulo.url is required"),
    (["--spoke_nfs.mount", "nomount"], "expected NAME=/mount/point"),
    (["--spoke_openmetrics.timeout", "x"], "--spoke_openmetrics.timeout"),
    (["--spoke_openmetrics.timeout", "nan"], "--spoke_openmetrics.timeout"),
    (["--spoke_openmetrics.timeout", "inf"], "--spoke_openmetrics.timeout"),
    (["--spoke_openmetrics.timeout", "-1"], "--spoke_openmetrics.timeout"),
    (["--spoke_qumulo.max-backoff", "1e308"], "--spoke_qumulo.max-backoff"),
    (["--gpu.interval", "nan"], "--gpu.interval"),
    (["--gpu.interval", "inf"], "--gpu.interval"),
    (["--gpu.pcie-interval", "nan"], "--gpu.pcie-interval"),
    (["--gpu.pcie-interval", "-1"], "--gpu.pcie-interval"),
    (["--gpu.fake-devices", "-1"], "--gpu.fake-devices"),
    (["--correlator.window", "nan"], "--correlator.window"),
    (["--correlator.window", "1e308"], "--correlator.window"),
    (["--correlator.lateness", "inf"], "--correlator.lateness"),
    (["--correlator.retention", "1e308"], "--correlator.retention"),
    (["--correlator.cache-capacity", "nan"], "--correlator.cache-capacity"),
    (["--correlator.cache-capacity", "inf"], "--correlator.cache-capacity"),
    (["--correlator.cache-capacity", "1e308"], "--correlator.cache-capacity"),
    (["--collector.spoke_openmetrics", "--spoke_openmetrics.url", "http://127.0.0.1:1/",
      "--spoke_openmetrics.mapping", "/nonexistent/mapping.yaml"], "collector spoke_openmetrics:"),
    (["--collector.spoke_qumulo", "--spoke_qumulo.url", "https://127.0.0.1:1/", "--spoke_qumulo.ca-file",
      "/nonexistent/ca.pem"], "collector spoke_qumulo:"),
])
def test_bad_collector_flags_are_one_line_and_exit_2(tmp_path: Path, flags: list[str], message: str) -> None:
    ended = refused_agent(["--no-collector.gpu", "--events.socket", str(tmp_path / "e.sock"), *flags])
    assert ended.one_line_error and message in ended.stderr, ended.stderr


@pytest.mark.parametrize(("content", "message"), [
    (f"gpu.interval: {laughs()}\n", "aliases"),  # 412 bytes that expand to 9**9 strings
    ("gpu.interval: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than"),
    (None, "larger than"),  # /dev/zero: endless
    ("gpu.interval: " + "9" * 5000 + "\n", "4300 digits"),
    ("gpu.interval: .nan\n", "gpu.interval"),
    ("correlator.window: 1e308\n", "correlator.window"),
    ("correlator.cache-capacity: .inf\n", "correlator.cache-capacity"),
    ("log.level: " + "x" * 100_000 + "\n", "log.level must be one of"),
])
def test_bad_config_files_are_one_line_and_exit_2_in_bounded_time_and_memory(
    tmp_path: Path, content: str | None, message: str,
) -> None:
    config = tmp_path / "agent.yaml"
    if content is not None:
        config.write_text(content)
    path = "/dev/zero" if content is None else str(config)
    ended = refused_agent(["--no-collector.gpu", "--events.socket", str(tmp_path / "e.sock"), "--config.file", path])
    print(f"{message}: {ended.cpu_seconds:.1f} s CPU, peak RSS {ended.peak_rss_mib:.0f} MiB")
    assert ended.one_line_error and message in ended.stderr, ended.stderr[-2000:]
    assert ended.cpu_seconds < 20 and ended.peak_rss_mib < 300


# --- an agent crash while training runs -----------------------------------------------------------
def test_training_runs_through_an_agent_crash_and_its_losses_are_counted(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    path = str(tmp_path / "events.sock")
    transport.configure(path)
    stop, steps, gaps = threading.Event(), [0], [0.0]

    def train() -> None:
        last = time.perf_counter()
        for _ in monitor(iter(lambda: 0, 1), job="crash", rank=3):  # endless
            time.sleep(0.001)
            now = time.perf_counter()
            gaps[0], last = max(gaps[0], now - last), now
            steps[0] += 1
            if stop.is_set():
                break

    first = agent_factory("--no-collector.gpu", "--no-collector.host", "--events.socket", path)
    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        wait_for("events at the first agent", lambda: total(scrape(first.url), "stallwatch_receiver_events_total") > 0,
                 20)
        first.process.send_signal(signal.SIGKILL)  # a crash: the stale socket file stays behind
        first.process.wait(timeout=10)
        before_outage, outage_started = steps[0], time.perf_counter()
        time.sleep(1.5)
        outage = time.perf_counter() - outage_started
        during_outage = steps[0] - before_outage
        second = agent_factory("--no-collector.gpu", "--no-collector.host", "--events.socket", path)

        def reported() -> float:
            return total(scrape(second.url), "stallwatch_client_dropped_events_total", training_job="crash", rank="3")

        channel = transport.sender().channel(wire.Source("crash", 3, -1, -1))
        # the client retries an absent agent after a pause
        wait_for("the drops reported", lambda: not channel.dropped_unreported and reported() > 0, 20)
    finally:
        stop.set()
        thread.join(timeout=10)
        transport.sender().close()
    print(f"outage {outage:.2f} s: {during_outage} steps during it, longest step {gaps[0] * 1e3:.1f} ms, "
          f"{channel.dropped_total} events dropped and reported, {steps[0]} steps in all")
    assert not thread.is_alive()
    assert during_outage > 0 and gaps[0] < outage / 2  # training went on through the outage, never blocked
    assert channel.dropped_total > 0 and channel.dropped_unreported == 0
    assert reported() == channel.dropped_total  # every lost event counted, and the count reached the agent
    assert total(scrape(second.url), "stallwatch_receiver_events_total") > 0


# --- NVML faults: the agent serves on, the errors say which, the alert fires ----------------------
def test_nvml_faults_keep_the_agent_serving_and_fire_the_alert(promtool: str, tmp_path: Path) -> None:
    now = [1_700_000_000.0]
    nvml = FakeNVML([FakeGpu(), FakeGpu(lost_at=300.0, unsupported=frozenset({"nvmlDeviceGetPowerUsage"}))],
                    clock=lambda: now[0], pcie_latency=0.0)
    gpu = GpuCollector(nvml, start=False, clock=lambda: now[0], pcie_interval=0)
    registry = CollectorRegistry()
    scrape_collector = ScrapeCollector({"gpu": gpu, "host": HostCollector()})
    registry.register(scrape_collector)
    server = MetricsServer(registry, "127.0.0.1", 0)
    server.start()
    url = server.url
    series: dict[str, list[float]] = {}
    try:
        for minute in range(30):
            if minute == 15:
                nvml.unload_driver()
            gpu.poll()
            samples = scrape(url)
            assert total(samples, "stallwatch_host_cpu_seconds_total") > 0  # the rest of the agent serves on
            assert total(samples, "stallwatch_scrape_collector_success", collector="gpu") == 1
            for (name, labels), value in samples.items():
                if name in (c.GPU_DEVICES.name, c.GPU_UP.name):
                    key = name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels) + "}"
                    series.setdefault(key, [float("nan")] * 30)[minute] = value
            now[0] += 60
            if minute == 14:
                final_lost = samples
        after = scrape(url)
    finally:
        server.close()
        scrape_collector.close()
    # The errors metric says which: GPU 1 lost, its power unsupported, then the driver gone for everyone.
    assert total(final_lost, c.GPU_UP.name, gpu="0") == 1 and total(final_lost, c.GPU_UP.name, gpu="1") == 0
    assert total(final_lost, c.GPU_NVML_ERRORS.name, gpu="1", error="gpu_is_lost") >= 10
    assert total(final_lost, c.GPU_NVML_ERRORS.name, gpu="1", call="nvmlDeviceGetPowerUsage",
                 error="not_supported") == 1
    assert total(final_lost, c.GPU_NVML_ERRORS.name, gpu="0") == 0
    assert total(after, c.GPU_DEVICES.name) == 0
    assert total(after, c.GPU_NVML_ERRORS.name, call="nvmlInit", error="driver_not_loaded") == 14  # a retry each poll
    # Fed what the agent emitted, a minute apart, the generated rules fire while GPUs are missing.
    def values(points: list[float]) -> str:
        return " ".join("_" if math.isnan(p) else str(int(p)) for p in points)

    inputs = {key.replace("{", '{instance="n1", ' if "=" in key else '{instance="n1"'): values(points)
              for key, points in series.items()}
    def firing(gpus: int) -> tuple[tuple[dict[str, str], str], ...]:
        return (({"instance": "n1"}, f"{gpus} GPUs on n1 do not answer NVML (a GPU lost, or the driver gone)."),)

    cases = [Case("StallwatchGPUsUnreachable", inputs, "4m"),  # healthy
             # GPU 1 lost since minute 5 (pending until 15), then at minute 15 the driver goes: both GPUs
             Case("StallwatchGPUsUnreachable", inputs, "16m", firing(2)),
             Case("StallwatchGPUsUnreachable", inputs, "29m", firing(2))]  # the driver gone since minute 15
    tests = tmp_path / "nvml.test.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [str(p) for p in RULE_FILES], "evaluation_interval": "1m",
                                     "tests": [promtool_test(case) for case in cases]}))
    result = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr + tests.read_text()


# --- spoke faults --------------------------------------------------------------------------------
def _parses(line: str) -> bool:
    try:
        parse_entry(line)
    except MalformedLineError:
        return False
    return True


NGINX_LINES = [line for line in (DATA / "nginx-stallwatch.log").read_text().splitlines() if _parses(line)]


def test_a_deleted_and_recreated_nginx_log_loses_and_repeats_nothing(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    collector = NginxSpokeCollector(str(log), "spoke", from_start=True, rotate_wait=0, interval=0)
    lines = NGINX_LINES * 3
    writer = log.open("a")  # nginx holds its log open: lines written after the unlink land in the old file
    try:
        writer.write("\n".join(lines[:4]) + "\n")
        writer.flush()
        used = [collector.poll()]
        assert used == [4]
        writer.write("\n".join(lines[4:6]) + "\n")  # not read yet when the file is deleted
        writer.flush()
        log.unlink()
        writer.write(lines[6] + "\n")  # still written to the deleted file until nginx reopens
        writer.flush()
        used.append(collector.poll())  # the path is gone; the old file, still followed, has 3 new lines
        writer.close()
        writer = log.open("a")  # `nginx -s reopen`: a new file at the same path
        writer.write("\n".join(lines[7:10]) + "\n")
        writer.flush()
        used += [collector.poll(), collector.poll()]
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collected(collector, "spoke")[0]
                   for s in f.samples}
    finally:
        writer.close()
        collector.close()
    assert used == [4, 3, 3, 0]
    assert total(samples, "stallwatch_spoke_requests_total") == 10
    assert total(samples, "stallwatch_spoke_collector_errors_total") == 0


class _Spoke(BaseHTTPRequestHandler):
    body = (DATA / "juicefs-1.4.2-gateway.prom").read_bytes()
    delay = 0.0

    def do_GET(self) -> None:
        time.sleep(type(self).delay)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_slow_then_down_spoke_endpoint_is_counted_and_recovers_without_double_counting() -> None:
    def start(port: int = 0) -> ThreadingHTTPServer:
        httpd = ThreadingHTTPServer(("127.0.0.1", port), _Spoke)
        httpd.daemon_threads = True
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd

    httpd = start()
    port = httpd.server_address[1]
    collector = OpenMetricsSpokeCollector(f"http://127.0.0.1:{port}/metrics", load_mapping(*mapping_text("juicefs")),
                                          "jfs", timeout=0.3)

    def read() -> Samples:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collected(collector, "spoke")[0]
                for s in f.samples}

    try:
        healthy = read()
        _Spoke.delay = 1.0
        slow = read()
        _Spoke.delay = 0.0
        httpd.shutdown()
        httpd.server_close()
        down = read()
        httpd = start(port)
        recovered = read()
    finally:
        _Spoke.delay = 0.0
        httpd.shutdown()
        httpd.server_close()
    hits = ("stallwatch_spoke_requests_total", (("result", "hit"), ("spoke", "jfs")))
    assert healthy[hits] == recovered[hits] == 13  # the source's own counter: nothing added twice
    assert hits not in slow and hits not in down  # no stale value while the endpoint fails
    assert total(recovered, "stallwatch_spoke_collector_errors_total", reason="timeout") == 1
    assert total(recovered, "stallwatch_spoke_collector_errors_total", reason="unreachable") == 1
