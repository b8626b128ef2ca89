"""`stallwatch demo --nodes 2`: a multi-node data-parallel job on one machine, for real.

Each emulated node has its own nginx spoke in front of the one hub and its own agent (events socket,
port, fake GPUs, node name); one Prometheus scrapes them all with the generated rules. One job of
`ranks_per_node` ranks per node (`ddp_trainer`: gloo on CPU, a real all-reduce per step) reads its
shards through its node's spoke. The first nodes' spokes are warmed before the job; the last node's is
cold and keeps a shard only a second (as a cache far smaller than the working set would: nginx enforces
`max_size` too lazily to show it), so its ranks wait on the hub and every rank of the job waits for them
in the all-reduce.

The scenario knows its ground truth: every rank records each step's loader wait, compute and all-reduce.
The job's loss is its step time minus its compute-plus-collective time on every GPU; the demo sets the
job-level cost Prometheus's recording rules give against it, over the same wall-clock interval.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from stallwatch import catalogue as c
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.demo.agent import AgentSetup, start_node_agent
from stallwatch.demo.alerting import AlertWatch
from stallwatch.demo.hub import Hub, HubSettings, shard_name, start_hub
from stallwatch.demo.live import LiveLine
from stallwatch.demo.outputs import files_left, write_report
from stallwatch.demo.spoke import Nginx, spoke_server_block
from stallwatch.demo.stack import Server, query, start_prometheus
from stallwatch.harness import find_binary, free_port, stop_process, wait_for
from stallwatch.mixin import rules
from stallwatch.mixin.alerts import render_alerting_rules
from stallwatch.mixin.config import Thresholds, correlator_lag, duration_seconds
from stallwatch.mixin.prometheus import RuleGroup, render_rules
from stallwatch.mixin.rules import render_recording_rules
from stallwatch.prices import Prices

JOB = "demo"
J = c.JOB_LABEL
SCRAPE_INTERVAL_SECONDS = 1  # Prometheus scrapes the agents and evaluates the rules every second
ALERT_DELIVERY_SECONDS = 10.0  # Alertmanager waits a second to group, then sends
STEADY_FROM = 0.2  # the share of steps left out at the start: rendezvous, first batches, the series' first scrape


def node_name(index: int) -> str:
    return f"node-{chr(ord('a') + index)}"


@dataclass
class ClusterSettings(HubSettings):
    nodes: int = 2
    ranks_per_node: int = 2
    steps: int = 240
    shards: int = 64
    shard_mib: float = 0.5
    rtt_seconds: float = 0.05
    bandwidth_mbit: float = 20.0
    step_seconds: float = 0.1
    workers: int = 2
    batch_size: int = 2
    window_seconds: float = 2.0
    lateness_seconds: float = 1.0
    job_stall_window_seconds: int = 10  # the job-level rules' sub-window (ten scrapes)
    prices: Prices = field(default_factory=Prices)  # the report's
    workdir: Path = field(default_factory=lambda: Path("stallwatch-demo"))
    quiet: bool = False

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def correlator(self) -> CorrelatorSettings:
        """The agents' correlator settings: these windows and lateness, the rest the agent's defaults."""
        return CorrelatorSettings(window_s=self.window_seconds, lateness_s=self.lateness_seconds)

    def thresholds(self) -> Thresholds:
        """The generated rules with windows a run of a minute fills (scrapes and evaluations every second),
        reading the correlator's series as far back as this demo's correlator settings ask."""
        scrape = f"{SCRAPE_INTERVAL_SECONDS}s"
        return Thresholds(rate_window="30s", job_stall_window=f"{self.job_stall_window_seconds}s",
                          node_stall_cost_for="10s", agent_scrape_interval=scrape,
                          correlator_lag=correlator_lag(self.correlator(), scrape))

    def dashboard_thresholds(self) -> Thresholds:
        """The job rules over the sub-window the shipped dashboards query (their names carry it, `rate1m`), on
        this demo's scrapes and correlator, beside the short sub-window the demo measures with."""
        scrape = f"{SCRAPE_INTERVAL_SECONDS}s"
        return Thresholds(agent_scrape_interval=scrape, correlator_lag=correlator_lag(self.correlator(), scrape))

    def dashboard_rules(self) -> str:
        """The dashboards' job rules, less those whose names have no sub-window: `thresholds()` records them."""
        own = {rule.record for rule in rules.job_rules(self.thresholds())}
        recorded = tuple(rule for rule in rules.job_rules(self.dashboard_thresholds()) if rule.record not in own)
        return render_rules((RuleGroup("stallwatch-job-dashboards.recording", recorded),), "",
                            "stallwatch/demo/cluster.py")

    def rules_lag_seconds(self) -> float:
        """How far the job rules' recorded series lag the stalls they count: they read `correlator_lag`
        back, and a rate over the sub-window stands for its middle."""
        return duration_seconds(self.thresholds().correlator_lag) + self.job_stall_window_seconds / 2


