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
from collections.abc import Callable, Collection, Sequence
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
RECOVERY_SECONDS = 10.0  # training after an outage, to see the job recover
RECENT_SCRAPES = 5  # the live line's figures are over the last ~4 s of scrapes, one a second
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
    def cut_after(self) -> float:
        """Seconds into training when `--outage` cuts the hub."""
        return 0.55 * self.duration

    @property
    def training_seconds(self) -> float:
        """How long the job trains: `duration`, or longer so that an outage ends before the job does."""
        if not self.outage:
            return self.duration
        return max(self.duration, self.cut_after + self.outage_seconds + RECOVERY_SECONDS)

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
    cut_at: float | None = None  # unix time the hub was cut
    fired_at: dict[str, float] = field(default_factory=dict)  # alert -> unix time the webhook last heard it fire


# (unix time, samples) of one scrape of the agent
Scrape = tuple[float, Samples]


def _since(recent: Sequence[Scrape], name: str, **labels: str) -> float:
    """How much the counter `name` grew from the first of `recent` to the last (since the start for one),
    summed over its series; a series that went down was reset (the agent forgot it and began it again),
    and grew by its whole last value, as Prometheus's increase() counts it."""
    first = recent[0][1] if len(recent) > 1 else {}
    grown = 0.0
    for key, value in recent[-1][1].items():
        if key[0] == name and all((k, x) in key[1] for k, x in labels.items()):
            grown += value if value < first.get(key, 0.0) else value - first.get(key, 0.0)
    return grown


def status_line(recent: Sequence[Scrape], firing: Collection[str] = ()) -> str:
    """What the agent's last scrapes say: the hit ratio, the input-bound ratio (stall over stall plus
    compute seconds booked), the share of the time the ranks stalled and its main cause, the job's phase,
    and the alerts firing. Over the scrapes' span, so a stall shows while it lasts (the correlator books it
    window by window); one scrape: since the start, without the stalled share."""
    served, hits = _since(recent, c.SPOKE_REQUESTS.name), _since(recent, c.SPOKE_REQUESTS.name, result="hit")
    causes = {cause: _since(recent, c.STALL_SECONDS.name, cause=cause) for cause in c.CAUSES}
    stalled, computed = sum(causes.values()), _since(recent, c.COMPUTE_SECONDS.name)
    parts = [f"hit {hits / served:4.0%}" if served else "hit   - "]
    if stalled + computed > 0:
        parts.append(f"input-bound {stalled / (stalled + computed):4.0%}")
    if len(recent) > 1:
        parts.append(_stalled(recent, causes))
    metrics = recent[-1][1]
    phase = next((dict(ls)["phase"] for (n, ls), v in metrics.items() if n == c.WARMUP_PHASE.name and v == 1), "-")
    parts.append(f"phase {phase:10}")
    if firing:
        parts.append(f"FIRING {', '.join(sorted(firing))}")
    return "  ".join(parts)


def _stalled(recent: Sequence[Scrape], causes: dict[str, float]) -> str:
    """The share of the scrapes' span the ranks spent stalled, and the cause of most of it."""
    ranks = len({labels for name, labels in recent[-1][1] if name == c.COMPUTE_SECONDS.name}) or 1
    seconds = (recent[-1][0] - recent[0][0]) * ranks
    stalled = sum(causes.values())
    # Windows are published as they close, so a scrape may hold one window more than the span: clip.
    share = min(stalled / seconds, 1.0) if seconds > 0 else 0.0
    cause = max(causes, key=lambda k: causes[k]) if stalled > 0 else ""
    return f"stalled {share:4.0%} {cause:12}"


