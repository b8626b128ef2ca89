"""The three Grafana dashboards (`dashboards/*.json`), declared as tables of panels over the metric catalogue.

Each panel says which question it answers; docs/dashboards.md is rendered from the same declarations.
Selectors use the dashboard variables `$cluster`, `$job` (the training job), `$node` (the node name the
scrape adds as `node`, as the Helm chart's ServiceMonitor and deploy/prometheus/ do), `$gpu` and
`$spoke`, chained as the Kubernetes mixins chain theirs: cluster -> job -> node -> GPU. Series keep the
scrape's `instance` in their aggregations (it is unique) but are labelled by `node`. Rates use Grafana's
`$__rate_interval`, totals over the visible range `$__range`.
"""

from __future__ import annotations

from collections.abc import Callable

from stallwatch import catalogue as c
from stallwatch.mixin import promql, rules
from stallwatch.mixin.config import Thresholds
from stallwatch.mixin.grafana import (
    Annotation,
    Dashboard,
    Panel,
    Query,
    Row,
    Variable,
    Viz,
    render_json,
    render_markdown,
)
from stallwatch.mixin.prometheus import RecordingRule
from stallwatch.mixin.promql import by, quantile

J = c.JOB_LABEL
CLUSTER, JOB, NODE, GPU, SPOKE = ('cluster=~"$cluster"', f'{J}=~"$job"', 'node=~"$node"', 'gpu=~"$gpu"',
                                  'spoke=~"$spoke"')
RATE, RANGE = "$__rate_interval", "$__range"
REMOTE = f'cause="{c.REMOTE_FETCH.name}"'
HUB, CACHE = 'source="hub"', 'source="cache"'
PRICE_VARIABLE = "egress_price_usd_per_gb"
PER_NODE, PER_GPU = "node, instance", "node, instance, gpu"
# dcgm-exporter's SM activity, NVIDIA's better "is the GPU busy" than NVML's utilization; shown where
# dcgm-exporter runs (joined on the GPU's UUID), nothing where it does not.
DCGM_SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"

TRAINING_UID, SPOKE_UID, GPU_NODE_UID = "stallwatch-training", "stallwatch-spoke", "stallwatch-gpu-node"


# Every selector of the dashboards is limited to the chosen cluster.
def selector(metric: c.AnyMetricDef, *matchers: str, suffix: str = "") -> str:
    return promql.selector(metric, CLUSTER, *matchers, suffix=suffix)


def rate(metric: c.AnyMetricDef, window: str, *matchers: str, suffix: str = "") -> str:
    return promql.rate(metric, window, CLUSTER, *matchers, suffix=suffix)


def increase(metric: c.AnyMetricDef, window: str, *matchers: str, suffix: str = "") -> str:
    return promql.increase(metric, window, CLUSTER, *matchers, suffix=suffix)


CLUSTER_VARIABLE = Variable("cluster", "Cluster", f"label_values({c.BUILD_INFO.name}, cluster)",
                            description="The scrape's cluster label (All where there is none)")
JOB_VARIABLE = Variable("job", "Training job", f"label_values({selector(c.INPUT_BOUND_RATIO)}, {J})")
NODE_VARIABLE = Variable("node", "Node", f"label_values({selector(c.BUILD_INFO)}, node)",
                         description="Agents by the node they run on")
JOB_NODE_VARIABLE = Variable("node", "Node", f"label_values({selector(c.INPUT_BOUND_RATIO, JOB)}, node)",
                             description="The nodes the chosen jobs' ranks run on")
GPU_VARIABLE = Variable("gpu", "GPU", f"label_values({selector(c.GPU_INFO, NODE)}, gpu)")
JOB_GPU_VARIABLE = Variable("gpu", "GPU", f"label_values({selector(c.GPU_STALL_IDLE_SECONDS, JOB, NODE)}, gpu)",
                            description="The GPUs the chosen jobs' ranks run on")
SPOKE_VARIABLE = Variable("spoke", "Spoke", f"label_values({selector(c.SPOKE_REQUESTS)}, spoke)")


