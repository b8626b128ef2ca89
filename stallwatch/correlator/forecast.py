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
is no guide). With the dataset's size set, W is known and a is read from the
job's hit ratio now against f. Without it, W is fitted from the reuse seen so far, with a = (n - 1) / n for
n ranks (0 for one: a DataLoader's default sampler makes passes); before the first hit nothing can be said
(a pass reads nothing twice), and the forecast is absent.

"Never" is an answer: the fill f* · W does not fit the spoke's capacity, or the job has fetched more than
the spoke holds (or a third more than its working set) and is still not steady: it fetches again what it
had (thrash), or reads nothing twice.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

NEVER = math.inf
_MIN_FIT_HITS = 20  # reuse fitted only on this many hits: a handful of early hits says little about W
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


@dataclass
class _Recent:
    """The last `horizon_ns` of windows: the job's read bytes a second now, and how its hits follow the fill."""

    horizon_ns: int
    # start, end, reads, hits, read bytes, the job's hub bytes so far in the window's middle, hub bytes, GPU idle
    windows: deque[tuple[int, int, int, int, int, float, int, float]] = field(default_factory=deque)

    def add(self, start_ns: int, end_ns: int, reads: int, hits: int, read_bytes: int, fetched: float,
            hub_bytes: int, idle_gpu_seconds: float) -> None:
        self.windows.append((start_ns, end_ns, reads, hits, read_bytes, fetched, hub_bytes, idle_gpu_seconds))
        while self.windows and self.windows[0][1] <= end_ns - self.horizon_ns:
            self.windows.popleft()

    def read_rate(self) -> float:
        seconds = (self.windows[-1][1] - self.windows[0][0]) / 1e9 if self.windows else 0.0
        return sum(w[4] for w in self.windows) / seconds if seconds > 0 else 0.0

    def idle_per_hub_byte(self) -> float:
        hub_bytes = sum(w[6] for w in self.windows)
        return sum(w[7] for w in self.windows) / hub_bytes if hub_bytes else 0.0

    def walk(self, working_set: float) -> float:
        """a, from each window's hit ratio against the fill in its middle (not the fill now: a hit ratio over
        several windows lags it), weighted by reads; 0 before the spoke holds a twentieth of W."""
        filled = [(reads, hits / reads, fetched / working_set) for _, _, reads, hits, _, fetched, _, _ in self.windows
                  if reads and 0.05 <= fetched / working_set < 1]
        scale = sum(reads * _log_miss(f) for reads, _, f in filled)
        return min(sum(reads * _log_miss(h) for reads, h, _ in filled) / scale, 1.0) if scale > 0 else 0.0


class WarmupForecast:
    """One job's forecast, fed each closed window until the job is steady."""

    def __init__(self, steady_hit_ratio: float, horizon_s: float, dataset_bytes: int | None,
                 cache_capacity_bytes: int | None) -> None:
        self._steady = steady_hit_ratio
        self._dataset = dataset_bytes
        self._capacity = cache_capacity_bytes
        self._recent = _Recent(round(horizon_s * 1e9))
        self._fetched = 0  # F: the job's hub bytes so far
        self._walk = 0.0  # a without the dataset's size: (n - 1) / n for the job's n ranks
        # The fit of W for that walk, as running sums over the windows with hits (a job may thrash for hours):
        # each window's hits times its estimate of W, and the hits.
        self._fit_sum = 0.0
        self._fit_hits = 0

    def add(self, start_ns: int, end_ns: int, reads: int, hits: int, read_bytes: int, hub_bytes: int,
            idle_gpu_seconds: float, ranks: int) -> None:
        """One closed window of the job, which had `ranks` ranks then."""
        filled = self._fetched + hub_bytes / 2  # the spoke's fill in the middle of the window
        self._recent.add(start_ns, end_ns, reads, hits, read_bytes, filled, hub_bytes, idle_gpu_seconds)
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
