"""The three Grafana dashboards (`dashboards/*.json`), declared as tables of panels over the metric catalogue.

Each panel says which question it answers; docs/dashboards.md is rendered from the same declarations.
Selectors use the dashboard variables `$job`, `$node` (the scrape `instance`), `$gpu` and `$spoke`;
rates use Grafana's `$__rate_interval`, totals over the visible range `$__range`.
"""

from __future__ import annotations

from collections.abc import Callable

from stallwatch import catalogue as c
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
from stallwatch.mixin.promql import by, increase, quantile, rate, selector

JOB, NODE, GPU, SPOKE = 'job=~"$job"', 'instance=~"$node"', 'gpu=~"$gpu"', 'spoke=~"$spoke"'
RATE, RANGE = "$__rate_interval", "$__range"
REMOTE = f'cause="{c.CAUSES[0]}"'
HUB, CACHE = 'source="hub"', 'source="cache"'
PRICE_VARIABLE = "egress_price_usd_per_gb"

TRAINING_UID, SPOKE_UID, GPU_NODE_UID = "stallwatch-training", "stallwatch-spoke", "stallwatch-gpu-node"

JOB_VARIABLE = Variable("job", "Training job", f"label_values({c.INPUT_BOUND_RATIO.name}, job)")
NODE_VARIABLE = Variable("node", "Node", f"label_values({c.BUILD_INFO.name}, instance)",
                         description="Agents by their scrape address")
GPU_VARIABLE = Variable("gpu", "GPU", f'label_values({selector(c.GPU_INFO, NODE)}, gpu)')
SPOKE_VARIABLE = Variable("spoke", "Spoke", f"label_values({c.SPOKE_REQUESTS.name}, spoke)")


def _phase_code() -> str:
    """The job's warm-up phase as a number (index in catalogue.PHASES) for a state timeline."""
    terms = []
    for code, phase in enumerate(c.PHASES):
        in_phase = by("job", "max", selector(c.WARMUP_PHASE, JOB, f'phase="{phase}"'))
        terms.append(f"({in_phase} == 1) * 0 + {code}")
    return " or ".join(f"({term})" for term in terms)


def _hit_ratio(hits: str, every: str) -> str:
    return f"{hits} / {every}"