def _of_jobs(per_gpu: str) -> str:
    """A per-GPU (instance, gpu) series kept only for the GPUs the chosen jobs run on (the correlator's map)."""
    gpus = by("instance, gpu", "group", selector(c.GPU_STALL_IDLE_SECONDS, JOB, NODE, GPU))
    return f"{per_gpu} and on (instance, gpu) {gpus}"


def _sm_active(*matchers: str) -> str:
    """dcgm-exporter's SM activity per GPU, labelled like stallwatch's GPU series through the UUID."""
    ours = by("node, instance, gpu, uuid", "max", selector(c.GPU_INFO, *matchers))
    return (f'max by (UUID) ({DCGM_SM_ACTIVE}{{{CLUSTER}}}) * on (UUID) group_right () '
            f'label_replace({ours}, "UUID", "$1", "uuid", "(.+)")')


def _per_member(total: str, members: str) -> str:
    """A sum shared out over the members it sums (ranks, GPUs): seconds per second become a share of time."""
    return f"{total} / on () group_left () {members}"


def _phase_code() -> str:
    """The job's warm-up phase as a number (index in catalogue.PHASES) for a state timeline."""
    terms = []
    for code, phase in enumerate(c.PHASES):
        in_phase = by(J, "max", selector(c.WARMUP_PHASE, JOB, f'phase="{phase}"'))
        terms.append(f"({in_phase} == 1) * 0 + {code}")
    return " or ".join(f"({term})" for term in terms)


def _hit_ratio(hits: str, every: str) -> str:
    return f"{hits} / {every}"


def _recorded(rule: RecordingRule, t: Thresholds, over: str = "") -> str:
    """A job-level recording rule's series for the chosen cluster and jobs (`over` a range, if given), drawn
    at the time it covers: the job rules read the correlator's series `correlator_lag` back (rules.py), so
    a negative offset of as much puts each point back beside the GPU series of its time."""
    window = f"[{over}]" if over else ""
    return f"{rule.record}{{{CLUSTER}, {JOB}}}{window} offset -{t.correlator_lag}"


def job_across_nodes(t: Thresholds) -> Row:
    """Which node gates a multi-node job, why, and what it costs all of the job's GPUs."""
    ranks = _recorded(rules.rank_stall_rule(t), t)
    gating_rank = f"topk by (cluster, {J}) (1, {ranks} > 0)"
    return Row("Job across nodes: which node gates the job, and why", (
        Panel("Share of the job's GPU time lost to input stalls",
              "Every GPU of a synchronous job waits for its slowest rank: what share of the job's GPU time do "
              "input stalls cost (at least, and at most), and how much of it does each node cause?",
              Viz.TIMESERIES, "percentunit", (
                  Query(_recorded(rules.job_stall_rule(t), t), f"{{{{{J}}}}}: all of its GPUs"),
                  Query(_recorded(rules.job_stall_bound_rule(t), t), f"{{{{{J}}}}}: at most (nodes' stalls apart)"),
                  Query(_recorded(rules.node_stall_rule(t), t), f"{{{{{J}}}}}: stalls on {{{{node}}}}"),
              ), thresholds=(t.node_stall_cost_ratio,)),
        Panel("Gating rank's stalls by cause",
              "Which node and rank gate the job at each moment, and on what do they wait (remote fetches "
              "through that node's spoke, cache reads, preprocessing)?", Viz.TIMESERIES, "percentunit",
              (Query(f"{_recorded(rules.rank_cause_stall_rule(t), t)} and on (cluster, {J}, instance, node, rank) "
                     f"{gating_rank}", f"{{{{{J}}}}}: {{{{node}}}} rank {{{{rank}}}} {{{{cause}}}}"),),
              stacked=True),
        Panel("GPU-seconds lost across the job",
              "How many GPU-seconds in the time range did the job lose, all of its GPUs together, because some "
              "rank waited for input?", Viz.STAT, "s",
              (Query(f"avg_over_time({_recorded(rules.job_stall_gpu_seconds_rule(t), t, RANGE)}) * $__range_s",
                     f"{{{{{J}}}}}"),), width=6),
        Panel("GPUs of the job", "How many GPUs (ranks) does the job run on, across all nodes?", Viz.STAT, "short",
              (Query(_recorded(rules.job_gpus_rule(t), t), f"{{{{{J}}}}}"),), width=6),
    ))


