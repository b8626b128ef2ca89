"""The alerting rules (`alerts/alerting-rules.yaml`), each with its runbook, from the metric catalogue.

Every threshold and `for` comes from one `Thresholds` instance (`config.py`); alert names are CamelCase
with the shared `ALERT_PREFIX`. Where a recording rule exists the alert reads it (`rules.py`). The
runbook text of each alert is rendered into docs/runbooks.md (`runbooks.py`).

An alert that reads the correlator's series itself (the hub alert's stall share, the warm-up phase, the
count of a job's GPUs) reads them now, with no `offset`: unlike a recording rule it is evaluated again
at every evaluation, so a sample that arrives late counts from the next one on. The newest
`correlator_lag` of its window is still empty at each evaluation: a 5 min rate reads at most that share
(about 6 % with the defaults) low, and a condition holds at most that much later, for as long as it holds. An offset
would delay it by the whole lag instead.
"""

from __future__ import annotations

from stallwatch import catalogue as c
from stallwatch.mixin.config import ALERT_PREFIX, Thresholds
from stallwatch.mixin.prometheus import AlertRule, RuleGroup, render_rules
from stallwatch.mixin.promql import by, increase, rate, selector
from stallwatch.mixin.rules import gpu_stall_idle_rule, hit_ratio_rule, input_bound_rule, node_stall_rule

JOB = c.JOB_LABEL
JOB_NAME = f"{{{{ $labels.{JOB} }}}}"  # the training job's name in a description
# What each cause's stall seconds point at, for the runbooks: from the catalogue's table of causes.
_CAUSES_POINT_AT = "; ".join(f"`{cause.name}` points at {cause.points_at}" for cause in c.CAUSE_TABLE)
# Metrics an agent reports with the `spoke` it reads through: a spoke collector on the node, the hub
# probe, the correlator's what-if. They tie the node's training jobs to that spoke.
SPOKE_OF_NODE = (c.SPOKE_REQUESTS, c.SPOKE_HUB_ERRORS, c.SPOKE_NFS_READ_OPERATIONS, c.SPOKE_HUB_PROBE_SUCCESS,
                 c.CACHE_WHATIF_HIT_RATIO)


def _share(part: str, rest: str) -> str:
    """part / (part + rest), where a missing rest (nothing ever succeeded) counts as zero, so the share is 1."""
    return f"{part} / ({part} + ({rest} or {part} * 0))"


def _lost_ratio(lost: c.AnyMetricDef, window: str) -> str:
    """Share of training-client events lost per node: lost / (lost + accepted)."""
    return _share(by("instance", "sum", rate(lost, window)), by("instance", "sum", rate(c.RECEIVER_EVENTS, window)))


def _stall_share_by_spoke(t: Thresholds) -> str:
    """Per spoke, the largest share of time a rank on a node reading through it spends stalled (any cause)."""
    per_rank = by(f"instance, {JOB}, rank", "sum", rate(c.STALL_SECONDS, t.rate_window))
    worst_on_node = by("instance", "max", per_rank)
    spoke_of_node = " or ".join(by("instance, spoke", "group", selector(m)) for m in SPOKE_OF_NODE)
    return by("spoke", "max", f"{worst_on_node} * on (instance) group_right () ({spoke_of_node})")


