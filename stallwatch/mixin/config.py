"""What the generated rules and dashboards consider a problem, and the names they publish under.

The one place to tune the mixin: every threshold and `for` is a field of `Thresholds`, documented with its
default (the table in docs/runbooks.md is rendered from these fields); the names below are the conventions
every alert shares.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from stallwatch.correlator.settings import CorrelatorSettings

ALERT_PREFIX = "Stallwatch"  # CamelCase alert names share it, as monitoring mixins do
COMPONENT = "stallwatch"  # on every alert, for Alertmanager routes (deploy/alertmanager/alertmanager.yml)

_DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d)$")
UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}  # of a Prometheus duration


def duration_seconds(duration: str) -> float:
    """A Prometheus duration of one unit (`15s`, `1m`) in seconds."""
    match = _DURATION.match(duration)
    if match is None:
        raise ValueError(f"{duration!r} is not a Prometheus duration such as 5m")
    return int(duration.removesuffix(match[1])) * UNIT_SECONDS[match[1]]


def correlator_lag(settings: CorrelatorSettings, scrape_interval: str) -> str:
    """How long after its sample timestamp (its window's end) a correlator series can be read in Prometheus,
    at most, as a duration in whole seconds: the window closes the lateness after its end, or up to `gpu_gap`
    later while a GPU's next sample is awaited; the next scrape takes it. A stall under way no longer holds
    its window (its seconds are booked as they accrue: docs/attribution.md), so no window is allowed for the
    hold. Whole seconds strictly past the sum: the correlator closes windows on a 0.1 s tick and a scrape
    takes its own time, which a sum that is already whole would leave uncovered."""
    published = settings.lateness_s + settings.gpu_gap_s + duration_seconds(scrape_interval)
    return f"{math.floor(published) + 1}s"


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class Thresholds:
    """What the generated rules consider a problem, and for how long before they say so."""

    input_bound_ratio: float = field(default=0.20, metadata=_doc(
        "Share of step time spent waiting for input above which a job is input-bound. TensorFlow's "
        "input-pipeline analyzer calls 5-20 % 'moderately' and 20 % or more 'highly' input-bound."))
    input_bound_moderate_ratio: float = field(default=0.05, metadata=_doc(
        "The 'moderately input-bound' line drawn on dashboards (no alert)."))
    input_bound_for: str = field(default="15m", metadata=_doc("How long a job stays input-bound before the alert."))
    gpu_remote_fetch_idle_ratio: float = field(default=0.10, metadata=_doc(
        "Share of a job's GPU time spent idle while its ranks waited on reads that missed the spoke."))
    gpu_starved_for: str = field(default="10m", metadata=_doc("How long GPUs starve before the alert."))
    warmup_budget: str = field(default="30m", metadata=_doc(
        "Longest a job may stay cold or in transition (the warm-up's `for`)."))
    hit_ratio_drop: float = field(default=0.15, metadata=_doc(
        "Drop of a spoke's request hit ratio below its best of the baseline window that counts as a regression."))
    hit_ratio_steady: float = field(default=0.80, metadata=_doc(
        "Best hit ratio in the baseline window that shows the spoke had warmed up (regressions before that are "
        "warm-up, not regressions)."))
    hit_ratio_baseline_window: str = field(default="6h", metadata=_doc("Window the best hit ratio is taken over."))
    hit_ratio_for: str = field(default="10m", metadata=_doc("How long the regression lasts before the alert."))
    hub_error_ratio: float = field(default=0.05, metadata=_doc(
        "Share of hub fetches that fail (all of them when the hub is unreachable) while ranks stall."))
    hub_probe_failure_ratio: float = field(default=0.5, metadata=_doc(
        "Share of the node agents' probes of a hub over the rate window that failed, past which the hub counts as "
        "failing too: a hub that accepts connections and answers nothing fails no fetch until the spoke's own "
        "timeout (nginx: a minute or more), but its probes time out within seconds."))
    hub_failing_stall_ratio: float = field(default=0.05, metadata=_doc(
        "Share of its time a rank reading through a failing spoke must spend stalled for the hub alert to "
        "fire (5 %: TensorFlow's 'moderately input-bound')."))
    hub_failing_for: str = field(default="5m", metadata=_doc("How long the hub fails before the alert."))
    egress_price_usd_per_gb: float = field(default=0.02, metadata=_doc(
        "Price of one GB (10^9 bytes) fetched from the hub across regions; also the dashboards' default."))
    egress_budget_usd_per_hour: float = field(default=5.0, metadata=_doc(
        "Cross-region egress spend per hour, all spokes together, above which the alert fires."))
    egress_for: str = field(default="15m", metadata=_doc("How long spend stays over budget before the alert."))
    dropped_events_ratio: float = field(default=0.01, metadata=_doc(
        "Share of training-client events lost (by the client or the agent's receiver) that the alerts allow."))
    dropped_events_for: str = field(default="10m", metadata=_doc("How long events are lost before the alert."))
    agent_scrape_job: str = field(default="stallwatch", metadata=_doc(
        "The Prometheus scrape job (the `job` of `up`) of the node agents."))
    agent_down_for: str = field(default="5m", metadata=_doc("How long an agent is unreachable before the alert."))
    collector_failing_for: str = field(default="10m", metadata=_doc(
        "How long a collector (gpu is NVML) keeps failing before the alert."))
    gpus_seen_window: str = field(default="1h", metadata=_doc(
        "How far back a node that now reports no GPU at all must have had some for the driver-gone alert."))
    xid_page: tuple[int, ...] = field(default=(48, 64, 74, 79, 95, 119, 120), metadata=_doc(
        "XIDs that page (critical): those NVIDIA's XID catalogue attributes to hardware or the driver and "
        "answers with a GPU reset or node reboot. Every other XID is a warning."))
    xid_window: str = field(default="10m", metadata=_doc("Window in which an XID event alerts."))
    xid_for: str = field(default="1m", metadata=_doc("How long the XID alert is pending before it fires."))
    job_stall_window: str = field(default="1m", metadata=_doc(
        "Sub-window over which a synchronous job's input-stall loss is taken as its slowest rank's stall (the "
        "job-level recording rules): shorter is closer to the per-step maximum (docs/attribution.md), but it "
        "must span at least four scrapes of the agents."))
    node_stall_cost_ratio: float = field(default=0.10, metadata=_doc(
        "Share of a job's GPU time that the input stalls of one of its nodes may cost it (every GPU of the job "
        "waits for that node's slowest rank) before the alert fires."))
    node_stall_cost_for: str = field(default="10m", metadata=_doc(
        "How long one node's input stalls cost the job that share before the alert."))
    rate_window: str = field(default="5m", metadata=_doc("Window of the recording rules' rates."))
    agent_scrape_interval: str = field(default="15s", metadata=_doc(
        "How often Prometheus scrapes the agents (the chart's ServiceMonitor default); part of `correlator_lag`."))
    correlator_lag: str = field(default="", metadata=_doc(
        "How far back every recording rule reads the correlator's series (`offset`), so that every sample it "
        "reads has arrived: the correlator's samples carry their window's end but are "
        "scrapeable only this long after it. Empty: derived from the correlator's default lateness and GPU gap "
        "and `agent_scrape_interval` (`config.correlator_lag`); the recorded series lag the events by it."))
    runbook_base_url: str = field(default="docs/runbooks.md", metadata=_doc(
        "Where docs/runbooks.md is served; each alert's runbook_url is this plus the alert's anchor."))

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            derived = f.name == "correlator_lag" and not value
            if f.name.endswith(("_for", "_window", "_budget", "_interval", "_lag")) and not (
                    derived or _DURATION.match(value)):
                raise ValueError(f"{f.name}: {value!r} is not a Prometheus duration such as 5m")
            if f.name.endswith("_ratio") and not 0 <= value <= 1:
                raise ValueError(f"{f.name}: {value} is not a ratio between 0 and 1")
        if not self.correlator_lag:
            object.__setattr__(self, "correlator_lag", correlator_lag(CorrelatorSettings(), self.agent_scrape_interval))
        if not self.xid_page or not all(isinstance(x, int) and x > 0 for x in self.xid_page):
            raise ValueError(f"xid_page: {self.xid_page!r} is not a non-empty list of XID numbers")
