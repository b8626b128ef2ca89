"""The scenario suite's errors per cause, as a Markdown table (docs/attribution.md quotes it).

`PYTHONPATH=. .venv/bin/python -m tests.scenarios.errors` runs one example of each scenario test
(the scenario, with parameters in the middle of the test's ranges and three seeds) and prints, per
cause, the true stall seconds and the largest error of the attributed seconds, then the same for
the GPU idle seconds during stalls (summed over causes).
"""

from __future__ import annotations

import numpy as np

from stallwatch.catalogue import CAUSES
from tests.scenarios.generator import JobSpec, Scenario
from tests.scenarios.run import correlate

MB = 1 << 20
SCENARIOS = {
    "cold → warm": lambda seed: Scenario([JobSpec(0, steps=1200, workers=4, compute_s=0.05, preprocess_s=0.02)],
                                         cache_bytes=800 * MB, seed=seed),
    "thrash (3 times the cache)": lambda seed: Scenario([JobSpec(0, steps=1200)], cache_bytes=400 * MB // 3, seed=seed),
    "CPU-bound, warm": lambda seed: Scenario([JobSpec(0, steps=500, workers=2, preprocess_s=0.3, compute_s=0.04)],
                                             cache_bytes=800 * MB, prewarm=True, seed=seed),
    "large batches, 30 ms delivery": lambda seed: Scenario(
        [JobSpec(0, steps=800, workers=3, preprocess_s=0.03, delivery_s=0.03)], cache_bytes=800 * MB, seed=seed),
    "30 s hub outage": lambda seed: Scenario([JobSpec(0, steps=2000, new_item_fraction=0.05)],
                                             cache_bytes=800 * MB, prewarm=True, outages=[(40.0, 70.0)], seed=seed),
    "two jobs, three ranks": lambda seed: Scenario(
        [JobSpec(0, steps=700, preprocess_s=0.2),
         JobSpec(1, steps=700, ranks=2, dataset_items=300, first_gpu=1, verdicts="spoke")],
        cache_bytes=2000 * MB, seed=seed),
    "verdicts learnt from latency": lambda seed: Scenario([JobSpec(0, steps=1200, verdicts="latency")],
                                                          cache_bytes=800 * MB, seed=seed),
    "reader clocks skewed by up to 0.5 ms": lambda seed: Scenario(
        [JobSpec(0, steps=1200, clock_skew_s=0.0005, preprocess_s=0.05)], cache_bytes=800 * MB, seed=seed),
    "untagged reads, one worker": lambda seed: Scenario(
        [JobSpec(0, steps=1000, tagged=False, workers=1, preprocess_s=0.0)], cache_bytes=800 * MB, seed=seed),
}
SEEDS = (1, 2, 3)


def _error(got: float, want: float) -> str:
    if want < 0.05:  # a cause (nearly) absent: the error in seconds says more than a ratio
        return f"{abs(got - want):.3f} s"
    return f"{100 * abs(got - want) / want:.2f} %"


def main() -> None:
    print("| scenario | " + " | ".join(f"`{cause}`: truth, error" for cause in CAUSES) + " | GPU idle: truth, error |")
    print("|---" * (len(CAUSES) + 2) + "|")
    for name, build in SCENARIOS.items():
        truths = np.zeros(len(CAUSES) + 1)
        errors: list[list[tuple[float, float, float]]] = [[] for _ in range(len(CAUSES) + 1)]
        for seed in SEEDS:
            outcome = correlate(build(seed))
            truth = sum(outcome.generated.truth.stall_s.values(), np.zeros(len(CAUSES)))
            got = sum(outcome.stall_by_rank().values(), np.zeros(len(CAUSES)))
            idle = sum((np.array(g.idle_s) for w in outcome.windows for g in w.gpus), np.zeros(len(CAUSES)))
            wanted = np.append(truth, truth.sum())  # a GPU is busy exactly while its rank computes
            measured = np.append(got, idle.sum())
            truths += wanted / len(SEEDS)
            for column, (g, w) in enumerate(zip(measured, wanted, strict=True)):
                errors[column].append((abs(g - w), g, w))
        cells = [f"{abs(t):.2f} s, {_error(*max(e)[1:])}" for t, e in zip(truths, errors, strict=True)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
