"""Event streams with known causes: a small discrete-event simulation of training nodes.

Each rank runs a trainer and a DataLoader-like pool of workers (round-robin batches, a prefetch
window of `prefetch` batches per worker, dispatch of batch k + prefetch·workers when batch k is
consumed). A worker reads its batch's items one after another through one shared LRU spoke (hits
take `hit_s`, misses `miss_s`, misses during a hub outage wait for its end), then preprocesses.
The trainer waits for batch k, then computes. GPUs are busy exactly while their rank computes.

Because the simulation knows what the awaited worker did at every instant of every wait, each stall
comes with its true split among the causes; the generator also records when each job's cache
became warm and the exact LRU hit ratio at other capacities. GPU samples come the agent's way: the
fake NVML, its GPUs busy exactly in the ranks' compute spans and sampling like a real driver
(irregular periods, gaps), read by the real gpu collector polling every half second. Output: the
`EventBatch`es an agent would see (`step`, `read`, `spoke_request`, `gpu_util`, and the `open` records each
trainer and worker sends at its flushes every 0.2 s), in arrival order with bounded delays.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from stallwatch.catalogue import CAUSES
from stallwatch.client import wire
from stallwatch.client.transport import FLUSH_INTERVAL_NS
from stallwatch.eventbatch import SCHEMAS, EventBatch, Verdict
from stallwatch.exporters.gpu import GpuCollector
from stallwatch.exporters.nvml_fake import ComputeTrace, DriverSampling, FakeGpu, FakeNVML

NS = 1_000_000_000


@dataclass(frozen=True)
class JobSpec:
    job: int
    steps: int
    ranks: int = 1
    workers: int = 4
    prefetch: int = 2
    reads_per_batch: int = 4
    item_bytes: int = 1 << 20
    dataset_items: int = 400
    new_item_fraction: float = 0.0  # reads of never-seen items (a streaming dataset): always misses
    compute_s: float = 0.05
    preprocess_s: float = 0.01
    delivery_s: float = 0.0  # from the worker handing a batch over to the trainer having it (pickling, queues)
    first_gpu: int = 0
    tagged: bool = True
    verdicts: str = "read"  # where the verdict is known: "read" (header), "spoke" (log) or "latency"
    clock_skew_s: float = 0.0  # each worker's clock is off by a fixed amount within ±this
    start_s: float = 0.0
    epoch_known: bool = False  # the trainer reports its epoch's progress (a loader with a len(): OPEN_EPOCH)


@dataclass(frozen=True)
class Scenario:
    jobs: Sequence[JobSpec]
    cache_bytes: int
    hit_s: tuple[float, float] = (0.002, 0.004)
    miss_s: tuple[float, float] = (0.040, 0.080)
    outages: Sequence[tuple[float, float]] = ()
    evictions: Sequence[float] = ()  # moments the spoke loses everything it holds (a restart, another job's flood)
    prewarm: bool = False  # the spoke already holds every dataset item
    max_delay_s: float = 0.5  # events reach the agent up to this late (out of order)
    gpu_period_s: float = 1 / 6  # the driver's nominal sample period
    gpu_sampling: DriverSampling | None = field(default_factory=DriverSampling)  # None: an ideal grid
    in_flight: bool = True  # sources report what they have open at their flushes, as the client does
    seed: int = 0


@dataclass
class Truth:
    stall_s: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (job, rank) -> per cause
    last_miss_s: dict[int, float] = field(default_factory=dict)  # per job: after it, every read hits
    first_event_s: dict[int, float] = field(default_factory=dict)
    stalls: dict[tuple[int, int], int] = field(default_factory=dict)  # (job, rank) -> how many
    reads: list[tuple[int, int]] = field(default_factory=list)  # (key, bytes) in spoke order
    end_s: float = 0.0

    def stall_by_job(self, job: int) -> np.ndarray:
        return sum((v for (j, _), v in self.stall_s.items() if j == job), np.zeros(len(CAUSES)))


@dataclass
class Generated:
    batches: list[EventBatch]
    truth: Truth


class LruCache:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.items: OrderedDict[int, int] = OrderedDict()

    def access(self, key: int, size: int) -> bool:
        if key in self.items:
            self.items.move_to_end(key)
            return True
        self.items[key] = size
        self.used += size
        while self.used > self.capacity and self.items:
            _, evicted = self.items.popitem(last=False)
            self.used -= evicted
        return False


def exact_lru_hit_ratio(reads: Sequence[tuple[int, int]], capacity: float) -> float:
    cache = LruCache(int(capacity))
    hits = sum(cache.access(key, size) for key, size in reads)
    return hits / len(reads) if reads else 0.0


def _key(job: int, item: int) -> int:
    return (job * 1_000_003 + item) * 0x9E3779B97F4A7C15 % 2**64


@dataclass
class _Rank:
    spec: JobSpec
    rank: int
    gpu: int
    order: list[int]
    skews: list[float]
    ready: dict[int, float] = field(default_factory=dict)  # batch -> when the trainer can have it
    handed_over: dict[int, float] = field(default_factory=dict)  # batch -> when its worker finished it
    queues: list[deque[tuple[float, int]]] = field(default_factory=list)  # per worker: (dispatched at, batch)
    busy: list[bool] = field(default_factory=list)
    segments: dict[int, list[tuple[float, float, int]]] = field(default_factory=dict)  # batch -> (s, e, cause)
    next_step: int = 0
    compute_end: float = 0.0
    steps: list[tuple[int, float, float, float]] = field(default_factory=list)  # batch, ws, we, ce
    reads: list[tuple[int, int, float, float, int]] = field(default_factory=list)  # worker, batch, start, end, key


def generate(scenario: Scenario) -> Generated:
    rng = random.Random(scenario.seed)
    cache = LruCache(scenario.cache_bytes)
    truth = Truth()
    reads: list[tuple] = []
    spoke: list[tuple] = []
    heap: list[tuple[float, int, int, int, int]] = []  # (time, seq, rank index, batch, read index)
    seq = 0
    ranks: list[_Rank] = []
    new_items = 10_000_000
    for spec in scenario.jobs:
        if scenario.prewarm:
            for item in range(spec.dataset_items):
                cache.access(_key(spec.job, item), spec.item_bytes)
        for r in range(spec.ranks):
            n_items = spec.steps * spec.reads_per_batch
            order: list[int] = []
            while len(order) < n_items:
                epoch = list(range(spec.dataset_items))
                rng.shuffle(epoch)
                order += epoch
            order = [new_items + i if rng.random() < spec.new_item_fraction else item
                     for i, item in enumerate(order[:n_items])]
            skews = [rng.uniform(-spec.clock_skew_s, spec.clock_skew_s) for _ in range(spec.workers)]
            state = _Rank(spec, r, spec.first_gpu + r, order, skews, queues=[deque() for _ in range(spec.workers)],
                          busy=[False] * spec.workers, compute_end=spec.start_s)
            ranks.append(state)
            for k in range(min(spec.prefetch * spec.workers, spec.steps)):
                seq = _dispatch(state, len(ranks) - 1, k, spec.start_s, heap, seq)
            truth.first_event_s[spec.job] = spec.start_s

    def outage_end(t: float) -> float:
        return max((end for start, end in scenario.outages if start <= t < end), default=t)

    evictions = sorted(scenario.evictions)
    while heap:
        t, _, index, k, i = heapq.heappop(heap)
        while evictions and evictions[0] <= t:
            evictions.pop(0)
            cache = LruCache(scenario.cache_bytes)
        state = ranks[index]
        spec = state.spec
        worker = k % spec.workers
        if i == spec.reads_per_batch:  # the batch's reads are done: preprocess, then it is ready
            done = t + spec.preprocess_s
            state.segments[k].append((t, done, CAUSES.index("preprocess")))
            state.segments[k].append((done, done + spec.delivery_s, CAUSES.index("delivery")))
            state.busy[worker] = False
            state.handed_over[k] = done
            state.ready[k] = done + spec.delivery_s
            seq = _advance_trainer(state, index, heap, seq)
            seq = _start_next(state, index, worker, done, heap, seq)
            continue
        if i == 0:
            state.segments[k] = []
        item = state.order[k * spec.reads_per_batch + i]
        key = _key(spec.job, item)
        hit = cache.access(key, spec.item_bytes)
        truth.reads.append((key, spec.item_bytes))
        if hit:
            end = t + rng.uniform(*scenario.hit_s)
        else:
            end = outage_end(t) + rng.uniform(*scenario.miss_s)
            truth.last_miss_s[spec.job] = t
        state.segments[k].append((t, end, CAUSES.index("cache_read" if hit else "remote_fetch")))
        state.reads.append((worker, k, t, end, key))
        skew = state.skews[worker]
        verdict = Verdict.HIT if hit else Verdict.MISS
        reads.append((spec.job, state.rank, worker, k if spec.tagged else -1, key, spec.item_bytes, t + skew,
                      end + skew, verdict if spec.verdicts == "read" else Verdict.UNKNOWN))
        if spec.verdicts == "spoke":
            spoke.append((0, key, spec.item_bytes, end, end - t, -1 if hit else end - t, verdict))
        heapq.heappush(heap, (end, seq, index, k, i + 1))
        seq += 1

    steps: list[tuple] = []
    for state in ranks:
        spec = state.spec
        for k, ws, we, ce in state.steps:
            # The client stamps the handover inside the batch, which only a tagged (batched) loader has.
            handover = state.handed_over[k] if spec.tagged else -1.0
            steps.append((spec.job, state.rank, state.gpu, k, ws, we, ce, handover))
            split = np.zeros(len(CAUSES))
            for s, e, cause in state.segments[k]:
                split[cause] += max(0.0, min(e, we) - max(s, ws))
            split[CAUSES.index("other")] += (we - ws) - split.sum()
            total = truth.stall_s.setdefault((spec.job, state.rank), np.zeros(len(CAUSES)))
            if we - ws > 0.001:
                total += split
                truth.stalls[(spec.job, state.rank)] = truth.stalls.get((spec.job, state.rank), 0) + 1
        truth.end_s = max(truth.end_s, state.compute_end)
    gpu_rows = _gpu_samples(ranks, scenario, truth.end_s)
    opened = [row for state in ranks for row in _open_records(state)] if scenario.in_flight else []
    batches = _arrange(rng, scenario.max_delay_s, steps, reads, spoke, gpu_rows, opened)
    return Generated(batches, truth)


FLUSH_S = FLUSH_INTERVAL_NS / 1e9


def _open_records(state: _Rank) -> list[tuple]:
    """The open records a rank's trainer and workers send at their flushes (`open` rows, seconds): the trainer's
    open wait and its loop's end; per worker, the batch it builds, its open read and its latest handover."""
    spec = state.spec
    rows: list[tuple] = []
    gpu = state.gpu
    for _, ws, we, _ in state.steps:
        flush = ws + FLUSH_S * 0.5  # each wait seen open at the flushes within it
        while flush < we:
            rows.append((spec.job, state.rank, gpu, -1, wire.OPEN_WAIT, -1, 0, ws, flush))
            flush += FLUSH_S
    rows.append((spec.job, state.rank, gpu, -1, wire.OPEN_ENDED, -1, 0, state.compute_end, state.compute_end))
    if spec.epoch_known:
        rows += _epoch_records(state)
    if not spec.tagged:
        return rows
    for worker in range(spec.workers):
        skew = state.skews[worker]
        batches = sorted((state.segments[k][0][0], state.handed_over[k], k) for k in state.handed_over
                         if k % spec.workers == worker)
        reads = [r for r in state.reads if r[0] == worker]
        flush = spec.start_s + FLUSH_S * (worker + 1) / (spec.workers + 1)
        end = max((done for _, done, _ in batches), default=spec.start_s)
        while flush <= end:
            looked = flush + skew
            for began, done, k in batches:
                if began <= flush < done:
                    rows.append((spec.job, state.rank, gpu, worker, wire.OPEN_BATCH, k, 0, began + skew, looked))
            for _, k, start, stop, key in reads:
                if start <= flush < stop:
                    rows.append((spec.job, state.rank, gpu, worker, wire.OPEN_READ, k, key, start + skew, looked))
            handed = [(done, k) for _, done, k in batches if done <= flush]
            if handed:
                done, k = max(handed)
                rows.append((spec.job, state.rank, gpu, worker, wire.OPEN_HANDED, k, 0, done + skew, looked))
            flush += FLUSH_S
    return rows