def training_alerts(t: Thresholds) -> tuple[AlertRule, ...]:
    remote_idle = by(JOB, "sum", gpu_stall_idle_rule(t).record + f'{{cause="{c.REMOTE_FETCH.name}"}}')
    not_steady = by(JOB, "max", selector(c.WARMUP_PHASE, 'phase!="steady"'))
    gpus_per_job = by(JOB, "count", by(f"{JOB}, instance, gpu", "group", selector(c.GPU_STALL_IDLE_SECONDS)))
    return (
        AlertRule(
            name=f"{ALERT_PREFIX}GPUsStarvedByRemoteFetches",
            expr=f"{remote_idle} / on ({JOB}) {gpus_per_job} > {t.gpu_remote_fetch_idle_ratio}",
            for_=t.gpu_starved_for, severity="warning",
            summary="GPUs sit idle while training waits on reads that missed the spoke.",
            description=f"GPUs of job {JOB_NAME} spent {{{{ $value | humanizePercentage }}}} of their time idle "
                        "during stalls attributed to remote fetches from the hub.",
            runbook="The correlator saw the job's GPUs idle while its ranks waited for batches whose critical "
                    "path went through reads that missed the spoke and went to the hub, or that failed there and "
                    "were being retried (a loader's back-off between failed fetches counts as waiting on the hub)."
                    "\n\n"
                    "Check: the *Training input stalls* dashboard (stall seconds by cause, GPU idle by cause), "
                    "then the *Spoke cache* dashboard: is the hit ratio low (cold or too small a cache, see the "
                    "what-if panel), is hub latency high, or is the hub failing "
                    "(`StallwatchHubFailingWhileTrainingStalls`, the *Hub fetch errors* panel)?\n\n"
                    "Act: pre-warm the spoke before the job, grow the cache if the what-if curve says a bigger one "
                    "would hit, raise loader workers or `prefetch_factor` to hide hub latency.",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}TrainingInputBound",
            expr=f"{input_bound_rule(t).record} >= {t.input_bound_ratio}",
            for_=t.input_bound_for, severity="warning",
            summary="Training spends a large share of its step time waiting for input.",
            description=f"Job {JOB_NAME} waits for input {{{{ $value | humanizePercentage }}}} of its step "
                        "time (highly input-bound).",
            runbook="The job's stall seconds divided by its stall plus compute seconds, over its ranks and the "
                    "rate window, is above the threshold: the input "
                    "pipeline, not the model, sets the pace (TensorFlow's input-pipeline analyzer calls 20 % or "
                    "more 'highly input-bound').\n\n"
                    f"Check: *Training input stalls*: which cause dominates the stall seconds. {_CAUSES_POINT_AT}"
                    ".\n\n"
                    "Act: for preprocessing, more workers or cheaper transforms; for delivery, smaller batch "
                    "payloads, tensors (shared memory) rather than Python objects, fewer copies; for storage, see "
                    f"[{ALERT_PREFIX}GPUsStarvedByRemoteFetches](#{ALERT_PREFIX.lower()}gpusstarvedbyremotefetches).",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}WarmupOverBudget",
            expr=f"{not_steady} == 1",
            for_=t.warmup_budget, severity="warning",
            summary="A job's warm-up takes longer than its budget.",
            description=f"Job {JOB_NAME} has not reached steady state within {t.warmup_budget}.",
            runbook="The correlator still sees the job cold or in transition (hit ratio or step time not yet "
                    "stable) after the warm-up budget.\n\n"
                    "Check: the warm-up phase timeline and the warm-up cost panels on *Training input stalls*; "
                    "the hit ratio and cache size on *Spoke cache*: a cache smaller than the working set never "
                    "warms up (it thrashes: evictions stay high).\n\n"
                    "Act: pre-warm the spoke, grow it to the working set, or raise the budget if the dataset is "
                    "read once per epoch and the first epoch is long.",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}NodeStallsCostJob",
            expr=f"avg_over_time({node_stall_rule(t).record}[{t.rate_window}]) > {t.node_stall_cost_ratio}",
            for_=t.node_stall_cost_for, severity="warning",
            summary="Input stalls on one node idle every GPU of a multi-node job.",
            description=f"Input stalls on node {{{{ $labels.node }}}} cost job {JOB_NAME} "
                        "{{ $value | humanizePercentage }} of its GPU time: all of its GPUs wait for that node's "
                        "slowest rank.",
            runbook="In synchronous data-parallel training every rank waits in the step's collective for the "
                    "slowest one, so one node's input stall idles every GPU of the job, on every node. The value "
                    "is the share of time in which some rank of the job on this node stalled for input (its agent "
                    "counts the union of their stalls): what the node alone costs the job's GPU time.\n\n"
                    "Check: the *Job across nodes* row of *Training input stalls*: the gating node and rank and the "
                    f"cause of their stalls, on that node. {_CAUSES_POINT_AT} (for the spoke, the *Spoke cache* "
                    "dashboard).\n\n"
                    "Act: warm or grow that node's spoke, give the node's ranks more loader workers, or move the "
                    "job off the node; the other nodes are waiting, not at fault.",
        ),
    )