@dataclass(frozen=True)
class Step:
    end: float
    wait: float
    compute: float
    allreduce: float


def read_timings(directory: Path, world: int) -> list[list[Step]]:
    """Per rank, its steps in order, as `ddp_trainer` recorded them."""
    return [[Step(r["end"], r["wait"], r["compute"], r["allreduce"])
             for r in map(json.loads, (directory / f"rank-{rank}.jsonl").read_text().splitlines())]
            for rank in range(world)]


def ground_truth_loss(ranks: list[list[Step]], first: int, last: int) -> float:
    """GPU-seconds the job lost in steps `first` to `last`: on every GPU, the step's time minus the job's compute
    (its slowest rank's: no rank can go on before it) and the collective's own time (the all-reduce of the
    last rank to arrive, who waits for nobody)."""
    lost = 0.0
    for k in range(first, last + 1):
        step = sum(r[k].end - r[k - 1].end for r in ranks) / len(ranks)
        compute = max(r[k].compute for r in ranks)
        collective = min(r[k].allreduce for r in ranks)
        lost += len(ranks) * (step - compute - collective)
    return lost


@dataclass(frozen=True)
class ClusterOutcome:
    prometheus: str
    started: float  # the steady interval the figures cover, Unix seconds
    ended: float
    at: float  # the evaluation time matching it: ended plus the rules' lag
    truth_gpu_seconds: float
    estimate_gpu_seconds: float
    per_node_gpu_seconds: dict[str, float]  # the node's own ranks' stall seconds: what a per-node view shows
    gating_node: str
    gating_cause: str
    alerts: list[dict[str, str]]  # firing in Prometheus
    delivered: list[str] = field(default_factory=list)  # the alerts the webhook heard from Alertmanager
    report: Path | None = None

    @property
    def error(self) -> float:
        return (self.estimate_gpu_seconds - self.truth_gpu_seconds) / self.truth_gpu_seconds


def _values(reply: dict[str, object]) -> list[tuple[dict[str, str], float]]:
    data = reply.get("data")
    if reply.get("status") != "success" or not isinstance(data, dict):
        raise RuntimeError(f"a query failed: {reply}")
    return [(r["metric"], float(r["value"][1])) for r in data["result"]]