def training(t: Thresholds) -> Dashboard:
    stall_share_remote = (f'{by("", "sum", increase(c.STALL_SECONDS, RANGE, JOB, NODE, REMOTE))} / '
                          f'{by("", "sum", increase(c.STALL_SECONDS, RANGE, JOB, NODE))}')
    worst_ranks = "topk(10, " + by(f"{J}, node, rank", "sum", increase(c.STALL_SECONDS, RANGE, JOB, NODE)) + ")"
    ranks = by("", "count", by(f"instance, {J}, rank", "group", selector(c.STALL_SECONDS, JOB, NODE)))
    job_gpus = by("", "count", by(f"instance, {J}, gpu", "group", selector(c.GPU_STALL_IDLE_SECONDS, JOB, NODE, GPU)))
    return Dashboard(
        uid=TRAINING_UID, title="stallwatch / Training input stalls",
        description="Is training waiting for its data, why, and since when: stalls per job and rank, attributed "
                    "to remote fetches, cache reads, preprocessing, delivery or other causes.",
        variables=(CLUSTER_VARIABLE, JOB_VARIABLE, JOB_NODE_VARIABLE, JOB_GPU_VARIABLE),
        annotations=(Annotation(
            "Steady state changes",
            "changes(" + selector(c.WARMUP_PHASE, JOB, 'phase="steady"') + "[2m]) > 0",
            f"{{{{{J}}}}} entered or left steady state", "green"),),
        rows=(
            Row("Is training waiting for its data?", (
                Panel("GPU utilization, loader wait and spoke misses",
                      "When the chosen jobs' GPUs dip, is the training loop waiting on its loader, and are the "
                      "spokes missing at the same moment?", Viz.TIMESERIES, "percentunit", (
                          Query(_of_jobs(by(PER_GPU, "avg", selector(c.GPU_UTILIZATION, NODE, GPU))),
                                "GPU {{gpu}} busy ({{node}})"),
                          Query(_of_jobs(_sm_active(NODE, GPU)), "GPU {{gpu}} SM active, dcgm-exporter ({{node}})"),
                          Query(by(f"{J}, rank", "sum", rate(c.LOADER_WAIT, RATE, JOB, NODE, suffix="_sum")),
                                f"{{{{{J}}}}}/{{{{rank}}}} waiting for a batch"),
                          Query("1 - " + _hit_ratio(
                              by("spoke", "sum", rate(c.SPOKE_REQUESTS, RATE, 'result="hit"')),
                              by("spoke", "sum", rate(c.SPOKE_REQUESTS, RATE))), "spoke {{spoke}} misses"),
                      ), width=24),
                Panel("Share of rank time stalled, by cause",
                      "What share of the chosen ranks' time goes to stalls, and do they come from remote "
                      "fetches, cache reads, preprocessing, delivery or unknown?", Viz.TIMESERIES, "percentunit",
                      (Query(_per_member(by("cause", "sum", rate(c.STALL_SECONDS, RATE, JOB, NODE)), ranks),
                             "{{cause}}"),),
                      stacked=True),
                Panel("Input-bound ratio per rank",
                      f"Which ranks spend more than {t.input_bound_moderate_ratio:.0%} (moderately) or "
                      f"{t.input_bound_ratio:.0%} (highly input-bound) of their step time waiting?",
                      Viz.TIMESERIES, "percentunit",
                      (Query(by(f"{J}, rank", "max", selector(c.INPUT_BOUND_RATIO, JOB, NODE)),
                             f"{{{{{J}}}}}/{{{{rank}}}}"),),
                      thresholds=(t.input_bound_moderate_ratio, t.input_bound_ratio)),
                Panel("Share of GPU time idle during stalls, by cause",
                      "What share of the chosen GPUs' time sits idle while their ranks stall, and on what?",
                      Viz.TIMESERIES, "percentunit",
                      (Query(_per_member(by("cause", "sum", rate(c.GPU_STALL_IDLE_SECONDS, RATE, JOB, NODE, GPU)),
                                         job_gpus), "{{cause}}"),),
                      stacked=True),
                Panel("GPU idle on remote fetches", "How many GPU-seconds in the time range were lost to reads "
                      "that missed the spoke?", Viz.STAT, "s",
                      (Query(by("", "sum", increase(c.GPU_STALL_IDLE_SECONDS, RANGE, JOB, NODE, GPU, REMOTE))),),
                      width=6),
                Panel("Stall share of remote fetches", "What share of all stall seconds in the time range did "
                      "remote fetches cause?", Viz.STAT, "percentunit", (Query(stall_share_remote),), width=6),
            )),
            Row("Reads: how the workers' reads were answered", (
                Panel("Reads by verdict",
                      "How many reads a second do the chosen jobs' workers make, and were they spoke hits, misses, "
                      "reads through no spoke (direct) or left to the agent (unknown)?", Viz.TIMESERIES, "reqps",
                      (Query(by("verdict", "sum", rate(c.DATASET_READS, RATE, JOB, NODE)), "{{verdict}}"),),
                      stacked=True),
                Panel("Failed reads",
                      "Which ranks' reads get no bytes (an error reply, a read that raised: the hub out, a spoke's "
                      "miss ending in an error), whose workers' back-off until they retry is booked remote_fetch?",
                      Viz.TIMESERIES, "cps",
                      (Query(by(f"{J}, rank", "sum", rate(c.DATASET_FAILED_READS, RATE, JOB, NODE)),
                             f"{{{{{J}}}}}/{{{{rank}}}}"),)),
            )),
            job_across_nodes(t),
            Row("Warm-up", (
                Panel("Warm-up phase", "Is each job cold, in transition or steady, and when did it change?",
                      Viz.STATE_TIMELINE, "none", (Query(_phase_code(), f"{{{{{J}}}}}"),), width=24,
                      states=c.PHASES),
                Panel("Time to steady", "How long did each job take from its first event to steady state?",
                      Viz.STAT, "s", (Query(by(J, "max", selector(c.WARMUP_TIME_TO_STEADY, JOB)), f"{{{{{J}}}}}"),),
                      width=6),
                Panel("Warm-up cost in idle GPU time", "How many GPU-seconds idled in stalls before steady state?",
                      Viz.STAT, "s",
                      (Query(by(J, "max", selector(c.WARMUP_IDLE_GPU_SECONDS, JOB)), f"{{{{{J}}}}}"),), width=6),
                Panel("Warm-up cost in hub bytes", "How many bytes came from the hub before steady state?",
                      Viz.STAT, "bytes", (Query(by(J, "max", selector(c.WARMUP_HUB_BYTES, JOB)), f"{{{{{J}}}}}"),),
                      width=6),
                Panel("Falls out of steady state", "Did a job leave steady state (eviction, thrash, hub trouble)?",
                      Viz.STAT, "short",
                      (Query(by(J, "sum", increase(c.WARMUP_REGRESSIONS, RANGE, JOB)), f"{{{{{J}}}}}"),), width=6),
                Panel("Forecast of time to steady",
                      "While a job is cold, when will it be steady (+Inf: never, its working set does not fit the "
                      "spoke or nothing is read twice), and how does the forecast compare with what happened?",
                      Viz.TIMESERIES, "s", (
                          Query(by(J, "max", selector(c.WARMUP_FORECAST_TIME_TO_STEADY, JOB)), f"{{{{{J}}}}} forecast"),
                          Query(by(J, "max", selector(c.WARMUP_TIME_TO_STEADY, JOB)), f"{{{{{J}}}}} actual"),
                      ), width=12),
                Panel("Warm-up still to come in idle GPU time",
                      "How many more GPU-seconds does the forecast expect to idle in stalls before steady state?",
                      Viz.STAT, "s",
                      (Query(by(J, "max", selector(c.WARMUP_FORECAST_IDLE_GPU_SECONDS, JOB)), f"{{{{{J}}}}}"),),
                      width=6),
                Panel("Warm-up still to come in hub bytes",
                      "How many more bytes does the forecast expect from the hub before steady state?",
                      Viz.STAT, "bytes",
                      (Query(by(J, "max", selector(c.WARMUP_FORECAST_HUB_BYTES, JOB)), f"{{{{{J}}}}}"),), width=6),
            )),
            Row("Worst ranks", (
                Panel("Worst ranks by stall seconds", "Which ranks stalled longest in the time range?",
                      Viz.TABLE, "s", (Query(worst_ranks),), width=24),
            )),
        ),
    )


