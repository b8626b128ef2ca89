"""A run's stalls and hub bytes in dollars, and the spoke sizes of the what-if in stall seconds and dollars.

The sizing model (docs/cost.md): at a capacity C, the remote_fetch stall and the hub bytes scale with the miss
ratio, (1 - h(C)) / (1 - h(1)), h being the what-if's estimated hit ratio and 1 the spoke's capacity now; the other
causes' stalls stay as they were, and so does compute. The GPU idle in stalls scales the same way, cause by cause.
Figures are per epoch when the job's trainers report its length (at the run's pace), else per hour of the run.
"""

from __future__ import annotations

from dataclasses import dataclass

from stallwatch.catalogue import REMOTE_FETCH
from stallwatch.prices import Prices
from stallwatch.report.run import Run

HOUR = 3600.0


@dataclass(frozen=True)
class Capacity:
    """One capacity of the what-if, per period: an epoch or an hour of the run (`period`)."""

    factor: str  # times the spoke's capacity, as the what-if labels it
    hit_ratio: float
    stall_seconds: float  # summed over the ranks
    input_bound_ratio: float | None  # stall / (stall + compute); None: no step seen
    gpu_dollars: float | None  # the GPU idle in stalls, priced; None: the run's GPU idle is not known
    egress_dollars: float


def hit_ratio_now(run: Run) -> float | None:
    """The what-if's estimate at the spoke's own capacity (factor `1` from Prometheus, `1.0` in a window file)."""
    return next((ratio for factor, ratio in run.whatif.items() if float(factor) == 1.0), None)


def period(run: Run) -> tuple[str, float]:
    """What the sizing counts per: an epoch (its seconds at the run's pace) when the run knows one, else an hour."""
    epoch = run.epoch_seconds
    return ("hour", HOUR) if epoch is None else ("epoch", epoch)


def sizing(run: Run, prices: Prices, gpu_known: bool) -> list[Capacity]:
    """Each capacity of the run's what-if, smallest first, per `period`; none without a what-if at the spoke's own
    capacity."""
    now = hit_ratio_now(run)
    if now is None or run.end <= run.start:
        return []
    per_period = period(run)[1] / (run.end - run.start)
    missed_now = 1.0 - now
    rows = []
    for factor, hit_ratio in sorted(run.whatif.items(), key=lambda kv: float(kv[0])):
        # No miss now: nothing to scale, the remote fetches (if any) stay as they were.
        misses = (1.0 - hit_ratio) / missed_now if missed_now > 0 else 1.0
        stall = run.stall_total + run.stall_seconds[REMOTE_FETCH.name] * (misses - 1)
        idle = sum(run.gpu_stall_idle_seconds.values()) + run.gpu_stall_idle_seconds[REMOTE_FETCH.name] * (misses - 1)
        worked = stall + run.compute_seconds
        rows.append(Capacity(
            factor, hit_ratio, stall * per_period, stall / worked if worked > 0 else None,
            prices.gpu_cost(idle) * per_period if gpu_known else None,
            prices.egress_cost(run.hub_bytes * misses) * per_period))
    return rows


def smallest_under(rows: list[Capacity], target: float) -> Capacity | None:
    """The smallest capacity whose input-bound share stays under `target`, if any does."""
    return next((row for row in rows if row.input_bound_ratio is not None and row.input_bound_ratio < target), None)