class LiveLine:
    """The line the demo keeps rewriting: the epoch's bar from the trainer's progress and the status from
    the agent's scrapes. Both redraw it: the trainer prints nothing while it waits out an outage, and the
    scrapes still show the stall. One lock keeps the line and the demo's messages whole."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.started = time.time()
        self.lock = threading.Lock()
        self.bar = "starting"
        self.status = ""
        self._epoch = 0
        self._width = 0  # of the line drawn last: a shorter one is padded over it

    def progress(self, epoch: int, step: int, steps: int) -> None:
        with self.lock:
            if epoch != self._epoch and self._epoch:
                self._write("\n")  # keep the finished epoch's bar on its own line
            self._epoch = epoch
            done = int(30 * step / steps)
            self.bar = f"epoch {epoch:2d} [{'#' * done}{'.' * (30 - done)}] {step:3d}/{steps}"
            self._draw()

    def show(self, status: str) -> None:
        with self.lock:
            self.status = status
            self._draw()

    def say(self, text: str) -> None:
        """Print `text` on a line of its own, below the live line if one is drawn."""
        with self.lock:
            self._write(("\n" if self._width else "") + text + "\n")

    def _draw(self) -> None:
        line = f"  {self.bar}  {self.status}  {time.time() - self.started:5.0f}s"
        self._write("\r" + line.ljust(self._width))
        self._width = len(line)

    def _write(self, text: str) -> None:
        if not self.quiet:
            print(text, end="", flush=True)
        if text.endswith("\n"):
            self._width = 0


class Demo:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self._stack = contextlib.ExitStack()
        self.alerts: list[dict[str, Any]] = []
        self.fired_at: dict[str, float] = {}
        self.firing: set[str] = set()
        self.webhook: Webhook | None = None
        self.cut_at: float | None = None
        self.live = LiveLine(settings.quiet)

    def say(self, text: str) -> None:
        self.live.say(text)

    def _on_alert(self, notification: dict[str, Any]) -> None:
        for alert in notification.get("alerts", []):
            self.alerts.append(alert)
            name, status = alert.get("labels", {}).get("alertname", "?"), alert.get("status")
            if status == "firing":
                if name not in self.firing:
                    self.fired_at[name] = time.time()
                self.firing.add(name)
            else:
                self.firing.discard(name)
            self.say(f"  ALERT received by the webhook: {name} ({status}) "
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
            alertmanager = start_alertmanager(alertmanager_bin, work / "alertmanager", webhook.url,
                                              send_resolved=True)
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
            if s.training_seconds > s.duration:
                self.say(f"  the hub is cut {s.cut_after:.0f} s in for {s.outage_seconds:.0f} s: the job trains "
                         f"{s.training_seconds:.0f} s instead of {s.duration:.0f} s, to recover after it")
            started = self.live.started = time.time()
            trainer = subprocess.Popen(
                [sys.executable, "-m", "stallwatch.demo.trainer", "--spoke", spoke.url(), "--shards", str(s.shards),
                 "--batch-size", str(s.batch_size), "--workers", str(s.workers), "--step-seconds",
                 str(s.step_seconds), "--duration", str(s.training_seconds), "--trace", str(work / "gpu.trace"),
                 "--job", JOB],
                stdout=subprocess.PIPE, stderr=(work / "trainer.log").open("w"), text=True,
                env=dict(os.environ, STALLWATCH_SOCKET=str(work / "events.sock")),
            )
            self._stack.callback(stop_process, trainer)
            self._follow(trainer, agent_url, hub)
            ended = time.time()
            time.sleep(s.window_seconds + CorrelatorSettings().lateness_s + 2)  # the last windows close, get scraped
            if s.outage and self.webhook is not None and not self.alerts:
                self.say("  waiting for the stall alert to travel through Prometheus and Alertmanager")
                deadline = time.monotonic() + ALERT_GRACE_SECONDS
                while not self.alerts and time.monotonic() < deadline:
                    time.sleep(0.5)
            metrics = scrape(agent_url)
            self.say(f"final: {status_line([(time.time(), metrics)])}")
            if while_running is not None:
                while_running(prometheus.url if prometheus else None, agent_url)
            report_path = work / "report.html"
            run = (run_from_prometheus(prometheus.url, started, ended) if prometheus
                   else run_from_windows(work / "windows.jsonl"))
            report_path.write_text(render_html(run, s.price_per_gb))
            self.say(f"alerts received: {sorted({a['labels']['alertname'] for a in self.alerts}) or 'none'}")
            self.say(f"report: {report_path}")
            return Outcome(report_path, work / "windows.jsonl", list(self.alerts), metrics,
                           prometheus.url if prometheus else None, started, ended, self.cut_at, dict(self.fired_at))

    def _follow(self, trainer: subprocess.Popen[str], agent_url: str, hub: Hub) -> None:
        """Show a progress bar per epoch with the live status (`status_line`), until the trainer exits."""
        stop = threading.Event()
        threading.Thread(target=self._refresh, args=(agent_url, hub, stop), daemon=True).start()
        assert trainer.stdout is not None
        try:
            for line in trainer.stdout:
                match = PROGRESS.match(line)
                if match:
                    self.live.progress(*(int(g) for g in match.groups()))
        finally:
            stop.set()
            trainer.wait(timeout=60)

    def _refresh(self, agent_url: str, hub: Hub, stop: threading.Event) -> None:
        """Every second: cut the hub when its time comes, scrape the agent and redraw the live line."""
        s = self.s
        cut_at = self.live.started + s.cut_after if s.outage else None
        recent: list[Scrape] = []
        while not stop.wait(1.0):
            if cut_at is not None and time.time() >= cut_at:
                hub.cut_for(s.outage_seconds)
                self.cut_at, cut_at = time.time(), None
                self.say(f"  hub cut for {s.outage_seconds:.0f} s (emulated region-link outage)")
            with contextlib.suppress(OSError, ValueError):
                recent = [*recent[1 - RECENT_SCRAPES:], (time.time(), scrape(agent_url))]
                self.live.show(status_line(recent, self.firing))


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