def spoke(t: Thresholds) -> Dashboard:
    hub_bytes_range = by("", "sum", increase(c.SPOKE_BYTES, RANGE, SPOKE, HUB))
    return Dashboard(
        uid=SPOKE_UID, title="stallwatch / Spoke cache",
        description="Does the read-through cache keep remote data local: hit ratios, hub egress and its cost, "
                    "hub latency, evictions, and what a bigger or smaller cache would hit.",
        variables=(CLUSTER_VARIABLE, SPOKE_VARIABLE, Variable(
            PRICE_VARIABLE, "USD per GB from the hub", text=str(t.egress_price_usd_per_gb),
            description="Price of one GB (10^9 bytes) fetched across regions")),
        rows=(
            Row("Hits and misses", (
                Panel("Hit ratio by requests and by bytes",
                      "What share of requests, and of bytes, does the spoke serve from its cache?",
                      Viz.TIMESERIES, "percentunit", (
                          Query(_hit_ratio(by("spoke", "sum", rate(c.SPOKE_REQUESTS, RATE, SPOKE, 'result="hit"')),
                                           by("spoke", "sum", rate(c.SPOKE_REQUESTS, RATE, SPOKE))),
                                "{{spoke}} by requests"),
                          Query(_hit_ratio(by("spoke", "sum", rate(c.SPOKE_BYTES, RATE, SPOKE, CACHE)),
                                           by("spoke", "sum", rate(c.SPOKE_BYTES, RATE, SPOKE))),
                                "{{spoke}} by bytes"),
                      )),
                Panel("Requests by result", "How many requests per second hit, miss, revalidate or bypass?",
                      Viz.TIMESERIES, "reqps",
                      (Query(by("result", "sum", rate(c.SPOKE_REQUESTS, RATE, SPOKE)), "{{result}}"),), stacked=True),
            )),
            Row("The hub: egress, cost, latency, errors", (
                Panel("Bytes served, from cache and from the hub",
                      "How much does the spoke serve locally, and how much crosses the region boundary?",
                      Viz.TIMESERIES, "Bps",
                      (Query(by("spoke, source", "sum", rate(c.SPOKE_BYTES, RATE, SPOKE)), "{{spoke}} {{source}}"),)),
                Panel("Hub egress in the time range", "How many bytes came from the hub?", Viz.STAT, "bytes",
                      (Query(hub_bytes_range),), width=6),
                Panel("Egress cost in the time range",
                      f"What did the hub's bytes cost at ${PRICE_VARIABLE} USD per GB?", Viz.STAT, "currencyUSD",
                      (Query(f"{hub_bytes_range} / 1e9 * ${PRICE_VARIABLE}"),), width=6),
                Panel("Hub fetch latency", "How long does the spoke wait on the hub per fetch, and how spread out "
                      "is it?", Viz.HEATMAP, "s",
                      (Query(by("le", "sum", rate(c.SPOKE_HUB_FETCH_DURATION, RATE, SPOKE, suffix="_bucket")),
                             "{{le}}"),)),
                Panel("Miss path against client reads",
                      "How much slower is a fetch from the hub (what a miss pays) than the reads the training "
                      "workers see overall?", Viz.TIMESERIES, "s", (
                          Query(quantile(0.5, c.SPOKE_HUB_FETCH_DURATION, RATE, CLUSTER, SPOKE), "hub fetch p50"),
                          Query(quantile(0.95, c.SPOKE_HUB_FETCH_DURATION, RATE, CLUSTER, SPOKE), "hub fetch p95"),
                          Query(quantile(0.5, c.DATASET_READ_DURATION, RATE, CLUSTER), "client read p50"),
                          Query(quantile(0.95, c.DATASET_READ_DURATION, RATE, CLUSTER), "client read p95"),
                      )),
                Panel("Hub fetch errors", "Is the hub failing or unreachable?", Viz.TIMESERIES, "cps",
                      (Query(by("spoke", "sum", rate(c.SPOKE_HUB_ERRORS, RATE, SPOKE)), "{{spoke}}"),)),
                Panel("Hub round trip", "How far away is each spoke's hub right now, as the nodes' probes see "
                      "it: one TCP handshake (connect) and one HEAD or small ranged GET (http), even while nothing "
                      "misses?", Viz.TIMESERIES, "s",
                      (Query(by("spoke, phase", "max", selector(c.SPOKE_HUB_PROBE_DURATION, SPOKE)),
                             "{{spoke}} {{phase}}"),)),
                Panel("Hub probes failing", "Can the nodes reach each spoke's hub at all, and why not?",
                      Viz.TIMESERIES, "cps",
                      (Query(by("spoke, reason", "sum", rate(c.SPOKE_HUB_PROBE_FAILURES, RATE, SPOKE)),
                             "{{spoke}} {{reason}}"),)),
            )),
            Row("Capacity", (
                Panel("Cache size and capacity", "How full is the cache?", Viz.TIMESERIES, "bytes", (
                    Query(by("spoke", "max", selector(c.SPOKE_CACHE_SIZE, SPOKE)), "{{spoke}} held"),
                    Query(by("spoke", "max", selector(c.SPOKE_CACHE_CAPACITY, SPOKE)), "{{spoke}} capacity"),
                )),
                Panel("Evictions", "Is the cache evicting what training still needs (thrashing)?",
                      Viz.TIMESERIES, "ops",
                      (Query(by("spoke", "sum", rate(c.SPOKE_EVICTIONS, RATE, SPOKE)), "{{spoke}}"),)),
                Panel("What-if hit ratio at other capacities",
                      "What hit ratio would a smaller or bigger spoke reach on the same reads (drawn once the agent "
                      "knows the spoke's size: --correlator.cache-capacity, the chart's agent.spokeCapacityBytes)?",
                      Viz.TIMESERIES, "percentunit",
                      (Query(by("spoke, capacity_factor", "max", selector(c.CACHE_WHATIF_HIT_RATIO, SPOKE)),
                             "{{spoke}} at {{capacity_factor}}x capacity"),)),
                Panel("Problems reading the spoke's statistics",
                      "Are the spoke's numbers complete (malformed log lines, failed scrapes)?",
                      Viz.TIMESERIES, "cps",
                      (Query(by("spoke, reason", "sum", rate(c.SPOKE_COLLECTOR_ERRORS, RATE, SPOKE)),
                             "{{spoke}} {{reason}}"),)),
            )),
        ),
    )


