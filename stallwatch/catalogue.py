"""Every metric stallwatch exposes, defined once.

Exporters, the correlator, dashboards, alerts, the metrics reference (docs/metrics.md) and the tests
all read these definitions; nothing else spells a metric name. Labels are bounded by design: training_job, rank,
gpu, spoke, cause and a few small enumerations, never a path, URL, pid or batch id. Pod names appear on
one info series per allocated GPU device only (stallwatch_gpu_pod_info), never on a measurement.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

PREFIX = "stallwatch_"
# The label naming the training job on loader and correlator metrics. Not `job`, which Prometheus gives
# every series it scrapes (the scrape job): both coexist without honor_labels, as dcgm-exporter keeps its
# HPC job in `hpc_job`. Rules and dashboards refer to it by this name, never by spelling it.
JOB_LABEL = "training_job"


class Kind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


# Loader waits and reads span 100 µs (a prefetched batch) to tens of seconds (a hub outage).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0,
)


F = TypeVar("F", CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)

_FAMILY_TYPES: dict[Kind, type[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]] = {
    Kind.COUNTER: CounterMetricFamily,
    Kind.GAUGE: GaugeMetricFamily,
    Kind.HISTOGRAM: HistogramMetricFamily,
}


@dataclass(frozen=True)
class MetricDef(Generic[F]):
    name: str
    kind: Kind
    unit: str
    labels: tuple[str, ...]
    help: str
    subsystem: str
    buckets: tuple[float, ...] = ()

    def family(self) -> F:
        """An empty family of this metric, ready for add_metric(); its unit goes to OpenMetrics' `# UNIT` line."""
        family_type = _FAMILY_TYPES[self.kind]
        return family_type(self.name, self.help, labels=list(self.labels), unit=self.unit)  # type: ignore[return-value]


AnyMetricDef = MetricDef[CounterMetricFamily] | MetricDef[GaugeMetricFamily] | MetricDef[HistogramMetricFamily]
_ALL: list[AnyMetricDef] = []


def counter(
    subsystem: str, name: str, unit: str, labels: Sequence[str], help: str
) -> MetricDef[CounterMetricFamily]:
    metric: MetricDef[CounterMetricFamily] = MetricDef(
        PREFIX + name, Kind.COUNTER, unit, tuple(labels), help, subsystem
    )
    _ALL.append(metric)
    return metric


def gauge(
    subsystem: str, name: str, unit: str, labels: Sequence[str], help: str
) -> MetricDef[GaugeMetricFamily]:
    metric: MetricDef[GaugeMetricFamily] = MetricDef(
        PREFIX + name, Kind.GAUGE, unit, tuple(labels), help, subsystem
    )
    _ALL.append(metric)
    return metric


def histogram(
    subsystem: str,
    name: str,
    unit: str,
    labels: Sequence[str],
    help: str,
    buckets: Sequence[float] = LATENCY_BUCKETS,
) -> MetricDef[HistogramMetricFamily]:
    metric: MetricDef[HistogramMetricFamily] = MetricDef(
        PREFIX + name, Kind.HISTOGRAM, unit, tuple(labels), help, subsystem, tuple(buckets)
    )
    _ALL.append(metric)
    return metric


# --- agent -------------------------------------------------------------------------------------------
BUILD_INFO = gauge("agent", "build_info", "", ["version", "revision"],
                   "Always 1; the agent's version and the git revision it was built from (unknown if not known).")
SCRAPE_COLLECTOR_DURATION = gauge(
    "agent", "scrape_collector_duration_seconds", "seconds", ["collector"],
    "Time a collector took to produce its metrics on this scrape.",
)
SCRAPE_COLLECTOR_SUCCESS = gauge(
    "agent", "scrape_collector_success", "", ["collector"],
    "1 if the collector produced its metrics on this scrape, 0 if it failed.",
)

