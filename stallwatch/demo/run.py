"""`stallwatch demo`: the whole story on one machine, no GPU and no cloud.

On loopback it starts a hub (a sharded dataset behind an emulated region boundary), a real nginx
spoke in front of it, the stallwatch agent (with an emulated GPU that is busy exactly while the job
computes), Prometheus with the generated rules and Alertmanager with a webhook receiver when Debian's
packages are installed, and an emulated training job: a real PyTorch DataLoader whose workers read
the shards through the spoke. It shows the job's progress live, runs a cold epoch then warm ones,
optionally cuts the hub for a while (`--outage`) so a stall alert fires, stops everything it started
and writes the warm-up report.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stallwatch import catalogue as c
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.demo.agent import AgentSetup, start_node_agent
from stallwatch.demo.cluster import ClusterDemo, ClusterSettings
from stallwatch.demo.hub import Hub, HubSettings, start_hub
from stallwatch.demo.spoke import Nginx, spoke_server_block
from stallwatch.demo.stack import Server, Webhook, query, start_alertmanager, start_prometheus
from stallwatch.harness import (
    AgentProcess,
    Samples,
    find_binary,
    scrape,
    stop_process,
    total,
    wait_for,
)
from stallwatch.mixin.alerts import render_alerting_rules
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.rules import render_recording_rules
from stallwatch.report.prometheus import run_from_prometheus
from stallwatch.report.render import render_html
from stallwatch.report.windows import run_from_windows

PROGRESS = re.compile(r"epoch (\d+) step (\d+)/(\d+)")
SPOKE_NAME = "demo-spoke"
ALERT_GRACE_SECONDS = 60.0
JOB = "demo"

# The generated rules, with windows and `for`s short enough for a run of a few minutes.
DEMO_THRESHOLDS = Thresholds(
    rate_window="30s", gpu_starved_for="10s", input_bound_for="20s", hub_failing_for="10s", warmup_budget="10m",
    hit_ratio_for="20s", hit_ratio_baseline_window="10m", agent_down_for="30s", collector_failing_for="30s",
    dropped_events_for="30s", egress_for="1m",
)


@dataclass
class Settings(HubSettings):
    duration: float = 180.0
    shards: int = 160
    shard_mib: float = 2.0
    cache_size: int | None = None  # bytes; None: room for the whole dataset
    rtt_seconds: float = 0.06
    bandwidth_mbit: float = 200.0
    step_seconds: float = 0.1
    workers: int = 4
    batch_size: int = 2
    outage: bool = False
    outage_seconds: float = 30.0
    window_seconds: float = CorrelatorSettings().window_s
    price_per_gb: float = 0.02
    workdir: Path = field(default_factory=lambda: Path("stallwatch-demo"))
    quiet: bool = False

    @property
    def cache_bytes(self) -> int:
        if self.cache_size is not None:
            return self.cache_size
        # With an outage, a cache smaller than the dataset keeps some reads going to the hub in steady
        # state, so cutting the hub stalls the job; without one, the whole dataset fits.
        return int(self.dataset_bytes * (0.85 if self.outage else 2.0))


@dataclass
class Outcome:
    report: Path
    windows: Path
    alerts: list[dict[str, Any]]
    metrics: Samples
    prometheus: str | None
    started: float
    ended: float


def status_line(metrics: Samples, before: Samples | None = None) -> str:
    """Hit ratio since `before` (else since the start), the rank's input-bound ratio and the job's phase."""
    requests = c.SPOKE_REQUESTS.name
    served = total(metrics, requests) - (total(before, requests) if before else 0)
    hits = total(metrics, requests, result="hit") - (total(before, requests, result="hit") if before else 0)
    hit = f"{hits / served:4.0%}" if served else "  - "
    bound = [v for (n, _), v in metrics.items() if n == c.INPUT_BOUND_RATIO.name]
    phase = next((dict(ls)["phase"] for (n, ls), v in metrics.items() if n == c.WARMUP_PHASE.name and v == 1), "-")
    return f"hit {hit}  input-bound {max(bound):4.0%}  phase {phase:10}" if bound else f"hit {hit}  phase {phase}"


class Demo:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self._stack = contextlib.ExitStack()
        self.alerts: list[dict[str, Any]] = []
        self.webhook: Webhook | None = None

    def say(self, text: str) -> None:
        if not self.s.quiet:
            print(text, flush=True)

    def _on_alert(self, notification: dict[str, Any]) -> None:
        for alert in notification.get("alerts", []):
            self.alerts.append(alert)
            labels = alert.get("labels", {})
            self.say(f"\n  ALERT received by the webhook: {labels.get('alertname')} ({alert.get('status')}) "
                     f"{alert.get('annotations', {}).get('description', '')}")

    def _start_agent(self, work: Path, spoke: Nginx, hub_url: str) -> AgentProcess:
        return start_node_agent(self._stack, AgentSetup(work, spoke.access_log, SPOKE_NAME, hub_url,
                                                        self.s.cache_bytes, self.s.window_seconds))

    def _start_monitoring(self, work: Path, agent_url: str) -> Server | None:
        prometheus_bin, alertmanager_bin = find_binary("prometheus"), find_binary("prometheus-alertmanager")
        if prometheus_bin is None:
            self.say("  (Debian's prometheus is not installed: no Prometheus, alerts or report from it)")
            return None
        rules = [work / "recording-rules.yaml", work / "alerting-rules.yaml"]
        rules[0].write_text(render_recording_rules(DEMO_THRESHOLDS))
        rules[1].write_text(render_alerting_rules(DEMO_THRESHOLDS))
        alertmanager = None
        if alertmanager_bin is not None:
            webhook = self.webhook = Webhook(self._on_alert)
            self._stack.callback(webhook.close)
            alertmanager = start_alertmanager(alertmanager_bin, work / "alertmanager", webhook.url)
            self._stack.callback(alertmanager.close)
            self.say(f"  alertmanager {alertmanager.url} -> webhook {webhook.url}")
        target = agent_url.split("//")[1].split("/", maxsplit=1)[0]
        prometheus = start_prometheus(prometheus_bin, work / "prometheus", [target], rules,
                                      alertmanager.url if alertmanager else None,
                                      job=DEMO_THRESHOLDS.agent_scrape_job)
        self._stack.callback(prometheus.close)
        self.say(f"  prometheus   {prometheus.url}")
        # The cold epoch is the story: start the job only once Prometheus sees the agent's zeros.
        wait_for("the first scrape of the agent",
                 lambda: bool(query(prometheus.url, "up == 1").get("data", {}).get("result")), 30,
                 prometheus.process, prometheus.log)
        return prometheus

    def run(self, while_running: Callable[[str | None, str], None] | None = None) -> Outcome:
        """Run the demo; `while_running(prometheus_url, agent_url)` is called after training, before the
        servers stop (the tests query the live stack there)."""
        s = self.s
        with self._stack:
            work = s.workdir.resolve()
            hub = start_hub(self._stack, work, s)
            self.say(f"stallwatch demo in {work}")
            self.say(f"  hub          {hub.url}  ({s.shards} shards, {s.dataset_bytes / 2**20:.0f} MiB, "
                     f"RTT {s.rtt_seconds * 1000:.0f} ms, {s.bandwidth_mbit:.0f} Mbit/s)")
            spoke = Nginx(work / "spoke", spoke_server_block(hub.url), f"{max(1, s.cache_bytes // 2**20)}m")
            self._stack.callback(spoke.close)
            self.say(f"  spoke        {spoke.url()}  (nginx proxy_cache, {s.cache_bytes / 2**20:.0f} MiB)")
            agent_url = self._start_agent(work, spoke, hub.url).url
            self.say(f"  agent        {agent_url}")
            prometheus = self._start_monitoring(work, agent_url)
            started = time.time()
            trainer = subprocess.Popen(
                [sys.executable, "-m", "stallwatch.demo.trainer", "--spoke", spoke.url(), "--shards", str(s.shards),
                 "--batch-size", str(s.batch_size), "--workers", str(s.workers), "--step-seconds",
                 str(s.step_seconds), "--duration", str(s.duration), "--trace", str(work / "gpu.trace"),
                 "--job", JOB],
                stdout=subprocess.PIPE, stderr=(work / "trainer.log").open("w"), text=True,
                env=dict(os.environ, STALLWATCH_SOCKET=str(work / "events.sock")),
            )
            self._stack.callback(stop_process, trainer)
            self._follow(trainer, agent_url, hub, started)
            ended = time.time()
            time.sleep(s.window_seconds + CorrelatorSettings().lateness_s + 2)  # the last windows close, get scraped
            if s.outage and self.webhook is not None and not self.alerts:
                self.say("\n  waiting for the stall alert to travel through Prometheus and Alertmanager")
                deadline = time.monotonic() + ALERT_GRACE_SECONDS
                while not self.alerts and time.monotonic() < deadline:
                    time.sleep(0.5)
            metrics = scrape(agent_url)
            self.say(f"\nfinal: {status_line(metrics)}")
            if while_running is not None:
                while_running(prometheus.url if prometheus else None, agent_url)
            report_path = work / "report.html"
            run = (run_from_prometheus(prometheus.url, started, ended) if prometheus
                   else run_from_windows(work / "windows.jsonl"))
            report_path.write_text(render_html(run, s.price_per_gb))
            self.say(f"alerts received: {sorted({a['labels']['alertname'] for a in self.alerts}) or 'none'}")
            self.say(f"report: {report_path}")
            return Outcome(report_path, work / "windows.jsonl", list(self.alerts), metrics,
                           prometheus.url if prometheus else None, started, ended)

    def _follow(self, trainer: subprocess.Popen[str], agent_url: str, hub: Hub, started: float) -> None:
        """Print a progress bar per epoch with the live hit ratio, input-bound ratio and phase."""
        s = self.s
        outage_at = started + s.duration * 0.55 if s.outage else None
        status = {"line": ""}
        stop = threading.Event()

        def refresh() -> None:
            recent: list[Samples] = []  # the last few scrapes: the hit ratio shown is over ~5 s
            while not stop.wait(1.0):
                with contextlib.suppress(OSError, ValueError):
                    recent = [*recent[-4:], scrape(agent_url)]
                    status["line"] = status_line(recent[-1], recent[0] if len(recent) > 1 else None)

        threading.Thread(target=refresh, daemon=True).start()
        assert trainer.stdout is not None
        epoch_seen = 0
        try:
            for line in trainer.stdout:
                match = PROGRESS.match(line)
                if not match:
                    continue
                epoch, step, steps = (int(g) for g in match.groups())
                if epoch != epoch_seen and epoch_seen:
                    self.say("")  # keep the finished epoch's bar on its own line
                epoch_seen = epoch
                if outage_at is not None and time.time() >= outage_at:
                    hub.cut_for(s.outage_seconds)
                    self.say(f"\n  hub cut for {s.outage_seconds:.0f} s (emulated region-link outage)")
                    outage_at = None
                done = int(30 * step / steps)
                if not s.quiet:
                    elapsed = time.time() - started
                    print(f"\r  epoch {epoch:2d} [{'#' * done}{'.' * (30 - done)}] {step:3d}/{steps}  "
                          f"{status['line']}  {elapsed:5.0f}s", end="", flush=True)
        finally:
            stop.set()
            trainer.wait(timeout=60)


def _size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)i?b?", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size such as 150MiB: {text}")
    return int(float(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)])


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallwatch demo", description=__doc__.splitlines()[0])
    d = Settings()
    flags: list[tuple[str, type, Any, str]] = [
        ("--duration", float, d.duration, "seconds of training"),
        ("--outage-seconds", float, d.outage_seconds, "how long --outage cuts the hub"),
        ("--rtt-ms", float, d.rtt_seconds * 1000, "round trip to the hub"),
        ("--bandwidth-mbit", float, d.bandwidth_mbit, "bandwidth to the hub"),
        ("--shards", int, d.shards, "dataset shards"),
        ("--shard-mib", float, d.shard_mib, "size of one shard"),
        ("--step-seconds", float, d.step_seconds, "emulated compute per step"),
        ("--workers", int, d.workers, "loader worker processes"),
        ("--price-per-gb", float, d.price_per_gb, "cross-region transfer price, $/GB"),
    ]
    for flag, kind, default, text in flags:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    parser.add_argument("--cache-size", type=_size, default=None,
                        help="spoke capacity, e.g. 150MiB (default: the whole dataset; 85%% of it with --outage)")
    parser.add_argument("--outage", action="store_true", help="cut the hub mid-run so a stall alert fires")
    parser.add_argument("--workdir", type=Path, default=None, help="(default: a new temporary folder)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="2 or more: a multi-node data-parallel job, one agent and spoke per node, the last "
                             "node's spoke cold (its own scenario; the flags above do not apply)")
    options = parser.parse_args(argv)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="stallwatch-demo-"))
    if options.nodes > 1:
        return _report_errors(lambda: ClusterDemo(ClusterSettings(nodes=options.nodes, workdir=workdir)).run())
    settings = Settings(
        duration=options.duration, cache_size=options.cache_size, outage=options.outage,
        outage_seconds=options.outage_seconds, rtt_seconds=options.rtt_ms / 1000, bandwidth_mbit=options.bandwidth_mbit,
        shards=options.shards, shard_mib=options.shard_mib, step_seconds=options.step_seconds, workers=options.workers,
        price_per_gb=options.price_per_gb,
        workdir=workdir,
    )
    return _report_errors(lambda: Demo(settings).run())


def _report_errors(demo: Callable[[], object]) -> int:
    try:
        demo()
    except KeyboardInterrupt:
        print("\ninterrupted; everything the demo started is stopped", file=sys.stderr)
        return 130
    except RuntimeError as error:
        print(f"stallwatch demo: error: {error}", file=sys.stderr)
        return 1
    return 0

