"""While a job is cold: when it will be steady, and what the rest of its warm-up will cost.

The model (docs/attribution.md, "Forecast of the warm-up"). A job reads a working set of W bytes; the spoke
holds the part f = F / W it has fetched (F: the job's hub bytes so far). How often a read hits depends on how
the job walks its data, and one family covers the usual walks: 1 - h = (1 - f)^a, with
- a = 0 for one pass over a shuffled dataset, by one rank or split among ranks (a sampler per epoch,
  DistributedSampler): nothing is read twice before the pass ends, then everything hits;
- a = (n - 1) / n for n ranks that each shuffle the whole dataset: a rank hits what the others fetched;
- a = 1 for sampling with replacement: a read hits with the probability that its item is held.
The job is steady once h reaches the steady hit ratio h*, at f* = 1 - (1 - h*)^(1/a) (f* = 1 for a = 0).
Reading r bytes a second, it fetches r·(1 - f)^a of them: df/dt = r (1 - f)^a / W, so the time left is

    t = W / (r (1 - a)) · ((1 - f)^(1 - a) - (1 - f*)^(1 - a))     for a < 1
    t = W / r · ln((1 - f) / (1 - f*))                              for a = 1,

the hub bytes still to come W (f* - f), and the GPU idle still to come those bytes times the idle per hub
byte of the last windows (stalls come with the misses; the first windows' wait for the pipeline to fill
is no guide).

Where W and the walk come from, first found first:
- the job's own account of its first pass (`passes.py`: its trainers' epoch progress, from a loader with a
  len()): the pass's progress p gives W from F = W p (one rank, or ranks splitting the pass) or
  F = W (1 - (1 - p)^n) (n ranks each taking a whole pass: they hit each other's fetches), and the time left
  is the pass's steps left at the ranks' pace (`_from_first_pass`);
- the dataset's size when the agent is given it (`--correlator.dataset-size`): a is read from each recent
  window's hit ratio against the fill in its middle;
- the reuse seen so far: W fitted with a = (n - 1) / n for n ranks (0 for one: a DataLoader's default
  sampler makes passes); before the first hits (a pass reads nothing twice) the forecast is absent.

"Never" is an answer: the fill f* · W does not fit the spoke's capacity, or the job has fetched more than
the spoke holds (or a third more than its working set) and is still not steady: it fetches again what it
had (thrash), or reads nothing twice.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

NEVER = math.inf
_MIN_FIT_HITS = 20  # reuse fitted only on this many hits: a handful of early hits says little about W
_LEAD_WINDOWS = 10
_REFETCHED = 4 / 3  # fetched this many times the working set and not steady: it fetches again what it had


@dataclass(frozen=True)
class Forecast:
    """From the job's first event: when it will be steady (inf: never), and what is still to come."""

    time_to_steady_s: float
    idle_gpu_seconds: float
    hub_bytes: float


def _log_miss(ratio: float) -> float:
    """-ln(1 - ratio), the exponent's scale in 1 - h = (1 - f)^a; a ratio of 1 counted as 0.999."""
    return -math.log1p(-min(ratio, 0.999))


class _Window(NamedTuple):
    start_ns: int
    end_ns: int
    reads: int
    hits: int
    read_bytes: int
    fill: float  # the job's hub bytes so far in the window's middle
    hub_bytes: int
    idle_gpu_seconds: float
    steps: int


@dataclass
class _Recent:
    """The last `horizon_ns` of windows: the job's read bytes and steps a second now, and how its hits follow the
    fill."""

    horizon_ns: int
    windows: deque[_Window] = field(default_factory=deque)

    def add(self, window: _Window) -> None:
        self.windows.append(window)
        while self.windows and self.windows[0].end_ns <= window.end_ns - self.horizon_ns:
            self.windows.popleft()

    def read_rate(self) -> float:
        return self._rate(self.windows, sum(w.read_bytes for w in self.windows))

    def step_rate(self) -> float:
        """Steps a second since the first window with a step: a job's start (its workers starting, their first
        reads) is no pace."""
        stepping = list(itertools.dropwhile(lambda w: not w.steps, self.windows))
        return self._rate(stepping, sum(w.steps for w in stepping))

    @staticmethod
    def _rate(windows: Sequence[_Window], total: float) -> float:
        """`total` over the windows' time, a second."""
        seconds = (windows[-1].end_ns - windows[0].start_ns) / 1e9 if windows else 0.0
        return total / seconds if seconds > 0 else 0.0

    def idle_per_hub_byte(self) -> float:
        hub_bytes = sum(w.hub_bytes for w in self.windows)
        return sum(w.idle_gpu_seconds for w in self.windows) / hub_bytes if hub_bytes else 0.0

    def walk(self, working_set: float) -> float:
        """a, from each window's hit ratio against the fill in its middle (not the fill now: a hit ratio over
        several windows lags it), weighted by reads; 0 before the spoke holds a twentieth of W."""
        filled = [w for w in self.windows if w.reads and 0.05 <= w.fill / working_set < 1]
        scale = sum(w.reads * _log_miss(w.fill / working_set) for w in filled)
        return min(sum(w.reads * _log_miss(w.hits / w.reads) for w in filled) / scale, 1.0) if scale > 0 else 0.0