# --- gpu (NVML) --------------------------------------------------------------------------------------
GPU_DEVICES = gauge("gpu", "gpu_devices", "", [], "GPUs NVML reports on this node (0 when NVML is absent).")
GPU_INFO = gauge("gpu", "gpu_info", "", ["gpu", "uuid", "name"], "Always 1; identifies each GPU by index.")
GPU_UP = gauge("gpu", "gpu_up", "", ["gpu"], "1 if the GPU answered NVML on the last poll, 0 if lost.")
GPU_UTILIZATION = gauge(
    "gpu", "gpu_utilization_ratio", "ratio", ["gpu"],
    "Fraction of the last sample period in which a kernel ran (NVML utilization.gpu).",
)
GPU_MEMORY_UTILIZATION = gauge(
    "gpu", "gpu_memory_utilization_ratio", "ratio", ["gpu"],
    "Fraction of the last sample period in which device memory was read or written.",
)
GPU_UTILIZATION_MIN = gauge(
    "gpu", "gpu_utilization_min_ratio", "ratio", ["gpu"],
    "Lowest of the driver's high-rate utilization samples since the previous poll; shows sub-second dips.",
)
GPU_IDLE_SECONDS = counter(
    "gpu", "gpu_idle_seconds_total", "seconds", ["gpu"],
    "Seconds the GPU ran nothing: each of the driver's high-rate utilization samples adds (1 - utilization) x its "
    "period.",
)
GPU_UTILIZATION_SAMPLES = counter(
    "gpu", "gpu_utilization_samples_total", "", ["gpu"],
    "High-rate utilization samples read from the driver.",
)
GPU_MEMORY_USED = gauge("gpu", "gpu_memory_used_bytes", "bytes", ["gpu"], "Device memory in use.")
GPU_MEMORY_TOTAL = gauge("gpu", "gpu_memory_total_bytes", "bytes", ["gpu"], "Device memory installed.")
GPU_POWER = gauge("gpu", "gpu_power_watts", "watts", ["gpu"], "Power draw of the board.")
GPU_ENERGY = counter(
    "gpu", "gpu_energy_joules_total", "joules", ["gpu"], "Energy used since the driver was loaded."
)
GPU_SM_CLOCK = gauge("gpu", "gpu_sm_clock_hertz", "hertz", ["gpu"], "Current SM clock.")
GPU_MEMORY_CLOCK = gauge("gpu", "gpu_memory_clock_hertz", "hertz", ["gpu"], "Current memory clock.")
GPU_PCIE_THROUGHPUT = gauge(
    "gpu", "gpu_pcie_throughput_bytes_per_second", "bytes_per_second", ["gpu", "direction"],
    "PCIe throughput over the driver's last 20 ms window, direction rx (to the GPU) or tx.",
)
GPU_TEMPERATURE = gauge("gpu", "gpu_temperature_celsius", "celsius", ["gpu"], "GPU die temperature.")
GPU_CLOCKS_EVENT_REASON = gauge(
    "gpu", "gpu_clocks_event_reason", "", ["gpu", "reason"],
    "1 while the reason holds clocks down; reason gpu_idle means nothing runs on the GPU.",
)
GPU_XID_ERRORS = counter(
    "gpu", "gpu_xid_errors_total", "", ["gpu", "xid"], "Critical XID error events reported by the driver."
)
GPU_PROCESSES = gauge("gpu", "gpu_processes", "", ["gpu"], "Compute processes running on the GPU.")
GPU_NVML_ERRORS = counter(
    "gpu", "gpu_nvml_errors_total", "", ["gpu", "call", "error"],
    "NVML calls that failed, by function and error (gpu is empty for calls not tied to a device).",
)

# --- pods (the kubelet's pod-resources API) ---------------------------------------------------------
GPU_POD_INFO = gauge(
    "pods", "gpu_pod_info", "", ["gpu", "device", "resource", "namespace", "pod", "container"],
    "Always 1 for each GPU device the kubelet allocated to a running container; device is the device "
    "plugin's id (GPU-... or MIG-...), gpu the index of the physical GPU it lives on (empty when NVML "
    "does not know it). Join on gpu for pod labels; the series goes when the pod does.",
)
PODS_KUBELET_UP = gauge(
    "pods", "pods_kubelet_up", "", [], "1 if the last List call to the kubelet's pod-resources API succeeded."
)
PODS_KUBELET_ERRORS = counter(
    "pods", "pods_kubelet_errors_total", "", ["code"],
    "List calls to the kubelet's pod-resources API that failed, by gRPC status code (lower case).",
)
PODS_DROPPED_ALLOCATIONS = counter(
    "pods", "pods_dropped_allocations_total", "", [],
    "GPU device allocations left out of stallwatch_gpu_pod_info, summed over answers, because the kubelet "
    "listed more than the per-node cap (a broken kubelet or device plugin).",
)