def gpu_node() -> Dashboard:
    return Dashboard(
        uid=GPU_NODE_UID, title="stallwatch / GPU node",
        description="The node agent's view of one node: NVML metrics per GPU, throttling, XID errors, host CPU, "
                    "memory, network and disks, and the agent's own health.",
        variables=(CLUSTER_VARIABLE, NODE_VARIABLE, GPU_VARIABLE),
        annotations=(Annotation(
            "XID errors", f'{by("node, instance, gpu, xid", "sum", increase(c.GPU_XID_ERRORS, "2m", NODE))} > 0',
            "GPU {{gpu}} on {{node}}: XID {{xid}}", "red"),),
        rows=(
            Row("Utilization", (
                Panel("GPU utilization", "Is each GPU busy, how deep are its sub-second dips, and (where "
                      "dcgm-exporter runs) how much of its SMs does the work keep busy?",
                      Viz.TIMESERIES, "percentunit", (
                          Query(by(PER_GPU, "max", selector(c.GPU_UTILIZATION, NODE, GPU)), "{{gpu}} ({{node}})"),
                          Query(by(PER_GPU, "min", selector(c.GPU_UTILIZATION_MIN, NODE, GPU)),
                                "{{gpu}} lowest sample ({{node}})"),
                          Query(_sm_active(NODE, GPU), "{{gpu}} SM active, dcgm-exporter ({{node}})"),
                      )),
                Panel("GPU idle time", "What share of time was each GPU idle, from the driver's high-rate samples?",
                      Viz.TIMESERIES, "percentunit",
                      (Query(by(PER_GPU, "sum", rate(c.GPU_IDLE_SECONDS, RATE, NODE, GPU)),
                             "{{gpu}} ({{node}})"),)),
                Panel("Memory bandwidth utilization", "How busy is device memory?", Viz.TIMESERIES, "percentunit",
                      (Query(by(PER_GPU, "max", selector(c.GPU_MEMORY_UTILIZATION, NODE, GPU)),
                             "{{gpu}} ({{node}})"),)),
                Panel("Device memory", "How much device memory is in use?", Viz.TIMESERIES, "bytes", (
                    Query(by(PER_GPU, "max", selector(c.GPU_MEMORY_USED, NODE, GPU)), "{{gpu}} used ({{node}})"),
                    Query(by(PER_GPU, "max", selector(c.GPU_MEMORY_TOTAL, NODE, GPU)), "{{gpu}} total ({{node}})"),
                )),
            )),
            Row("Pods", (
                Panel("GPUs by pod", "Which namespace, pod and container hold each GPU or MIG device (the "
                      "kubelet's allocation; empty without the pods collector)?", Viz.TABLE, "none",
                      (Query(by("node, gpu, device, namespace, pod, container", "max",
                                selector(c.GPU_POD_INFO, NODE, GPU))),), width=24),
            )),
            Row("Power, clocks, PCIe", (
                Panel("Power", "How much power does each GPU draw (instantaneous and from the energy counter)?",
                      Viz.TIMESERIES, "watt", (
                          Query(by(PER_GPU, "max", selector(c.GPU_POWER, NODE, GPU)), "{{gpu}} draw ({{node}})"),
                          Query(by(PER_GPU, "sum", rate(c.GPU_ENERGY, RATE, NODE, GPU)),
                                "{{gpu}} average from energy ({{node}})"),
                      )),
                Panel("Clocks", "Are the SM and memory clocks held down?", Viz.TIMESERIES, "hertz", (
                    Query(by(PER_GPU, "max", selector(c.GPU_SM_CLOCK, NODE, GPU)), "{{gpu}} SM ({{node}})"),
                    Query(by(PER_GPU, "max", selector(c.GPU_MEMORY_CLOCK, NODE, GPU)), "{{gpu}} memory ({{node}})"),
                )),
                Panel("PCIe throughput", "How fast does data move to (rx) and from (tx) each GPU?",
                      Viz.TIMESERIES, "Bps",
                      (Query(by("node, instance, gpu, direction", "max", selector(c.GPU_PCIE_THROUGHPUT, NODE, GPU)),
                             "{{gpu}} {{direction}} ({{node}})"),)),
                Panel("Temperature", "Is a GPU running hot?", Viz.TIMESERIES, "celsius",
                      (Query(by(PER_GPU, "max", selector(c.GPU_TEMPERATURE, NODE, GPU)), "{{gpu}} ({{node}})"),)),
            )),
            Row("Health", (
                Panel("Clock event reasons", "Why are clocks held down; gpu_idle means nothing runs (starvation)?",
                      Viz.STATE_TIMELINE, "none",
                      (Query(by("node, instance, gpu, reason", "max", selector(c.GPU_CLOCKS_EVENT_REASON, NODE, GPU)),
                             "{{gpu}} {{reason}} ({{node}})"),), states=("clear", "active")),
                Panel("GPU answering NVML", "Has a GPU fallen off the bus or stopped answering?",
                      Viz.STATE_TIMELINE, "none",
                      (Query(by(PER_GPU, "min", selector(c.GPU_UP, NODE, GPU)), "{{gpu}} ({{node}})"),),
                      states=("lost", "up")),
                Panel("XID errors", "Did a GPU report critical XID errors, and which?", Viz.TIMESERIES, "short",
                      (Query(by("node, instance, gpu, xid", "sum", increase(c.GPU_XID_ERRORS, RATE, NODE, GPU)),
                             "{{gpu}} XID {{xid}} ({{node}})"),)),
                Panel("NVML call failures", "Which NVML calls fail, and how?", Viz.TIMESERIES, "cps",
                      (Query(by("node, instance, call, error", "sum", rate(c.GPU_NVML_ERRORS, RATE, NODE)),
                             "{{call}}: {{error}} ({{node}})"),)),
                Panel("Compute processes", "How many processes run on each GPU?", Viz.TIMESERIES, "short",
                      (Query(by(PER_GPU, "max", selector(c.GPU_PROCESSES, NODE, GPU)), "{{gpu}} ({{node}})"),)),
            )),
            Row("Host", (
                Panel("CPU by mode", "Is the node's CPU (loader workers, preprocessing) saturated?",
                      Viz.TIMESERIES, "percentunit",
                      (Query(f'{by("node, instance, mode", "sum", rate(c.HOST_CPU_SECONDS, RATE, NODE))} / '
                             f'on (instance) group_left () {by(PER_NODE, "max", selector(c.HOST_CPUS, NODE))}',
                             "{{mode}} ({{node}})"),), stacked=True),
                Panel("Memory", "How much memory is left for loader workers and page cache?", Viz.TIMESERIES, "bytes", (
                    Query(by(PER_NODE, "max", selector(c.HOST_MEMORY_AVAILABLE, NODE)), "available ({{node}})"),
                    Query(by(PER_NODE, "max", selector(c.HOST_MEMORY_TOTAL, NODE)), "installed ({{node}})"),
                )),
                Panel("Network", "How many bytes does the node receive (from the spoke or hub) and send?",
                      Viz.TIMESERIES, "Bps", (
                          Query(by("node, instance, interface", "sum", rate(c.HOST_NETWORK_RECEIVED, RATE, NODE)),
                                "{{interface}} received ({{node}})"),
                          Query(by("node, instance, interface", "sum", rate(c.HOST_NETWORK_TRANSMITTED, RATE, NODE)),
                                "{{interface}} sent ({{node}})"),
                      )),
                Panel("Disk I/O", "Is local disk (a node-local cache, checkpoints) busy?", Viz.TIMESERIES, "Bps", (
                    Query(by("node, instance, device", "sum", rate(c.HOST_DISK_READ, RATE, NODE)),
                          "{{device}} read ({{node}})"),
                    Query(by("node, instance, device", "sum", rate(c.HOST_DISK_WRITTEN, RATE, NODE)),
                          "{{device}} written ({{node}})"),
                )),
            )),
            Row("The agent", (
                Panel("Collectors", "Does every collector of the agent (gpu is NVML) succeed?",
                      Viz.STATE_TIMELINE, "none",
                      (Query(by("node, instance, collector", "min", selector(c.SCRAPE_COLLECTOR_SUCCESS, NODE)),
                             "{{collector}} ({{node}})"),), states=("failing", "ok")),
                Panel("Collector time per scrape", "Which collector makes scrapes slow?", Viz.TIMESERIES, "s",
                      (Query(by("node, instance, collector", "max", selector(c.SCRAPE_COLLECTOR_DURATION, NODE)),
                             "{{collector}} ({{node}})"),)),
                Panel("Training-client events", "Do the training clients' events arrive, or are they dropped by "
                      "the client or the agent?", Viz.TIMESERIES, "cps", (
                          Query(by("node, instance, kind", "sum", rate(c.RECEIVER_EVENTS, RATE, NODE)),
                                "{{kind}} accepted ({{node}})"),
                          Query(by("node, instance, reason", "sum", rate(c.RECEIVER_DROPPED_EVENTS, RATE, NODE)),
                                "dropped by the agent: {{reason}} ({{node}})"),
                          Query(by(PER_NODE, "sum", rate(c.CLIENT_DROPPED_EVENTS, RATE, NODE)),
                                "dropped by clients ({{node}})"),
                      ), width=24),
            )),
        ),
    )


def all_dashboards(t: Thresholds | None = None) -> tuple[Dashboard, ...]:
    t = t or Thresholds()
    return training(t), spoke(t), gpu_node()


def _renderer(uid: str) -> Callable[[], str]:
    def render() -> str:
        dashboards = all_dashboards()
        return render_json(next(d for d in dashboards if d.uid == uid), dashboards)

    return render


def render_docs() -> str:
    return render_markdown(all_dashboards(), "stallwatch/mixin/dashboards.py")


# What `stallwatch generate` writes for the dashboards: path -> renderer.
ARTIFACTS: dict[str, Callable[[], str]] = {
    f"dashboards/{uid}.json": _renderer(uid) for uid in (TRAINING_UID, SPOKE_UID, GPU_NODE_UID)
}