class WarmupForecast:
    """One job's forecast, fed each closed window until the job is steady."""

    def __init__(self, steady_hit_ratio: float, horizon_s: float, dataset_bytes: int | None,
                 cache_capacity_bytes: int | None) -> None:
        self._steady = steady_hit_ratio
        self._dataset = dataset_bytes
        self._capacity = cache_capacity_bytes
        self._recent = _Recent(round(horizon_s * 1e9))
        self._fetched = 0  # F: the job's hub bytes so far
        self._hits = 0
        self._ranks = 0
        self._first_pass: tuple[float, int] | None = None  # progress, the epoch's steps (`passes.py`)
        self._pass_bytes: int | None = None  # the hub bytes when the first pass ended: its working set
        # Batches the job's loaders read ahead of its steps, in its last windows that read: one window's says little.
        self._read_leads: deque[float] = deque(maxlen=_LEAD_WINDOWS)
        self._pass_end_s: float | None = None  # when the first pass's reads were over (from the job's first event)
        self._walk = 0.0  # a without the dataset's size: (n - 1) / n for the job's n ranks
        # The fit of W for that walk, as running sums over the windows with hits (a job may thrash for hours):
        # each window's hits times its estimate of W, and the hits.
        self._fit_sum = 0.0
        self._fit_hits = 0

    def add(self, start_ns: int, end_ns: int, reads: int, hits: int, read_bytes: int, hub_bytes: int,
            idle_gpu_seconds: float, ranks: int, steps: int = 0, first_pass: tuple[float, int] | None = None,
            read_lead: float | None = None) -> None:
        """One closed window of the job, which had `ranks` ranks then and took `steps` steps; `first_pass`: how far
        through its first pass it was, when its trainers report it; `read_lead`: how many batches its loaders had
        read ahead of its steps, when it read."""
        filled = self._fetched + hub_bytes / 2  # the spoke's fill in the middle of the window
        self._recent.add(_Window(start_ns, end_ns, reads, hits, read_bytes, filled, hub_bytes, idle_gpu_seconds,
                                 steps))
        self._ranks, self._first_pass = ranks, first_pass or self._first_pass
        if read_lead is not None:
            self._read_leads.append(read_lead)
        self._hits += hits
        walk = (ranks - 1) / ranks if ranks > 0 else 0.0
        if walk != self._walk:  # more ranks (or fewer) walk otherwise: fit anew from here
            self._walk, self._fit_sum, self._fit_hits = walk, 0.0, 0
        if hits:
            # A window says W = F / (1 - (1 - h)^(1/a)); a single pass (a = 0) hits only once it is done, when the
            # spoke holds the whole working set: W = F.
            said = filled if walk == 0 else filled / -math.expm1(-_log_miss(hits / reads) / walk)
            self._fit_sum += hits * said
            self._fit_hits += hits
        self._fetched += hub_bytes
        if self._pass_bytes is None and self._first_pass is not None and self._read_progress() >= 1:
            self._pass_bytes = self._fetched

    def _fitted(self) -> float | None:
        """W from the windows' hit ratios and fills, weighted by their hits (a ratio estimate: a window of few hits,
        whose h is mostly chance, weighs little); at least the bytes fetched so far. None: too few hits yet."""
        if self._fit_hits < _MIN_FIT_HITS:
            return None
        return max(self._fit_sum / self._fit_hits, float(self._fetched))

    def forecast(self, elapsed_s: float) -> Forecast | None:
        """At `elapsed_s` since the job's first event; None where nothing can be said."""
        fetched = float(self._fetched)
        if self._capacity and fetched > self._capacity:
            return Forecast(NEVER, NEVER, NEVER)
        if self._first_pass is not None:  # the job's own account of its pass: per job, where the size is the node's
            return self._from_first_pass(elapsed_s)
        read_rate = self._recent.read_rate()
        if self._dataset:
            working_set = float(self._dataset)
            filled = min(fetched / working_set, 1.0)
            walk = self._recent.walk(working_set)
        else:
            walk = self._walk
            fitted = self._fitted()
            if fitted is None:
                return None
            working_set = fitted
            filled = min(fetched / working_set, 1.0)
        target = 1.0 if walk < 1e-3 else 1 - (1 - self._steady) ** (1 / walk)
        # A fitted W is a guess, not evidence that the job cannot fit: that takes its own fetches past the spoke.
        if self._dataset and self._capacity and target * working_set > self._capacity:
            return Forecast(NEVER, NEVER, NEVER)
        if fetched > _REFETCHED * working_set:
            return Forecast(NEVER, NEVER, NEVER)
        to_fetch = max(target - filled, 0.0) * working_set
        if to_fetch == 0.0:
            return Forecast(elapsed_s, 0.0, 0.0)
        if read_rate <= 0:
            return None  # nothing read now (a stall without reads, a pause): no pace to forecast from
        if walk > 1 - 1e-3:
            left = working_set / read_rate * math.log((1 - filled) / (1 - target))
        else:
            left = working_set / (read_rate * (1 - walk)) * ((1 - filled) ** (1 - walk) - (1 - target) ** (1 - walk))
        return Forecast(elapsed_s + left, self._recent.idle_per_hub_byte() * to_fetch, to_fetch)

    def _read_progress(self) -> float:
        """How far the loaders have read through the first pass: its steps' progress and the batches read ahead."""
        assert self._first_pass is not None
        stepped, epoch_steps = self._first_pass
        lead = sum(self._read_leads) / len(self._read_leads) if self._read_leads else 0.0
        return min(stepped + lead / epoch_steps, 1.0)

    def _from_first_pass(self, elapsed_s: float) -> Forecast | None:
        """While the first pass runs, from its progress p: one rank, or ranks that split the pass, have fetched
        F = W p and are steady when it ends (p* = 1); n ranks that each take a whole pass (they hit each other's
        fetches) have fetched F = W (1 - (1 - p)^n) and hit 1 - (1 - p)^(n - 1), steady at p* = 1 - 0.1^(1/(n - 1)).
        The steps left, (p* - p) x the epoch's steps, at the ranks' pace now; p counts the batches the loaders
        have read, which lead the steps by their prefetch (the pass's reads end that much sooner). Once the pass is
        over, the job was warm from its end (the tracker proves it a span later), or it is never steady if it
        fetches a third more again than the pass did."""
        assert self._first_pass is not None
        epoch_steps = self._first_pass[1]
        progress = self._read_progress()
        if self._pass_bytes is not None:
            self._pass_end_s = elapsed_s if self._pass_end_s is None else self._pass_end_s
            return (Forecast(NEVER, NEVER, NEVER) if self._fetched > _REFETCHED * self._pass_bytes
                    else Forecast(self._pass_end_s, 0.0, 0.0))
        ranks = max(self._ranks, 1)
        pace = self._recent.step_rate() / ranks
        if progress < 0.02 or pace <= 0 or not self._fetched:
            return None  # too little of the pass, or no step now, to go by
        if self._hits and ranks > 1:
            target = 1 - (1 - self._steady) ** (1 / (ranks - 1))
            fill, fill_then = 1 - (1 - progress) ** ranks, 1 - (1 - target) ** ranks
        else:
            target, fill, fill_then = 1.0, progress, 1.0
        working_set = self._fetched / fill
        if self._capacity and fill_then * working_set > self._capacity:
            return Forecast(NEVER, NEVER, NEVER)
        to_fetch = max(fill_then - fill, 0.0) * working_set
        left = max(target - progress, 0.0) * epoch_steps / pace
        return Forecast(elapsed_s + left, self._recent.idle_per_hub_byte() * to_fetch, to_fetch)