class ClusterDemo:
    def __init__(self, settings: ClusterSettings) -> None:
        self.s = settings
        self._stack = contextlib.ExitStack()
        self.live = LiveLine(settings.quiet)
        self.watch = AlertWatch(self.say)

    def say(self, text: str) -> None:
        self.live.say(text)

    def _start_node(self, work: Path, index: int, hub: Hub) -> tuple[Nginx, str]:
        s = self.s
        cold = index == s.nodes - 1
        cache = int(s.dataset_bytes * 2)
        name = node_name(index)
        spoke = Nginx(work / name / "spoke", spoke_server_block(hub.url, valid="1s" if cold else None),
                      f"{cache // 2**20}m")
        self._stack.callback(spoke.close)
        if not cold:
            with ThreadPoolExecutor(4) as pool:  # warm the spoke: every shard once
                list(pool.map(lambda i: urllib.request.urlopen(spoke.url(f"/{shard_name(i)}"), timeout=120).read(),
                              range(s.shards)))
        agent = start_node_agent(self._stack, AgentSetup(
            work / name, spoke.access_log, f"spoke-{name.removeprefix('node-')}", hub.url, cache, s.window_seconds,
            gpus=s.ranks_per_node, lateness_seconds=s.lateness_seconds, dataset_bytes=s.dataset_bytes)).url
        self.say(f"  {name}       agent {agent}, spoke {spoke.url()} ({cache / 2**20:.0f} MiB, "
                 f"{'cold, keeps a shard 1 s' if cold else 'warm'})")
        return spoke, agent

    def _start_prometheus(self, work: Path, agents: Sequence[str]) -> Server:
        binary = find_binary("prometheus")
        if binary is None:
            raise RuntimeError("the multi-node demo needs Prometheus (Debian's prometheus package)")
        t = self.s.thresholds()
        rule_files = [work / "recording-rules.yaml", work / "dashboard-rules.yaml", work / "alerting-rules.yaml"]
        rule_files[0].write_text(render_recording_rules(t))
        rule_files[1].write_text(self.s.dashboard_rules())
        rule_files[2].write_text(render_alerting_rules(t))
        alertmanager = self.watch.start(self._stack, work)
        targets = [url.split("//")[1].split("/", maxsplit=1)[0] for url in agents]
        prometheus = start_prometheus(binary, work / "prometheus", targets, rule_files, alertmanager,
                                      job=t.agent_scrape_job,
                                      interval_seconds=SCRAPE_INTERVAL_SECONDS,
                                      node_names={target: node_name(i) for i, target in enumerate(targets)})
        self._stack.callback(prometheus.close)
        wait_for("the first scrape of every agent",
                 lambda: len(_values(query(prometheus.url, "up == 1"))) == len(targets), 30,
                 prometheus.process, prometheus.log)
        self.say(f"  prometheus   {prometheus.url}")
        return prometheus

    def _start_ranks(self, work: Path, spokes: Sequence[Nginx]) -> list[subprocess.Popen[str]]:
        s = self.s
        master = f"tcp://127.0.0.1:{free_port()}"
        (work / "timings").mkdir()
        ranks = []
        for rank in range(s.world):
            node, local = divmod(rank, s.ranks_per_node)
            node_work = work / node_name(node)
            command = [
                sys.executable, "-m", "stallwatch.demo.ddp_trainer", "--spoke", spokes[node].url(),
                "--shards", str(s.shards), "--batch-size", str(s.batch_size), "--workers", str(s.workers),
                "--step-seconds", str(s.step_seconds), "--steps", str(s.steps), "--rank", str(rank),
                "--world", str(s.world), "--local-rank", str(local), "--master", master, "--job", JOB,
                "--timings", str(work / "timings" / f"rank-{rank}.jsonl"), "--trace", str(node_work / "gpu.trace"),
            ]
            log = (work / "timings" / f"rank-{rank}.log").open("w")
            process = subprocess.Popen(command, stdout=subprocess.PIPE if rank == 0 else log, stderr=log, text=True,
                                       env=dict(os.environ, STALLWATCH_SOCKET=str(node_work / "events.sock")))
            self._stack.callback(stop_process, process)
            ranks.append(process)
        return ranks

    def _follow(self, ranks: list[subprocess.Popen[str]], prometheus: str) -> None:
        assert ranks[0].stdout is not None
        cost = rules.job_stall_rule(self.s.thresholds()).record
        shown = 0.0
        self.live.begin()
        for line in ranks[0].stdout:
            if not self.s.quiet and time.monotonic() - shown > 2:
                shown = time.monotonic()
                lost = _values(query(prometheus, f'{cost}{{{J}="{JOB}"}}'))
                share = f"{lost[0][1]:4.0%}" if lost else "  - "
                self.live.show(f"GPU time lost to input stalls, whole job: {share}", f"{line.strip():>12}")
        self.live.close()
        for process in ranks:
            if process.wait(timeout=120) != 0:
                raise RuntimeError(f"a rank failed: see {self.s.workdir / 'timings'}")

    def measure(self, prometheus: str, ranks: list[list[Step]]) -> ClusterOutcome:
        """The job-level cost from the recording rules against the ground truth, over the steady steps."""
        s, t = self.s, self.s.thresholds()
        first = max(1, int(len(ranks[0]) * STEADY_FROM))
        started = max(r[first - 1].end for r in ranks)
        # A rate over a sub-window stands for its middle, so averaged over the interval it also takes in half a
        # sub-window on either side: the interval ends that much before the job does, as it starts after
        # the job started, so that both halves are of training.
        step_ends = [max(r[k].end for r in ranks) for k in range(len(ranks[0]))]
        last = max(k for k in range(first, len(step_ends))
                   if step_ends[k] <= step_ends[-1] - s.job_stall_window_seconds / 2)
        ended = step_ends[last]
        at = ended + s.rules_lag_seconds()
        span = f"{round((ended - started) * 1000)}ms"
        selected = f'{{{J}="{JOB}"}}'
        estimate = _values(query(prometheus, f"avg_over_time({rules.job_stall_gpu_seconds_rule(t).record}{selected}"
                                             f"[{span}])", at))
        nodes = _values(query(prometheus, f"avg_over_time({rules.node_stall_rule(t).record}{selected}[{span}])", at))
        per_node = _values(query(prometheus, f"sum by (node) (increase({c.STALL_SECONDS.name}{selected}[{span}]))",
                                 at))
        if not estimate or not nodes:
            raise RuntimeError("Prometheus has no job-level figures: did the agents see the job?")
        gate = max(nodes, key=lambda sample: sample[1])[0]["node"]
        causes = _values(query(prometheus, f"sum by (cause) (avg_over_time("
                                           f"{rules.rank_cause_stall_rule(t).record}{{{J}=\"{JOB}\", node=\"{gate}\"}}"
                                           f"[{span}]))", at))
        alerts = _values(query(prometheus, 'ALERTS{alertstate="firing"}'))
        return ClusterOutcome(
            prometheus, started, ended, at, ground_truth_loss(ranks, first, last), estimate[0][1] * (ended - started),
            {labels["node"]: value for labels, value in per_node}, gate,
            max(causes, key=lambda sample: sample[1])[0]["cause"], [labels for labels, _ in alerts])

    def run(self, while_running: Callable[[ClusterOutcome], None] | None = None) -> ClusterOutcome:
        s = self.s
        with self._stack:
            work = s.workdir.resolve()
            hub = start_hub(self._stack, work, s)
            self.say(f"stallwatch demo, {s.nodes} nodes x {s.ranks_per_node} ranks, in {work}")
            self.say(f"  hub          {hub.url}  ({s.shards} shards, {s.dataset_bytes / 2**20:.0f} MiB)")
            spokes, agents = zip(*(self._start_node(work, i, hub) for i in range(s.nodes)), strict=True)
            prometheus = self._start_prometheus(work, agents)
            job_started = time.time()
            self._follow(self._start_ranks(work, spokes), prometheus.url)
            timings = read_timings(work / "timings", s.world)
            job_ended = max(r[-1].end for r in timings)
            time.sleep(max(0.0, job_ended + s.rules_lag_seconds() + s.job_stall_window_seconds - time.time()))
            outcome = self.measure(prometheus.url, timings)
            firing = {labels["alertname"] for labels in outcome.alerts}
            with contextlib.suppress(RuntimeError):  # said below: the alerts the webhook did hear
                wait_for("Alertmanager's delivery of the alerts firing", lambda: firing <= set(self.watch.names()),
                         ALERT_DELIVERY_SECONDS)
            outcome = dataclasses.replace(outcome, delivered=self.watch.names(), report=write_report(
                work / "report.html", job_started, job_ended, s.prices, prometheus.url, dataset_bytes=s.dataset_bytes))
            self.say(f"job lost {outcome.estimate_gpu_seconds:.1f} GPU-seconds to input stalls in "
                     f"{outcome.ended - outcome.started:.0f} s of steady training (recording rules); ground truth "
                     f"{outcome.truth_gpu_seconds:.1f} (error {outcome.error:+.1%})")
            self.say("per-node view (each node's own ranks' stall seconds): " + ", ".join(
                f"{node} {seconds:.1f}" for node, seconds in sorted(outcome.per_node_gpu_seconds.items())))
            self.say(f"gated by {outcome.gating_node} ({outcome.gating_cause}); alerts firing: "
                     f"{sorted(firing) or 'none'}, received by the webhook: {outcome.delivered or 'none'}")
            self.say(f"report: {outcome.report}")
            if while_running is not None:
                while_running(outcome)
            self.say(files_left(work))
            return outcome