# --- host (psutil) -----------------------------------------------------------------------------------
HOST_CPU_SECONDS = counter(
    "host", "host_cpu_seconds_total", "seconds", ["mode"], "CPU time spent in each mode, all cores."
)
HOST_CPUS = gauge("host", "host_cpus", "", [], "Logical CPUs on the node.")
HOST_MEMORY_TOTAL = gauge("host", "host_memory_total_bytes", "bytes", [], "Physical memory installed.")
HOST_MEMORY_AVAILABLE = gauge(
    "host", "host_memory_available_bytes", "bytes", [], "Memory available without swapping."
)
HOST_NETWORK_RECEIVED = counter(
    "host", "host_network_received_bytes_total", "bytes", ["interface"], "Bytes received per interface."
)
HOST_NETWORK_TRANSMITTED = counter(
    "host", "host_network_transmitted_bytes_total", "bytes", ["interface"],
    "Bytes transmitted per interface.",
)
HOST_DISK_READ = counter(
    "host", "host_disk_read_bytes_total", "bytes", ["device"], "Bytes read per block device."
)
HOST_DISK_WRITTEN = counter(
    "host", "host_disk_written_bytes_total", "bytes", ["device"], "Bytes written per block device."
)
HOST_DISK_IO_SECONDS = counter(
    "host", "host_disk_io_seconds_total", "seconds", ["device"], "Time each block device was busy."
)


# --- loader: the training client and the agent's event receiver ---------------------------------------
LOADER_WAIT = histogram(
    "loader", "loader_wait_seconds", "seconds", [JOB_LABEL, "rank"],
    "Time the training loop waited in next(loader) for a batch.",
)
STEP_COMPUTE = histogram(
    "loader", "step_compute_seconds", "seconds", [JOB_LABEL, "rank"],
    "Time from receiving a batch to asking for the next one (the step's work).",
)
DATASET_READS = counter(
    "loader", "dataset_reads_total", "", [JOB_LABEL, "rank", "verdict"],
    "Dataset reads by loader workers, by the cache's verdict as the reader saw it: hit, miss, unknown, or direct "
    "(the read crossed no spoke).",
)
DATASET_READ_BYTES = counter(
    "loader", "dataset_read_bytes_total", "bytes", [JOB_LABEL, "rank"], "Bytes read by loader workers."
)
DATASET_FAILED_READS = counter(
    "loader", "dataset_failed_reads_total", "", [JOB_LABEL, "rank"],
    "Dataset reads that got no bytes: failed fetches (an error reply, a read that raised or timed out), counted "
    "in dataset_reads_total too. Their workers' back-off until they retry is booked to remote_fetch.",
)
DATASET_READ_DURATION = histogram(
    "loader", "dataset_read_duration_seconds", "seconds", [JOB_LABEL, "rank"],
    "Duration of single dataset reads in loader workers.",
)
RECEIVER_BATCHES = counter(
    "loader", "receiver_batches_total", "", ["result"],
    "Event batches received from training clients: accepted, rejected with the reason, or relay_lost (taken from "
    "the socket by a receive relay that died before handing them on).",
)
RECEIVER_EVENTS = counter(
    "loader", "receiver_events_total", "", ["kind"], "Events accepted from training clients, by kind."
)
RECEIVER_DROPPED_EVENTS = counter(
    "loader", "receiver_dropped_events_total", "", ["reason"],
    "Events the agent dropped after receiving them (queue full under a flood, or in a rejected batch).",
)
CLIENT_DROPPED_EVENTS = counter(
    "loader", "client_dropped_events_total", "", [JOB_LABEL, "rank"],
    "Events training clients could not send (agent absent or slow), as the clients report them.",
)
RECEIVER_FOLDED_LABELS = counter(
    "loader", "receiver_folded_label_values_total", "", ["label"],
    "Batches whose job name (label=training_job) or (job, rank) pair (label=rank) was past the per-node cap and was "
    "folded into the value __other__.",
)
RECEIVER_UP = gauge(
    "loader", "receiver_up", "", [],
    "1 if the agent is bound to the events socket and receiving, 0 if it could not bind, another running agent holds "
    "the path, the path no longer names its socket, or its receive relay lives but has not run for 5 s (stopped): "
    "clients count their events as dropped.",
)
RECEIVER_RELAY_RESTARTS = counter(
    "loader", "receiver_relay_restarts_total", "", [],
    "Receive relays (the process that drains the events socket) started after the first: one died, and the agent "
    "received in its place until another started.",
)


