"""Run the correlator over a generated scenario and gather what the tests compare with the truth."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from stallwatch.catalogue import CAUSES
from stallwatch.correlator.pipeline import CorrelatorPipeline
from stallwatch.correlator.results import WindowResult
from stallwatch.correlator.settings import CorrelatorSettings
from tests.scenarios.generator import BASE_NS, Generated, Scenario, generate


@dataclass
class Outcome:
    generated: Generated
    windows: list[WindowResult] = field(default_factory=list)
    correlator: CorrelatorPipeline | None = None

    def parts(self) -> Iterator[WindowResult]:
        """Every window's result and the pieces of its long stalls that lie in earlier windows."""
        for window in self.windows:
            yield window
            yield from window.earlier

    def stall_by_rank(self) -> dict[tuple[int, int], np.ndarray]:
        totals: dict[tuple[int, int], np.ndarray] = {}
        for row in (row for part in self.parts() for row in part.ranks):
            totals.setdefault((row.job, row.rank), np.zeros(len(CAUSES)))
            totals[(row.job, row.rank)] += row.stall_s
        return totals

    def phases(self, job: int) -> list[tuple[float, str]]:
        """(window start in scenario seconds, phase) per window that reported the job."""
        return [((w.start_ns - BASE_NS) / 1e9, j.phase) for w in self.windows for j in w.jobs if j.job == job]


def correlate(scenario: Scenario, **settings: object) -> Outcome:
    generated = generate(scenario)
    outcome = Outcome(generated)
    defaults: dict[str, object] = {"cache_capacity_bytes": scenario.cache_bytes}
    correlator = CorrelatorPipeline(CorrelatorSettings(**{**defaults, **settings}),  # type: ignore[arg-type]
                                    listeners=[outcome.windows.append])
    correlator.run(generated.batches)
    outcome.correlator = correlator
    return outcome


def assert_attribution_close(attributed: np.ndarray, truth: np.ndarray, tolerance: float = 0.05) -> None:
    """Per cause within `tolerance` of the truth, relative to the cause's true seconds, with a floor of
    `tolerance` of one percent of the whole stall for causes that are (nearly) absent."""
    total = truth.sum()
    for cause, got, want in zip(CAUSES, attributed, truth, strict=True):
        allowed = tolerance * max(want, 0.01 * total)
        assert abs(got - want) <= allowed, f"{cause}: attributed {got:.3f} s, truth {want:.3f} s (±{allowed:.3f})"