def _epoch_records(state: _Rank) -> list[tuple]:
    """The trainer's epoch progress at each flush that sends steps: an epoch is a pass over the dataset, its
    loop begun at its first step's wait."""
    spec = state.spec
    length = spec.dataset_items // spec.reads_per_batch
    ends = [ce for _, _, _, ce in state.steps]
    rows: list[tuple] = []
    flush, sent = spec.start_s + FLUSH_S, 0
    while sent < len(ends):
        done = bisect.bisect_right(ends, flush)
        if done > sent:
            epoch = min(done // length, (len(ends) - 1) // length)  # after its last step, the last epoch's end
            began = state.steps[epoch * length][1] if epoch else spec.start_s
            rows.append((spec.job, state.rank, state.gpu, -1, wire.OPEN_EPOCH, done - epoch * length, length,
                         began, flush))
            sent = done
        flush += FLUSH_S
    return rows


def _advance_trainer(state: _Rank, index: int, heap: list, seq: int) -> int:
    """Consume every batch that is ready, in order; each consumed batch dispatches a new one."""
    spec = state.spec
    while state.next_step < spec.steps and state.next_step in state.ready:
        k = state.next_step
        ws = state.compute_end
        we = max(ws, state.ready.pop(k))
        ce = we + spec.compute_s
        state.steps.append((k, ws, we, ce))
        state.compute_end = ce
        state.next_step += 1
        following = k + spec.prefetch * spec.workers
        if following < spec.steps:  # consuming batch k sends the index of a new one
            seq = _dispatch(state, index, following, we, heap, seq)
    return seq


def _dispatch(state: _Rank, index: int, batch: int, at: float, heap: list, seq: int) -> int:
    """Send a batch index to its worker (round-robin); an idle worker starts on it at once."""
    worker = batch % state.spec.workers
    state.queues[worker].append((at, batch))
    return _start_next(state, index, worker, at, heap, seq)


def _start_next(state: _Rank, index: int, worker: int, free_at: float, heap: list, seq: int) -> int:
    """A free worker takes its oldest dispatched batch, once both it and the index are there."""
    if state.busy[worker] or not state.queues[worker]:
        return seq
    dispatched, batch = state.queues[worker].popleft()
    state.busy[worker] = True
    heapq.heappush(heap, (max(free_at, dispatched), seq, index, batch, 0))
    return seq + 1


def _gpu_samples(ranks: list[_Rank], scenario: Scenario, end: float) -> list[tuple]:
    """(ts, period, gpu, util) rows, scenario seconds, as the agent's gpu collector emits them. The
    agent runs from 5 s before the jobs start, as it would: its samples from then are kept."""
    now = [-5.0]
    wall_zero = 1_700_000_000.0
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for state in ranks:
        spans[state.gpu] += [(wall_zero + we, wall_zero + ce) for _, _, we, ce in state.steps]
    gpus = [FakeGpu(trace=ComputeTrace.of_spans(sorted(spans.get(gpu, [])))) for gpu in range(max(spans) + 1)]
    sampling = scenario.gpu_sampling
    if sampling is not None:
        sampling = replace(sampling, seed=scenario.seed)
    nvml = FakeNVML(gpus, clock=lambda: wall_zero + now[0], sample_period=scenario.gpu_period_s,
                    pcie_latency=0.0, sampling=sampling)
    emitted: list[EventBatch] = []
    collector = GpuCollector(nvml, pcie_interval=0.0, sink=emitted.append, clock=lambda: wall_zero + now[0],
                             start=False)
    rows: list[tuple[float, float, int, float]] = []
    while now[0] <= end + 1.0:
        collector.poll()
        # The collector maps the driver's wall-clock stamps onto this process's monotonic clock.
        wall_to_monotonic_ns = time.monotonic_ns() - time.time_ns()
        for batch in emitted:
            seconds = (batch.columns["ts_ns"].astype(np.int64) - wall_to_monotonic_ns) / 1e9 - wall_zero
            rows += zip(seconds.tolist(), (batch.columns["period_ns"].astype(np.int64) / 1e9).tolist(),
                        batch.columns["gpu"].tolist(), batch.columns["util"].tolist(), strict=True)
        emitted.clear()
        now[0] += 0.5
    collector.close()
    return [row for row in rows if row[2] in spans]


# Rows are tuples in the contract's column order; times and durations in them are seconds.
_TIMES = frozenset({"wait_start_ns", "wait_end_ns", "compute_end_ns", "start_ns", "end_ns", "ts_ns", "since_ns",
                    "as_of_ns"})
_OPTIONAL_TIMES = frozenset({"ready_ns"})  # times that may be unknown: negative, -1
_DURATIONS = frozenset({"duration_ns", "upstream_ns", "period_ns"})  # negative: -1, "none"
BASE_NS = 10**12  # monotonic clocks do not start at zero


def _arrange(
    rng: random.Random, max_delay: float, steps: list, reads: list, spoke: list, gpu: list, opened: list
) -> list[EventBatch]:
    """Rows -> batches of 100 ms of arrival time per kind, every row delayed by up to `max_delay`. A source that
    reports what it has open sends its reads with the next report, as the client does (one flush, one
    datagram): a report that no longer has a read open comes with or after that read. A GPU's samples arrive
    in the order they were taken, as the agent's own collector hands them on."""
    slices: dict[tuple[int, str], list[tuple]] = defaultdict(list)
    reports: dict[tuple[int, int, int], list[float]] = defaultdict(list)  # per source, the times it reported
    arrival: dict[tuple[int, int, int, float], float] = {}
    for job, rank, _, worker, *_, as_of in opened:
        if (job, rank, worker, as_of) not in arrival:
            reports[(job, rank, worker)].append(as_of)
            arrival[(job, rank, worker, as_of)] = as_of + rng.uniform(0, max_delay)
    for source, times in reports.items():  # a source's datagrams arrive in the order it sent them
        times.sort()
        for before, after in itertools.pairwise(times):
            arrival[(*source, after)] = max(arrival[(*source, after)], arrival[(*source, before)])

    gpu_arrival: dict[int, float] = {}  # per GPU, its latest sample's arrival

    def arrives(kind: str, row: tuple, at: float) -> float:
        if kind == "open":
            return arrival[(row[0], row[1], row[3], at)]
        flushes = reports.get((row[0], row[1], row[2])) if kind == "read" else None
        if flushes and at <= flushes[-1]:
            report = flushes[bisect.bisect_left(flushes, at)]
            return arrival[(row[0], row[1], row[2], report)]
        delayed = at + rng.uniform(0, max_delay)
        if kind == "gpu_util":  # the agent's gpu collector hands a GPU's samples on in the order it read them
            delayed = gpu_arrival[row[2]] = max(delayed, gpu_arrival.get(row[2], delayed))
        return delayed

    for kind, rows in (("step", steps), ("read", reads), ("spoke_request", spoke), ("gpu_util", gpu),
                       ("open", opened)):
        when = list(SCHEMAS[kind].columns).index(SCHEMAS[kind].event_time)
        for row in rows:
            slices[(int(arrives(kind, row, row[when]) * 10), kind)].append(row)
    batches = []
    # Within a slice, a source's open records come after its reads, as the agent hands a datagram's on.
    for (_, kind), rows in sorted(slices.items(), key=lambda item: (item[0][0], item[0][1] == "open", item[0][1])):
        columns: dict[str, Any] = {}
        for position, name in enumerate(SCHEMAS[kind].columns):
            values = [row[position] for row in rows]
            if name in _TIMES:
                columns[name] = (np.array(values) * NS).round().astype(np.int64) + BASE_NS
            elif name in _OPTIONAL_TIMES:
                at = np.array(values)
                columns[name] = np.where(at < 0, -1, (at * NS).round().astype(np.int64) + BASE_NS)
            elif name in _DURATIONS:
                columns[name] = np.where(np.array(values) < 0, -1, (np.array(values) * NS).round()).astype(np.int64)
            else:
                columns[name] = values
        batches.append(EventBatch.of(kind, columns))
    return batches