def spoke_alerts(t: Thresholds) -> tuple[AlertRule, ...]:
    ratio = hit_ratio_rule(t).record
    best = f"max_over_time({ratio}[{t.hit_ratio_baseline_window}])"
    hub_errors = by("spoke", "sum", rate(c.SPOKE_HUB_ERRORS, t.rate_window))
    hub_fetches = by("spoke", "sum", rate(c.SPOKE_HUB_FETCH_DURATION, t.rate_window, suffix="_count"))
    # The share of a window's probes that failed: each scrape reads the last probe's result.
    probe_success = f"avg_over_time({selector(c.SPOKE_HUB_PROBE_SUCCESS)}[{t.rate_window}])"
    probes_failed = f"1 - {by('spoke', 'avg', probe_success)}"
    failing = (f"({_share(hub_errors, hub_fetches)} > {t.hub_error_ratio}) "
               f"or ({probes_failed} > {t.hub_probe_failure_ratio})")
    stalling = f"{_stall_share_by_spoke(t)} > {t.hub_failing_stall_ratio}"
    hub_bytes = by("", "sum", increase(c.SPOKE_BYTES, "1h", 'source="hub"'))
    egress_usd = f"{hub_bytes} / 1e9 * {t.egress_price_usd_per_gb}"
    return (
        AlertRule(
            name=f"{ALERT_PREFIX}SpokeHitRatioRegressed",
            # Not while its hub fails: its misses then end in errors, the hub is out and the cache lost nothing, and
            # the failing-hub alert says so.
            expr=f"({ratio} < {best} - {t.hit_ratio_drop}) and ({best} >= {t.hit_ratio_steady}) "
                 f"unless on (spoke) ({failing})",
            for_=t.hit_ratio_for, severity="warning",
            summary="A warmed-up spoke's hit ratio fell well below its best.",
            description="Spoke {{ $labels.spoke }} serves only {{ $value | humanizePercentage }} of requests from "
                        f"cache, {t.hit_ratio_drop:.0%} or more below its best of the last "
                        f"{t.hit_ratio_baseline_window}.",
            runbook="After reaching a steady hit ratio the spoke now misses much more: evictions (the working "
                    "set outgrew the cache, or another job shares it), a new dataset or shard order, or the "
                    "cache was flushed or restarted. It stays quiet while the spoke's hub is failing (its misses "
                    "then end in errors: that is the failing-hub alert's).\n\n"
                    "Check: *Spoke cache*: evictions, cache size against capacity, the what-if hit ratio at "
                    "larger capacities; on *Training input stalls*, whether jobs fell out of steady state.\n\n"
                    "Act: grow the cache if the what-if curve says it would help; separate jobs that thrash a "
                    "shared spoke; check the cache's own logs for restarts.",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}HubFailingWhileTrainingStalls",
            expr=f"({failing}) and on (spoke) ({stalling})",
            for_=t.hub_failing_for, severity="critical",
            summary="The hub is unreachable or failing while training ranks stall.",
            description="Spoke {{ $labels.spoke }}: {{ $value | humanizePercentage }} of fetches from the hub (or of "
                        "the nodes' probes of it) fail while training ranks reading through it stall.",
            runbook="Fetches from the spoke to the hub fail (upstream errors, timeouts, refused connections), or "
                    f"more than {t.hub_probe_failure_ratio:.0%} of the node agents' probes of the hub do (a hub "
                    "that accepts connections and answers nothing fails no fetch until the spoke gives up, "
                    "minutes later), and "
                    "the training ranks reading through that spoke are stalling: every miss now blocks a loader "
                    f"worker. A rank reads through the spoke when its node's agent reports that spoke (a spoke "
                    f"collector, the hub probe or the correlator's what-if); the alert needs one such rank "
                    f"stalled {t.hub_failing_stall_ratio:.0%} of its time or more, so a failing hub that no "
                    "training waits on stays a dashboard matter.\n\n"
                    "Check: *Spoke cache*: hub errors, hub round trip and fetch latency; the hub's own status and "
                    "the network path between regions.\n\n"
                    "Act: restore the hub or the link; until then jobs run only on what the spoke holds.",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}EgressOverBudget",
            expr=f"{egress_usd} > {t.egress_budget_usd_per_hour}",
            for_=t.egress_for, severity="warning",
            summary="Cross-region egress from the hub costs more than its budget.",
            description="Spokes fetched {{ $value | printf \"%.2f\" }} USD of data from the hub in the last hour "
                        f"(budget {t.egress_budget_usd_per_hour} USD per hour at {t.egress_price_usd_per_gb} USD/GB).",
            runbook="Bytes the spokes fetched from the hub in the last hour, priced per GB, exceed the hourly "
                    "budget: the caches miss more than planned, or more jobs read remotely.\n\n"
                    "Check: *Spoke cache*: hub bytes and egress cost per spoke, hit ratio by bytes (large objects "
                    "missing cost more than the request hit ratio shows).\n\n"
                    "Act: grow or pre-warm the spoke that fetches most; schedule jobs near their data.",
        ),
    )


