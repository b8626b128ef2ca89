"""Window results folded into the correlator's metrics (catalogue, `correlator` section)."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.catalogue import CAUSES, PHASES, AnyMetricDef
from stallwatch.correlator.forecast import Forecast
from stallwatch.correlator.hold import Publication
from stallwatch.correlator.results import NameLookup, WhatIfCurve, WindowResult, stalled_seconds
from stallwatch.correlator.wallclock import unix_seconds, wall_offset_ns
from stallwatch.eventbatch import DEFAULT_EXPIRE_AFTER_S, Interner, SeriesCap
from stallwatch.prices import GB, Prices
from stallwatch.scraper import SCRAPER

NO_SPOKE = "default"
# Per job, the published windows kept for scrapers that have not taken them yet: 32 s of 0.5 s windows, more
# than a 30 s scrape interval's. Per scraper, the newest window it took of each job; scrapers remembered.
PUBLISHED_WINDOWS = 64
SCRAPERS = 16


def whatif_spoke_label(spokes: Interner) -> str:
    """The what-if's `spoke` label: the spoke names the spoke collectors interned, in order, joined by
    `+` (the what-if replays all of the node's reads, it cannot tell spokes apart), or `default` when
    reads arrive but no spoke collector named a spoke."""
    return "+".join(spokes.names()) or NO_SPOKE


class CorrelatorMetrics:
    """Thread-safe: `observe` and `publish` run on the pipeline's thread, `collect` on the scrape's.

    Two inputs: `observe` takes every closed window (the node-wide what-if, windows_total, retired jobs),
    `publish` each job's windows as the window hold (hold.py) releases them. A published series carries
    an explicit sample timestamp, the end on the wall clock of the job's latest published window, so
    Prometheus stores it at event time, where the GPU dip it explains is (docs/attribution.md); a job's
    timestamps only rise. The what-if carries the latest closed window's end; the operational series
    (windows, late and dropped events, folded labels, record errors) are stamped at scrape as usual.

    The receiver's caps hold here too (`SeriesCap`, by window end time): at most `rank_limit` live
    (job, rank) pairs, and as many (job, gpu) pairs, past which a rank or GPU folds into `__other__`
    of its job (the folded ranks' stall and compute seconds add up there; its input-bound ratio is the
    last folded rank's), counted per window row in `correlator_folded_label_values_total`. A pair
    with no row for `expire_after_s` loses its series, and a job its per-job series once the warm-up
    tracker retires it (after the same time without a step).

    The cost series price what the job's rows add: its GPUs' idle seconds in stalls by cause, and its hub bytes,
    at `prices`, themselves published so a dashboard shows what the dollars assume.
    """

    def __init__(self, job_names: NameLookup = str, spokes: Interner | None = None, rank_limit: int = 64,
                 expire_after_s: float | None = DEFAULT_EXPIRE_AFTER_S,
                 wall_offset: Callable[[], int] = wall_offset_ns, prices: Prices | None = None,
                 gpu_names: Callable[[int], str] = lambda gpu: "", dataset_bytes: int | None = None) -> None:
        self._job_names = job_names
        self._prices = prices or Prices()
        self._gpu_names = gpu_names  # NVML's name of a GPU by index, for its type's price under `auto`
        self._gpu_prices: dict[str, float] = {}  # $/s by GPU type, of the GPUs priced so far
        self._dataset_bytes = dataset_bytes
        self._spokes = spokes if spokes is not None else Interner()
        self._wall_offset = wall_offset
        self._job_labels: dict[int, str] = {}  # ids of the jobs with series, until the warm-up retires them
        self._ranks: SeriesCap[str] = SeriesCap(rank_limit, expire_after_s)
        self._gpus: SeriesCap[str] = SeriesCap(rank_limit, expire_after_s)
        # (job, rank or GPU) -> the labels its rows go under, as admitted when its window closed
        self._rank_labels: dict[tuple[str, str], tuple[str, str]] = {}
        self._gpu_labels: dict[tuple[str, str], tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._stall: dict[tuple[str, ...], float] = defaultdict(float)
        self._compute: dict[tuple[str, ...], float] = defaultdict(float)
        self._ratio: dict[tuple[str, ...], float] = {}
        self._gpu_idle: dict[tuple[str, ...], float] = defaultdict(float)
        self._gpu_cost: dict[tuple[str, ...], float] = defaultdict(float)  # (job, cause)
        self._egress_cost: dict[str, float] = defaultdict(float)
        self._phase: dict[str, str] = {}
        self._time_to_steady: dict[str, float] = {}
        self._warmup_idle: dict[str, float] = {}
        self._warmup_bytes: dict[str, float] = {}
        self._forecast: dict[str, Forecast] = {}
        self._epoch_steps: dict[str, int] = {}
        self._regressions: dict[str, float] = {}
        self._job_stall: dict[str, float] = defaultdict(float)
        self._stamp: dict[str, float] = {}  # job -> unix time its series are published at
        # job -> (stamp, its series by job table) of its latest windows; scraper -> job -> newest stamp it took
        self._published: dict[str, deque[tuple[float, list[dict[tuple[str, ...], float]]]]] = {}
        self._taken: OrderedDict[str, dict[str, float]] = OrderedDict()
        self._whatif: dict[float, float] = {}
        self._whatif_curve: WhatIfCurve | None = None
        self._whatif_stamp: float | None = None
        self._windows = 0
        self._now = 0  # the newest closed window's end (ns): the caps' clock
        self._late: dict[str, int] = {}
        self._dropped: dict[tuple[str, str], int] = {}
        self._record_errors: dict[tuple[str, str], int] = {}

    def observe(self, result: WindowResult) -> None:
        """Every closed window, after the hold took it: node-wide results, and jobs the warm-up retired."""
        with self._lock:
            self._windows += 1
            self._now = max(self._now, result.end_ns)
            # A rank or GPU is seen when its rows close, held or not: a job held through a stall keeps its series.
            for part in (result, *result.earlier):
                for r in part.ranks:
                    self._seen((self._job_label(r.job), str(r.rank)), self._ranks, self._rank_labels)
                for g in part.gpus:
                    self._seen((self._job_label(g.job), str(g.gpu)), self._gpus, self._gpu_labels)
            self._expire(self._now)
            self._whatif.update(result.whatif)
            self._whatif_curve = result.whatif_curve or self._whatif_curve
            self._whatif_stamp = _later(unix_seconds(result.end_ns, self._wall_offset()), self._whatif_stamp)
            for retired in result.retired_jobs:
                self._forget(self._job_labels.pop(retired, "") or self._job_names(retired))

    def publish(self, publication: Publication) -> None:
        """One window of the jobs the hold released, into the counters and gauges, stamped with its end."""
        result = publication.result
        name = self._job_label
        stamp = unix_seconds(result.end_ns, publication.wall_offset_ns)
        with self._lock:
            for job_id in result.job_ids():
                self._stamp[name(job_id)] = _later(stamp, self._stamp.get(name(job_id)))
            for r in result.ranks:
                labels = self._labels((name(r.job), str(r.rank)), self._ranks, self._rank_labels)
                self._compute[labels] += r.compute_s
                self._ratio[labels] = r.input_bound_ratio
                for cause, seconds in zip(CAUSES, r.stall_s, strict=True):
                    self._stall[(*labels, cause)] += seconds
            for g in result.gpus:
                job_gpu = self._labels((name(g.job), str(g.gpu)), self._gpus, self._gpu_labels)
                priced = self._prices.for_gpu(self._gpu_names(g.gpu))
                self._gpu_prices[priced.gpu_type] = priced.gpu_dollars_per_hour / 3600
                for cause, seconds in zip(CAUSES, g.idle_s, strict=True):
                    self._gpu_idle[(*job_gpu, cause)] += seconds
                    self._gpu_cost[(job_gpu[0], cause)] += priced.gpu_cost(seconds)
            for j in result.jobs:
                job = name(j.job)
                self._egress_cost[job] += self._prices.egress_cost(j.hub_bytes)
                self._phase[job] = j.phase
                if j.time_to_steady_s is not None:
                    self._time_to_steady[job] = j.time_to_steady_s
                self._warmup_idle[job] = j.warmup_idle_gpu_s
                self._warmup_bytes[job] = j.warmup_hub_bytes
                if j.forecast is not None:
                    self._forecast[job] = j.forecast
                if j.epoch_steps is not None:
                    self._epoch_steps[job] = j.epoch_steps
                self._regressions[job] = j.regressions
            for job_id, spans in result.stall_spans.items():
                self._job_stall[name(job_id)] += stalled_seconds(spans)
            for job_id in result.job_ids():
                self._snapshot(name(job_id))

    def _seen(self, pair: tuple[str, str], cap: SeriesCap[str], labels: dict[tuple[str, str], tuple[str, str]]) -> None:
        """A (job, rank or GPU) pair had a row in a closed window: admitted (a fold counted) once per row."""
        labels[pair] = cap.admit(*pair, self._now)

    def _labels(self, pair: tuple[str, str], cap: SeriesCap[str],
                labels: dict[tuple[str, str], tuple[str, str]]) -> tuple[str, str]:
        """The labels a published row of the pair goes under: as admitted when its window closed."""
        if pair not in labels:
            self._seen(pair, cap, labels)
        return labels[pair]

    def _job_label(self, job: int) -> str:
        """A job id's name, looked up once: windows close after the interner may have let the id go."""
        label = self._job_labels.get(job)
        if label is None:
            label = self._job_labels[job] = self._job_names(job)
        return label

    def _expire(self, now: int) -> None:
        for labels in self._expired(now, self._ranks, self._rank_labels):
            self._compute.pop(labels, None)
            self._ratio.pop(labels, None)
            for cause in CAUSES:
                self._stall.pop((*labels, cause), None)
        for labels in self._expired(now, self._gpus, self._gpu_labels):
            for cause in CAUSES:
                self._gpu_idle.pop((*labels, cause), None)

    @staticmethod
    def _expired(now: int, cap: SeriesCap[str], labels: dict[tuple[str, str], tuple[str, str]]) -> set[tuple[str, str]]:
        """The cap's expired label pairs, no longer looked up for published rows."""
        gone = set(cap.expire(now))
        for pair in [pair for pair, given in labels.items() if given in gone or pair in gone]:
            del labels[pair]
        return gone

    def _forget(self, job: str) -> None:
        """A retired job's series go, so a node's series stay bounded by its live jobs."""
        for table in (self._stall, self._compute, self._ratio, self._gpu_idle, self._gpu_cost):
            for labels in [labels for labels in table if labels[0] == job]:
                del table[labels]
        for given in (self._rank_labels, self._gpu_labels):
            for pair in [pair for pair in given if pair[0] == job]:
                del given[pair]
        for per_job in (self._phase, self._time_to_steady, self._warmup_idle, self._warmup_bytes, self._forecast,
                        self._epoch_steps,
                        self._regressions, self._job_stall, self._egress_cost, self._stamp, self._published):
            per_job.pop(job, None)
        for taken in self._taken.values():
            taken.pop(job, None)

    def set_losses(self, late: Mapping[str, int], dropped: Mapping[tuple[str, str], int],
                   record_errors: Mapping[tuple[str, str], int]) -> None:
        with self._lock:
            self._late, self._dropped, self._record_errors = dict(late), dict(dropped), dict(record_errors)

    def _job_tables(self) -> list[tuple[AnyMetricDef, Mapping[tuple[str, ...], float]]]:
        """The per-job series now, each keyed by its labels, the job first."""
        c = catalogue
        return [
            (c.STALL_SECONDS, self._stall),
            (c.COMPUTE_SECONDS, self._compute),
            (c.INPUT_BOUND_RATIO, self._ratio),
            (c.GPU_STALL_IDLE_SECONDS, self._gpu_idle),
            (c.STALL_GPU_COST, self._gpu_cost),
            (c.EGRESS_COST, {(j,): v for j, v in self._egress_cost.items()}),
            (c.WARMUP_TIME_TO_STEADY, {(j,): v for j, v in self._time_to_steady.items()}),
            (c.WARMUP_IDLE_GPU_SECONDS, {(j,): v for j, v in self._warmup_idle.items()}),
            (c.WARMUP_HUB_BYTES, {(j,): v for j, v in self._warmup_bytes.items()}),
            (c.WARMUP_FORECAST_TIME_TO_STEADY, {(j,): f.time_to_steady_s for j, f in self._forecast.items()}),
            (c.WARMUP_FORECAST_IDLE_GPU_SECONDS, {(j,): f.idle_gpu_seconds for j, f in self._forecast.items()}),
            (c.WARMUP_FORECAST_HUB_BYTES, {(j,): f.hub_bytes for j, f in self._forecast.items()}),
            (c.WARMUP_REGRESSIONS, {(j,): v for j, v in self._regressions.items()}),
            (c.EPOCH_STEPS, {(j,): v for j, v in self._epoch_steps.items()}),
            (c.JOB_STALL_SECONDS, {(j,): v for j, v in self._job_stall.items()}),
            (c.WARMUP_PHASE, {(j, p): float(p == phase) for j, phase in self._phase.items() for p in PHASES}),
        ]

    def _snapshot(self, job: str) -> None:
        """Keep the job's series as published now for the scrapers that have not taken them (see `collect`)."""
        values = [{labels: value for labels, value in table.items() if labels[0] == job}
                  for _, table in self._job_tables()]
        self._published.setdefault(job, deque(maxlen=PUBLISHED_WINDOWS)).append((self._stamp[job], values))

    def _taken_by(self, scraper: str) -> dict[str, float]:
        """The newest window of each job the scraper took; the least recently seen scraper is forgotten."""
        taken = self._taken.pop(scraper, {})
        self._taken[scraper] = taken
        while len(self._taken) > SCRAPERS:
            self._taken.popitem(last=False)
        return taken

    def collect(self) -> Iterator[Metric]:
        """Per-job series at their windows' times: the windows published since this scraper's last scrape (a
        stall's held windows go out together), then every series as it is now, each series' samples together
        and in time order (OpenMetrics groups them so). Prometheus takes several samples of a series in one
        scrape when their timestamps rise, and counts an older one sent again as out of order: so each
        scraper (`stallwatch.scraper`) gets each window once, whatever other scrapers took."""
        c = catalogue
        spoke = whatif_spoke_label(self._spokes)  # read at scrape time: spoke collectors intern after this is built
        with self._lock:
            curve = self._whatif_curve
            job_tables = self._job_tables()
            samples: list[list[tuple[tuple[str, ...], float | None, float]]] = [[] for _ in job_tables]
            taken = self._taken_by(SCRAPER.get())
            for job, snapshots in self._published.items():
                since = taken.get(job, -math.inf)
                for stamp, values in list(snapshots)[:-1]:  # the last is the state now, below
                    if stamp > since:
                        for table, then in zip(samples, values, strict=True):
                            table.extend((labels, stamp, value) for labels, value in then.items())
                taken[job] = snapshots[-1][0]
            for table, (_, now) in zip(samples, job_tables, strict=True):
                table.extend((labels, self._stamp.get(labels[0]), value) for labels, value in now.items())
            families: list[Any] = [metric.family() for metric, _ in job_tables]
            for family, table in zip(families, samples, strict=True):
                for labels, at, value in sorted(table, key=lambda sample: (sample[0], sample[1] or 0.0)):
                    family.add_metric(list(labels), float(value), timestamp=at)
            node_tables: list[tuple[Any, Mapping[tuple[str, ...], float], float | None]] = [
                (c.CACHE_WHATIF_HIT_RATIO.family(), {(spoke, f"{f:g}"): v for f, v in self._whatif.items()},
                 self._whatif_stamp),
                (c.CACHE_WHATIF_SAMPLING.family(), {(spoke,): curve.sample_rate} if curve else {},
                 self._whatif_stamp),
                (c.CACHE_WHATIF_KEYS.family(), {(spoke,): curve.keys} if curve else {}, self._whatif_stamp),
                # Settings and operational: stamped by Prometheus at the scrape.
                (c.GPU_PRICE.family(), {(gpu_type,): price for gpu_type, price in self._gpu_prices.items()}
                 or {(self._prices.gpu_type,): self._prices.gpu_dollars_per_hour / 3600}, None),
                (c.EGRESS_PRICE.family(), {(self._prices.region_pair,): self._prices.egress_dollars_per_gb / GB},
                 None),
                (c.DATASET_SIZE.family(), {(): self._dataset_bytes} if self._dataset_bytes else {}, None),
                (c.CORRELATOR_WINDOWS.family(), {(): self._windows}, None),
                (c.CORRELATOR_LATE_EVENTS.family(), {(k,): v for k, v in self._late.items()}, None),
                (c.CORRELATOR_DROPPED_EVENTS.family(), {k: v for k, v in self._dropped.items()}, None),
                (c.CORRELATOR_FOLDED_LABELS.family(), {("rank",): self._ranks.folded, ("gpu",): self._gpus.folded},
                 None),
                (c.CORRELATOR_RECORD_ERRORS.family(), {k: v for k, v in self._record_errors.items()}, None),
            ]
            for family, node_values, node_stamp in node_tables:
                for labels, value in sorted(node_values.items()):
                    family.add_metric(list(labels), float(value), timestamp=node_stamp)
        yield from families
        for family, _, _ in node_tables:
            yield family


def _later(stamp: float, previous: float | None) -> float:
    """`stamp`, or just after `previous` if the wall clock stepped back: a series' samples only move forward."""
    return stamp if previous is None or stamp > previous else previous + 0.001