# --- spoke: the cache's own view of the traffic ------------------------------------------------------
SPOKE_REQUESTS = counter(
    "spoke", "spoke_requests_total", "", ["spoke", "result"],
    "Requests the spoke served, by result: hit, miss, expired, stale, updating, revalidated, bypass, none.",
)
SPOKE_BYTES = counter(
    "spoke", "spoke_bytes_total", "bytes", ["spoke", "source"],
    "Bytes the spoke served, by source: cache (local) or hub (fetched across the region boundary).",
)
SPOKE_HUB_FETCH_DURATION = histogram(
    "spoke", "spoke_hub_fetch_duration_seconds", "seconds", ["spoke"],
    "Time the spoke waited on the hub for one fetch (upstream response time).",
)
SPOKE_HUB_ERRORS = counter(
    "spoke", "spoke_hub_errors_total", "", ["spoke"],
    "Fetches from the hub that failed (upstream 5xx, timeouts, refused connections).",
)
SPOKE_EVICTIONS = counter(
    "spoke", "spoke_evictions_total", "", ["spoke"], "Objects the spoke evicted to make room."
)
SPOKE_CACHE_SIZE = gauge("spoke", "spoke_cache_size_bytes", "bytes", ["spoke"], "Bytes the spoke holds in cache.")
SPOKE_CACHE_CAPACITY = gauge(
    "spoke", "spoke_cache_capacity_bytes", "bytes", ["spoke"], "Bytes the spoke may hold in cache."
)
# The node agent's active probe of each spoke's hub (collector hub_probe), as blackbox_exporter's
# probe_* series: hub latency even while nothing misses.
SPOKE_HUB_PROBE_DURATION = gauge(
    "spoke", "spoke_hub_probe_duration_seconds", "seconds", ["spoke", "phase"],
    "Duration of the last probe of the spoke's hub from this node, by phase: connect (TCP handshake, one "
    "network round trip) and http (the HEAD or ranged GET, request sent to response headers).",
)
SPOKE_HUB_PROBE_SUCCESS = gauge(
    "spoke", "spoke_hub_probe_success", "", ["spoke"], "1 if the last probe of the spoke's hub succeeded, else 0."
)
SPOKE_HUB_PROBE_FAILURES = counter(
    "spoke", "spoke_hub_probe_failures_total", "", ["spoke", "reason"],
    "Probes of the spoke's hub that failed, by reason: connect (refused, unreachable, DNS), timeout (no complete "
    "answer within the timeout), tls (handshake or certificate), protocol (not an HTTP answer), status (not 2xx: an "
    "error, or a redirect, which is not followed).",
)
SPOKE_COLLECTOR_ERRORS = counter(
    "spoke", "spoke_collector_errors_total", "", ["spoke", "reason"],
    "Problems reading the spoke's statistics: malformed, oversize or lost log lines, failed scrapes, timeouts.",
)
# NFS client view of a spoke mounted over NFS (/proc/self/mountstats, READ operations only): the
# spoke's latency as the node sees it, where the spoke itself has no hit/miss counter.
SPOKE_NFS_READ_OPERATIONS = counter(
    "spoke", "spoke_nfs_read_operations_total", "", ["spoke"], "NFS READ operations the node sent to the spoke."
)
SPOKE_NFS_READ_BYTES = counter(
    "spoke", "spoke_nfs_read_bytes_total", "bytes", ["spoke"],
    "Bytes received in NFS READ replies from the spoke, RPC headers included.",
)
SPOKE_NFS_READ_RTT = counter(
    "spoke", "spoke_nfs_read_rtt_seconds_total", "seconds", ["spoke"],
    "Summed round-trip time of NFS READs: request sent to reply received.",
)
SPOKE_NFS_READ_EXECUTE = counter(
    "spoke", "spoke_nfs_read_execute_seconds_total", "seconds", ["spoke"],
    "Summed execute time of NFS READs: queued, sent, retransmitted and answered.",
)
SPOKE_NFS_READ_MAJOR_TIMEOUTS = counter(
    "spoke", "spoke_nfs_read_major_timeouts_total", "", ["spoke"],
    "NFS READs that hit a major timeout (the spoke did not answer through all retransmissions).",
)
SPOKE_NFS_READ_ERRORS = counter(
    "spoke", "spoke_nfs_read_errors_total", "", ["spoke"],
    "NFS READs that completed with an error (kernels with mountstats statvers 1.1 and per-op errors).",
)


# --- correlator: stall attribution, GPU idle, warm-up, cache what-if ---------------------------------
@dataclass(frozen=True)
class Cause:
    """A cause a stall's instants are booked to: its label value, its colour in figures, what its instants
    are, and where its seconds point (runbooks)."""

    name: str
    colour: str
    meaning: str
    points_at: str