def node_alerts(t: Thresholds) -> tuple[AlertRule, ...]:
    return (
        AlertRule(
            name=f"{ALERT_PREFIX}ClientDroppingEvents",
            expr=f"{_lost_ratio(c.CLIENT_DROPPED_EVENTS, t.rate_window)} > {t.dropped_events_ratio}",
            for_=t.dropped_events_for, severity="warning",
            summary="Training clients cannot deliver their events to the node agent.",
            description="Training clients on {{ $labels.instance }} dropped {{ $value | humanizePercentage }} of "
                        "their events: stall attribution there is incomplete.",
            runbook="The stallwatch client in training processes could not send events (agent absent, socket "
                    "directory not shared, or the agent too slow to drain the socket) and counted them.\n\n"
                    "Check: that the agent runs on the node and shares the socket directory with the training "
                    "pods; the receiver's batch counters on the *GPU node* dashboard.\n\n"
                    "Act: fix the shared directory or the agent; training itself is never blocked by this.",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}ReceiverDroppingEvents",
            expr=f"{_lost_ratio(c.RECEIVER_DROPPED_EVENTS, t.rate_window)} > {t.dropped_events_ratio}",
            for_=t.dropped_events_for, severity="warning",
            summary="The node agent drops events it received from training clients.",
            description="The agent on {{ $labels.instance }} dropped {{ $value | humanizePercentage }} of the "
                        "events it received (queue full or rejected batches).",
            runbook="The agent's receiver dropped events after receiving them: its queue was full (the correlator "
                    "falls behind) or batches failed validation (a client of another version).\n\n"
                    "Check: the `reason` label of the receiver's dropped-events counter; the agent's CPU.\n\n"
                    "Act: give the agent more CPU, or align client and agent versions.",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}AgentDown",
            expr=f'up{{job="{t.agent_scrape_job}"}} == 0',
            for_=t.agent_down_for, severity="warning",
            summary="Prometheus cannot scrape a stallwatch node agent.",
            description="The stallwatch agent at {{ $labels.instance }} has been unreachable for "
                        f"{t.agent_down_for}.",
            runbook="Prometheus's scrape of the agent fails: the agent pod is down, crash-looping, or its port is "
                    "not reachable.\n\n"
                    "Check: the DaemonSet's pod on that node, its logs (a bad flag or config is a one-line error "
                    "and exit code 2), and the target's error on Prometheus's targets page.\n\n"
                    "Act: fix the configuration or restart the pod; training is not affected, only observed less.",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}CollectorFailing",
            expr=by("instance, collector", "min", selector(c.SCRAPE_COLLECTOR_SUCCESS)) + " == 0",
            for_=t.collector_failing_for, severity="warning",
            summary="A collector of a stallwatch agent fails on every scrape.",
            description="Collector {{ $labels.collector }} on {{ $labels.instance }} fails (for `gpu`: NVML).",
            runbook="One collector raised while producing its metrics; the rest of the agent serves on. For `gpu` "
                    "this means NVML failed: driver upgraded under the agent, device lost, or the library missing "
                    "from the container.\n\n"
                    "Check: the agent's log for the collector's error; for `gpu`, the NVML errors panel of the "
                    "*GPU node* dashboard and `nvidia-smi` on the node.\n\n"
                    "Act: fix the cause and restart the agent (NVML is initialised once).",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}GPUsUnreachable",
            # A lost GPU keeps its gpu_up series at 0; a driver gone leaves no GPU at all where there were
            # some within gpus_seen_window. A GPU taken out on purpose leaves both quiet at once: its series
            # end and the device count drops. The gpu collector itself keeps succeeding through these faults,
            # so CollectorFailing does not see them; a node that never had GPUs stays quiet.
            expr=f"{by('instance', 'count', selector(c.GPU_UP) + ' == 0')} or ("
                 f"{by('instance', 'max', f'max_over_time({selector(c.GPU_DEVICES)}[{t.gpus_seen_window}])')} > 0 "
                 f"and on (instance) {by('instance', 'max', selector(c.GPU_DEVICES))} == 0)",
            for_=t.collector_failing_for, severity="critical",
            summary="GPUs of a node stopped answering NVML.",
            description="{{ $value }} GPUs on {{ $labels.instance }} do not answer NVML (a GPU lost, or the driver "
                        "gone).",
            runbook="NVML stopped answering for some GPUs (`GpuIsLost`: fell off the bus, XID 79) or for all of "
                    "them (the driver was unloaded or upgraded under the agent). The agent serves everything "
                    f"else; `{c.GPU_NVML_ERRORS.name}` says which call failed with which error. A GPU removed on "
                    "purpose (the node rebooted or the driver reloaded with fewer GPUs) does not alert.\n\n"
                    f"Check: `{c.GPU_UP.name}` per GPU, the NVML errors panel of the *GPU node* dashboard, "
                    "`nvidia-smi` and the kernel log on the node.\n\n"
                    "Act: drain the node and reset or replace a lost GPU; after a driver change restart the agent.",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}GPUXidErrors",
            expr=_xid_increase(t, "=~") + " > 0",
            for_=t.xid_for, severity="critical",
            summary="A GPU reported an XID that NVIDIA documents as a hardware or driver fault.",
            description="GPU {{ $labels.gpu }} on {{ $labels.instance }} reported XID {{ $labels.xid }}, a hardware "
                        f"or driver fault: {{{{ $value }}}} in the last {t.xid_window}.",
            runbook="The driver reported an XID that NVIDIA's XID catalogue attributes to the hardware or the "
                    "driver, never to the application, and for which it asks for a GPU reset or a node reboot: "
                    "48 (double-bit ECC error), 64 (page retirement or row remapping failed), 74 (NVLink "
                    "error), 79 (GPU fell off the bus), 95 (uncontained ECC error), 119 and 120 (GSP timeout "
                    f"or error). The list is `Thresholds.xid_page`: {', '.join(map(str, t.xid_page))}.\n\n"
                    "Check: the node's kernel log (`NVRM: Xid`), the *GPU node* dashboard's XID, NVML and "
                    "throttle panels, `nvidia-smi -q` for ECC and remapped rows.\n\n"
                    "Act: drain the node, reset the GPU (or reboot); replace a GPU that repeats it.",
        ),
        AlertRule(
            name=f"{ALERT_PREFIX}GPUXidWarnings",
            expr=_xid_increase(t, "!~") + " > 0",
            for_=t.xid_for, severity="warning",
            summary="A GPU reported an XID that is usually the application's or can wait for a reset.",
            description="GPU {{ $labels.gpu }} on {{ $labels.instance }} reported XID {{ $labels.xid }}: "
                        f"{{{{ $value }}}} in the last {t.xid_window}.",
            runbook="Every other XID the driver reports as critical. The common ones are the application's: 13 "
                    "(graphics engine exception), 31 (GPU memory page fault), 43 (GPU stopped processing), "
                    "45 (preemptive cleanup after another error); NVIDIA's device plugin keeps a GPU healthy "
                    "through them. Hardware XIDs after which NVIDIA says work may go on until a convenient "
                    "reset land here too: 63 (row remapping recorded), 92 (high single-bit ECC rate), 94 "
                    "(contained ECC error: only the application that hit it must restart).\n\n"
                    "Check: NVIDIA's XID catalogue for the number, the job that ran on the GPU at that time and "
                    "its log (an illegal memory access, an out-of-range index), the *GPU node* dashboard.\n\n"
                    "Act: fix or restart the job; for 63, 92 and 94 reset the GPU at the next drain and watch "
                    "for repeats.",
        ),
    )


def _xid_increase(t: Thresholds, operator: str) -> str:
    """XID events per GPU and XID over xid_window, for the XIDs in (=~) or not in (!~) Thresholds.xid_page."""
    xids = "|".join(map(str, t.xid_page))
    return by("instance, gpu, xid", "sum", increase(c.GPU_XID_ERRORS, t.xid_window, f'xid{operator}"{xids}"'))


def alerting_groups(t: Thresholds) -> tuple[RuleGroup, ...]:
    return (
        RuleGroup("stallwatch-training.alerts", training_alerts(t)),
        RuleGroup("stallwatch-spoke.alerts", spoke_alerts(t)),
        RuleGroup("stallwatch-node.alerts", node_alerts(t)),
    )


def all_alerts(t: Thresholds) -> tuple[AlertRule, ...]:
    return tuple(r for g in alerting_groups(t) for r in g.rules if isinstance(r, AlertRule))


def render_alerting_rules(t: Thresholds | None = None) -> str:
    t = t or Thresholds()
    return render_rules(alerting_groups(t), t.runbook_base_url, "stallwatch/mixin/alerts.py")