def training(t: Thresholds) -> Dashboard:
    stall_share_remote = (f'{by("", "sum", increase(c.STALL_SECONDS, RANGE, JOB, NODE, REMOTE))} / '
                          f'{by("", "sum", increase(c.STALL_SECONDS, RANGE, JOB, NODE))}')
    worst_ranks = "topk(10, " + by("job, instance, rank", "sum", increase(c.STALL_SECONDS, RANGE, JOB, NODE)) + ")"
    return Dashboard(
        uid=TRAINING_UID, title="stallwatch / Training input stalls",
        description="Is training waiting for its data, why, and since when: stalls per job and rank, attributed "
                    "to remote fetches, cache reads, preprocessing or other causes.",
        variables=(JOB_VARIABLE, NODE_VARIABLE, GPU_VARIABLE),
        annotations=(Annotation(
            "Steady state changes",
            "changes(" + selector(c.WARMUP_PHASE, JOB, 'phase="steady"') + "[2m]) > 0",
            "{{job}} entered or left steady state", "green"),),
        rows=(
            Row("Is training waiting for its data?", (
                Panel("GPU utilization, loader wait and spoke misses",
                      "When the GPUs dip, is the training loop waiting on its loader, and are the spokes missing "
                      "at the same moment?", Viz.TIMESERIES, "percentunit", (
                          Query(by("instance, gpu", "avg", selector(c.GPU_UTILIZATION, NODE, GPU)),
                                "GPU {{gpu}} busy ({{instance}})"),
                          Query(by("job, rank", "sum", rate(c.LOADER_WAIT, RATE, JOB, NODE, suffix="_sum")),
                                "{{job}}/{{rank}} waiting for a batch"),
                          Query("1 - " + _hit_ratio(
                              by("spoke", "sum", rate(c.SPOKE_REQUESTS, RATE, 'result="hit"')),
                              by("spoke", "sum", rate(c.SPOKE_REQUESTS, RATE))), "spoke {{spoke}} misses"),
                      ), width=24),
                Panel("Stall seconds by cause",
                      "Where do the stalls come from: remote fetches, cache reads, preprocessing or unknown?",
                      Viz.TIMESERIES, "s",
                      (Query(by("cause", "sum", rate(c.STALL_SECONDS, RATE, JOB, NODE)), "{{cause}}"),),
                      stacked=True),
                Panel("Input-bound ratio per rank",
                      f"Which ranks spend more than {t.input_bound_moderate_ratio:.0%} (moderately) or "
                      f"{t.input_bound_ratio:.0%} (highly input-bound) of their step time waiting?",
                      Viz.TIMESERIES, "percentunit",
                      (Query(by("job, rank", "max", selector(c.INPUT_BOUND_RATIO, JOB, NODE)), "{{job}}/{{rank}}"),),
                      thresholds=(t.input_bound_moderate_ratio, t.input_bound_ratio)),
                Panel("GPU idle during stalls, by cause",
                      "How many GPU-seconds per second sit idle while ranks stall, and on what?",
                      Viz.TIMESERIES, "s",
                      (Query(by("cause", "sum", rate(c.GPU_STALL_IDLE_SECONDS, RATE, JOB, NODE, GPU)), "{{cause}}"),),
                      stacked=True),
                Panel("GPU idle on remote fetches", "How many GPU-seconds in the time range were lost to reads "
                      "that missed the spoke?", Viz.STAT, "s",
                      (Query(by("", "sum", increase(c.GPU_STALL_IDLE_SECONDS, RANGE, JOB, NODE, GPU, REMOTE))),),
                      width=6),
                Panel("Stall share of remote fetches", "What share of all stall seconds in the time range did "
                      "remote fetches cause?", Viz.STAT, "percentunit", (Query(stall_share_remote),), width=6),
            )),
            Row("Warm-up", (
                Panel("Warm-up phase", "Is each job cold, in transition or steady, and when did it change?",
                      Viz.STATE_TIMELINE, "none", (Query(_phase_code(), "{{job}}"),), width=24, states=c.PHASES),
                Panel("Time to steady", "How long did each job take from its first event to steady state?",
                      Viz.STAT, "s", (Query(by("job", "max", selector(c.WARMUP_TIME_TO_STEADY, JOB)), "{{job}}"),),
                      width=6),
                Panel("Warm-up cost in idle GPU time", "How many GPU-seconds idled in stalls before steady state?",
                      Viz.STAT, "s", (Query(by("job", "max", selector(c.WARMUP_IDLE_GPU_SECONDS, JOB)), "{{job}}"),),
                      width=6),
                Panel("Warm-up cost in hub bytes", "How many bytes came from the hub before steady state?",
                      Viz.STAT, "bytes", (Query(by("job", "max", selector(c.WARMUP_HUB_BYTES, JOB)), "{{job}}"),),
                      width=6),
                Panel("Falls out of steady state", "Did a job leave steady state (eviction, thrash, hub trouble)?",
                      Viz.STAT, "short",
                      (Query(by("job", "sum", increase(c.WARMUP_REGRESSIONS, RANGE, JOB)), "{{job}}"),), width=6),
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
        variables=(SPOKE_VARIABLE, Variable(
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
                          Query(quantile(0.5, c.SPOKE_HUB_FETCH_DURATION, RATE, SPOKE), "hub fetch p50"),
                          Query(quantile(0.95, c.SPOKE_HUB_FETCH_DURATION, RATE, SPOKE), "hub fetch p95"),
                          Query(quantile(0.5, c.DATASET_READ_DURATION, RATE), "client read p50"),
                          Query(quantile(0.95, c.DATASET_READ_DURATION, RATE), "client read p95"),
                      )),
                Panel("Hub fetch errors", "Is the hub failing or unreachable?", Viz.TIMESERIES, "cps",
                      (Query(by("spoke", "sum", rate(c.SPOKE_HUB_ERRORS, RATE, SPOKE)), "{{spoke}}"),)),
                Panel("Hub round trip", "How far away is the hub right now?", Viz.TIMESERIES, "s",
                      (Query(by("spoke", "max", selector(c.SPOKE_HUB_RTT, SPOKE)), "{{spoke}}"),)),
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
                      "What hit ratio would a smaller or bigger spoke reach on the same reads?",
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
    per_gpu = "instance, gpu"
    return Dashboard(
        uid=GPU_NODE_UID, title="stallwatch / GPU node",
        description="The node agent's view of one node: NVML metrics per GPU, throttling, XID errors, host CPU, "
                    "memory, network and disks, and the agent's own health.",
        variables=(NODE_VARIABLE, GPU_VARIABLE),
        annotations=(Annotation(
            "XID errors", f'{by("instance, gpu, xid", "sum", increase(c.GPU_XID_ERRORS, "2m", NODE))} > 0',
            "GPU {{gpu}} on {{instance}}: XID {{xid}}", "red"),),
        rows=(
            Row("Utilization", (
                Panel("GPU utilization", "Is each GPU busy, and how deep are its sub-second dips?",
                      Viz.TIMESERIES, "percentunit", (
                          Query(by(per_gpu, "max", selector(c.GPU_UTILIZATION, NODE, GPU)), "{{gpu}} ({{instance}})"),
                          Query(by(per_gpu, "min", selector(c.GPU_UTILIZATION_MIN, NODE, GPU)),
                                "{{gpu}} lowest sample ({{instance}})"),
                      )),
                Panel("GPU idle time", "What share of time was each GPU idle, from the driver's high-rate samples?",
                      Viz.TIMESERIES, "percentunit",
                      (Query(by(per_gpu, "sum", rate(c.GPU_IDLE_SECONDS, RATE, NODE, GPU)),
                             "{{gpu}} ({{instance}})"),)),
                Panel("Memory bandwidth utilization", "How busy is device memory?", Viz.TIMESERIES, "percentunit",
                      (Query(by(per_gpu, "max", selector(c.GPU_MEMORY_UTILIZATION, NODE, GPU)),
                             "{{gpu}} ({{instance}})"),)),
                Panel("Device memory", "How much device memory is in use?", Viz.TIMESERIES, "bytes", (
                    Query(by(per_gpu, "max", selector(c.GPU_MEMORY_USED, NODE, GPU)), "{{gpu}} used ({{instance}})"),
                    Query(by(per_gpu, "max", selector(c.GPU_MEMORY_TOTAL, NODE, GPU)), "{{gpu}} total ({{instance}})"),
                )),
            )),
            Row("Power, clocks, PCIe", (
                Panel("Power", "How much power does each GPU draw (instantaneous and from the energy counter)?",
                      Viz.TIMESERIES, "watt", (
                          Query(by(per_gpu, "max", selector(c.GPU_POWER, NODE, GPU)), "{{gpu}} draw ({{instance}})"),
                          Query(by(per_gpu, "sum", rate(c.GPU_ENERGY, RATE, NODE, GPU)),
                                "{{gpu}} average from energy ({{instance}})"),
                      )),
                Panel("Clocks", "Are the SM and memory clocks held down?", Viz.TIMESERIES, "hertz", (
                    Query(by(per_gpu, "max", selector(c.GPU_SM_CLOCK, NODE, GPU)), "{{gpu}} SM ({{instance}})"),
                    Query(by(per_gpu, "max", selector(c.GPU_MEMORY_CLOCK, NODE, GPU)), "{{gpu}} memory ({{instance}})"),
                )),
                Panel("PCIe throughput", "How fast does data move to (rx) and from (tx) each GPU?",
                      Viz.TIMESERIES, "Bps",
                      (Query(by("instance, gpu, direction", "max", selector(c.GPU_PCIE_THROUGHPUT, NODE, GPU)),
                             "{{gpu}} {{direction}} ({{instance}})"),)),
                Panel("Temperature", "Is a GPU running hot?", Viz.TIMESERIES, "celsius",
                      (Query(by(per_gpu, "max", selector(c.GPU_TEMPERATURE, NODE, GPU)), "{{gpu}} ({{instance}})"),)),
            )),
            Row("Health", (
                Panel("Clock event reasons", "Why are clocks held down; gpu_idle means nothing runs (starvation)?",
                      Viz.STATE_TIMELINE, "none",
                      (Query(by("instance, gpu, reason", "max", selector(c.GPU_CLOCKS_EVENT_REASON, NODE, GPU)),
                             "{{gpu}} {{reason}} ({{instance}})"),), states=("clear", "active")),
                Panel("GPU answering NVML", "Has a GPU fallen off the bus or stopped answering?",
                      Viz.STATE_TIMELINE, "none",
                      (Query(by(per_gpu, "min", selector(c.GPU_UP, NODE, GPU)), "{{gpu}} ({{instance}})"),),
                      states=("lost", "up")),
                Panel("XID errors", "Did a GPU report critical XID errors, and which?", Viz.TIMESERIES, "short",
                      (Query(by("instance, gpu, xid", "sum", increase(c.GPU_XID_ERRORS, RATE, NODE, GPU)),
                             "{{gpu}} XID {{xid}} ({{instance}})"),)),
                Panel("NVML call failures", "Which NVML calls fail, and how?", Viz.TIMESERIES, "cps",
                      (Query(by("instance, call, error", "sum", rate(c.GPU_NVML_ERRORS, RATE, NODE)),
                             "{{call}}: {{error}} ({{instance}})"),)),
                Panel("Compute processes", "How many processes run on each GPU?", Viz.TIMESERIES, "short",
                      (Query(by(per_gpu, "max", selector(c.GPU_PROCESSES, NODE, GPU)), "{{gpu}} ({{instance}})"),)),
            )),
            Row("Host", (
                Panel("CPU by mode", "Is the node's CPU (loader workers, preprocessing) saturated?",
                      Viz.TIMESERIES, "percentunit",
                      (Query(f'{by("instance, mode", "sum", rate(c.HOST_CPU_SECONDS, RATE, NODE))} / on (instance) '
                             f'group_left () {by("instance", "max", selector(c.HOST_CPUS, NODE))}',
                             "{{mode}} ({{instance}})"),), stacked=True),
                Panel("Memory", "How much memory is left for loader workers and page cache?", Viz.TIMESERIES, "bytes", (
                    Query(by("instance", "max", selector(c.HOST_MEMORY_AVAILABLE, NODE)), "available ({{instance}})"),
                    Query(by("instance", "max", selector(c.HOST_MEMORY_TOTAL, NODE)), "installed ({{instance}})"),
                )),
                Panel("Network", "How many bytes does the node receive (from the spoke or hub) and send?",
                      Viz.TIMESERIES, "Bps", (
                          Query(by("instance, interface", "sum", rate(c.HOST_NETWORK_RECEIVED, RATE, NODE)),
                                "{{interface}} received ({{instance}})"),
                          Query(by("instance, interface", "sum", rate(c.HOST_NETWORK_TRANSMITTED, RATE, NODE)),
                                "{{interface}} sent ({{instance}})"),
                      )),
                Panel("Disk I/O", "Is local disk (a node-local cache, checkpoints) busy?", Viz.TIMESERIES, "Bps", (
                    Query(by("instance, device", "sum", rate(c.HOST_DISK_READ, RATE, NODE)),
                          "{{device}} read ({{instance}})"),
                    Query(by("instance, device", "sum", rate(c.HOST_DISK_WRITTEN, RATE, NODE)),
                          "{{device}} written ({{instance}})"),
                )),
            )),
            Row("The agent", (
                Panel("Collectors", "Does every collector of the agent (gpu is NVML) succeed?",
                      Viz.STATE_TIMELINE, "none",
                      (Query(by("instance, collector", "min", selector(c.SCRAPE_COLLECTOR_SUCCESS, NODE)),
                             "{{collector}} ({{instance}})"),), states=("failing", "ok")),
                Panel("Collector time per scrape", "Which collector makes scrapes slow?", Viz.TIMESERIES, "s",
                      (Query(by("instance, collector", "max", selector(c.SCRAPE_COLLECTOR_DURATION, NODE)),
                             "{{collector}} ({{instance}})"),)),
                Panel("Training-client events", "Do the training clients' events arrive, or are they dropped by "
                      "the client or the agent?", Viz.TIMESERIES, "cps", (
                          Query(by("instance, kind", "sum", rate(c.RECEIVER_EVENTS, RATE, NODE)),
                                "{{kind}} accepted ({{instance}})"),
                          Query(by("instance, reason", "sum", rate(c.RECEIVER_DROPPED_EVENTS, RATE, NODE)),
                                "dropped by the agent: {{reason}} ({{instance}})"),
                          Query(by("instance", "sum", rate(c.CLIENT_DROPPED_EVENTS, RATE, NODE)),
                                "dropped by clients ({{instance}})"),
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