# In booking order: an instant covered by several goes to the first (attribution.py); `other` takes the rest.
REMOTE_FETCH = Cause("remote_fetch", "#d0021b", "reading a batch's data that missed the spoke (from the hub)",
                     "the spoke: cold, smaller than the working set, or a slow hub link")
CACHE_READ = Cause("cache_read", "#f5a623", "reading a batch's data the spoke served (hits)",
                   "the spoke's local cache disk")
DIRECT_READ = Cause("direct_read", "#8b572a", "reading a batch's data through no spoke (local disk, a mount or "
                    "bucket read directly)", "storage the node reads through no spoke")
PREPROCESS = Cause("preprocess", "#9013fe", "a loader worker busy on the batch, not reading (decoding, augmenting)",
                   "CPU-bound loader workers")
DELIVERY = Cause("delivery", "#4a90e2", "the finished batch on its way to the trainer (pickling, queues, "
                 "pin-memory)", "the batch's trip from its worker (payload size, Python objects, copies, or the "
                 "worker's own Python holding the interpreter lock its sending threads need)")
OTHER = Cause("other", "#9b9b9b", "none of the above: the worker had not started the batch, or reads went unseen",
              "missing read events (is the client wrapping the loader's dataset?)")
CAUSE_TABLE = (REMOTE_FETCH, CACHE_READ, DIRECT_READ, PREPROCESS, DELIVERY, OTHER)
CAUSES = tuple(cause.name for cause in CAUSE_TABLE)
PHASES = ("cold", "transition", "steady")
STALL_SECONDS = counter(
    "correlator", "stall_seconds_total", "seconds", [JOB_LABEL, "rank", "cause"],
    "Loader-wait seconds above the stall threshold, each attributed to exactly one cause.",
)
JOB_STALL_SECONDS = counter(
    "correlator", "job_stall_seconds_total", "seconds", [JOB_LABEL],
    "Seconds in which at least one of the job's ranks on this node waited for input above the stall threshold "
    "(the union of their stalls in time): what a synchronous job loses per GPU to this node's input stalls.",
)
COMPUTE_SECONDS = counter(
    "correlator", "compute_seconds_total", "seconds", [JOB_LABEL, "rank"], "Seconds the rank spent computing."
)
INPUT_BOUND_RATIO = gauge(
    "correlator", "input_bound_ratio", "ratio", [JOB_LABEL, "rank"],
    "Share of step time spent waiting for input over the last window: wait / (wait + compute).",
)
GPU_STALL_IDLE_SECONDS = counter(
    "correlator", "gpu_stall_idle_seconds_total", "seconds", [JOB_LABEL, "gpu", "cause"],
    "GPU idle seconds (from NVML samples) during stalls of the rank on that GPU, by the stall's cause.",
)
WARMUP_PHASE = gauge(
    "correlator", "warmup_phase", "", [JOB_LABEL, "phase"],
    "1 for the job's current phase: cold, transition, steady."
)
WARMUP_TIME_TO_STEADY = gauge(
    "correlator", "warmup_time_to_steady_seconds", "seconds", [JOB_LABEL],
    "Seconds from the job's first event to its first steady window.",
)
WARMUP_IDLE_GPU_SECONDS = gauge(
    "correlator", "warmup_idle_gpu_seconds", "seconds", [JOB_LABEL],
    "GPU idle seconds during stalls from the job's start until steady state: the warm-up's cost.",
)
WARMUP_HUB_BYTES = gauge(
    "correlator", "warmup_hub_bytes", "bytes", [JOB_LABEL], "Bytes fetched from the hub until steady state."
)
WARMUP_FORECAST_TIME_TO_STEADY = gauge(
    "correlator", "warmup_forecast_time_to_steady_seconds", "seconds", [JOB_LABEL],
    "While the job is cold, the forecast of warmup_time_to_steady_seconds (+Inf: never steady: the working set "
    "does not fit the spoke, or nothing is read twice); once steady, the actual. Absent until it can be told.",
)
WARMUP_FORECAST_IDLE_GPU_SECONDS = gauge(
    "correlator", "warmup_forecast_idle_gpu_seconds", "seconds", [JOB_LABEL],
    "GPU idle seconds in stalls the forecast expects before the job is steady, beyond those so far.",
)
WARMUP_FORECAST_HUB_BYTES = gauge(
    "correlator", "warmup_forecast_hub_bytes", "bytes", [JOB_LABEL],
    "Bytes the forecast expects the job to fetch from the hub before it is steady, beyond those so far.",
)
WARMUP_REGRESSIONS = counter(
    "correlator", "warmup_regressions_total", "", [JOB_LABEL],
    "Times the job fell out of steady state (eviction, thrash, hub trouble).",
)
STALL_GPU_COST = counter(
    "correlator", "stall_gpu_cost_dollars_total", "dollars", [JOB_LABEL, "cause"],
    "GPU idle seconds during the job's stalls, by cause, priced at the GPU-hour list price (--prices.*).",
)
EGRESS_COST = counter(
    "correlator", "egress_cost_dollars_total", "dollars", [JOB_LABEL],
    "Bytes of the job's reads that missed the spoke (fetched from the hub), priced at the egress list price "
    "(--prices.*).",
)
GPU_PRICE = gauge(
    "correlator", "gpu_price_dollars_per_second", "", ["gpu_type"],
    "The price of an idle GPU-second the cost series use: the GPU-hour price (--prices.*) over 3600.",
)
EPOCH_STEPS = gauge(
    "correlator", "epoch_steps", "", [JOB_LABEL],
    "Steps of an epoch of the job, as its trainers' loaders report it (their len()): the report's figures per epoch.",
)
DATASET_SIZE = gauge(
    "correlator", "dataset_size_bytes", "bytes", [],
    "The size of the dataset the node's jobs read, as the agent was given it (--correlator.dataset-size): the warm-up "
    "forecast's working set, and the report's copy in its stage-or-stream weighing.",
)
EGRESS_PRICE = gauge(
    "correlator", "egress_price_dollars_per_byte", "", ["region_pair"],
    "The price of a byte from the hub the cost series use: the GB price (--prices.*) over 10^9.",
)
CACHE_WHATIF_HIT_RATIO = gauge(
    "correlator", "cache_whatif_hit_ratio", "ratio", ["spoke", "capacity_factor"],
    "Estimated hit ratio if the spoke had capacity_factor times its capacity (sampled miss-ratio curve).",
)
CACHE_WHATIF_SAMPLING = gauge(
    "correlator", "cache_whatif_sampling_ratio", "ratio", ["spoke"],
    "Share of keys the what-if's miss-ratio curve samples: 1 until it tracks its cap of keys, lower after.",
)
CACHE_WHATIF_KEYS = gauge(
    "correlator", "cache_whatif_keys", "", ["spoke"],
    "Keys the what-if's miss-ratio curve tracks; divided by its sample rate, the distinct keys read.",
)
CORRELATOR_WINDOWS = counter(
    "correlator", "correlator_windows_total", "", [], "Windows the correlator closed and published."
)
CORRELATOR_LATE_EVENTS = counter(
    "correlator", "correlator_late_events_total", "", ["kind"],
    "Events that arrived after their window closed (beyond the allowed lateness) and were not attributed.",
)
CORRELATOR_DROPPED_EVENTS = counter(
    "correlator", "correlator_dropped_events_total", "", ["kind", "reason"],
    "Events the correlator dropped, whole batches at a time: reason malformed (the batch broke the contract), "
    "backlog (input queue full) or window_full (the window store held its cap of events of that kind).",
)

CORRELATOR_FOLDED_LABELS = counter(
    "correlator", "correlator_folded_label_values_total", "", ["label"],
    "Window rows whose (job, rank) pair (label=rank) or (job, gpu) pair (label=gpu) was past the per-node cap "
    "(--events.rank-limit live pairs) and was folded into the value __other__ of its job.",
)
CORRELATOR_RECORD_ERRORS = counter(
    "correlator", "correlator_record_errors_total", "", ["recording", "reason"],
    "Records the correlator could not write to its recording (recording=events for --correlator.record-events, "
    "windows for --correlator.record-windows), by cause (reason=ENOSPC: the disk is full); each is left out "
    "whole and attribution goes on.",
)

def all_metrics() -> tuple[AnyMetricDef, ...]:
    return tuple(_ALL)


def by_subsystem(subsystem: str) -> tuple[AnyMetricDef, ...]:
    return tuple(m for m in _ALL if m.subsystem == subsystem)


def family_names(metrics: Iterable[AnyMetricDef]) -> list[str]:
    """Sample names as they appear in the exposition, e.g. for a histogram its _bucket/_sum/_count."""
    names: list[str] = []
    for m in metrics:
        if m.kind is Kind.HISTOGRAM:
            names += [m.name + "_bucket", m.name + "_sum", m.name + "_count"]
        else:
            names.append(m.name)
    return names
