"""What the training client costs, measured side by side in one run.

1. Per event: a bare loop over a list, the same loop through `monitor()` (one step event each:
   two clock reads, the append, and the amortised pack and send of its batch), the recording
   call alone (append + amortised pack + send), one prometheus_client `Histogram.observe`, and
   `keys.read_key` (paid once per dataset read). Batches go to a real receiving socket drained by
   another process, as the agent would.
2. Throughput of a real DataLoader pipeline (workers, collation, a small matmul per step), plain
   and through `stallwatch.client.torch.instrument` with every sample read recorded, run
   alternately: the median of the rounds' changes in throughput and in CPU time a sample (the
   trainer's and its workers'), and their spread. CPU time is what the client adds; throughput is
   what training sees, and what other tenants of a shared machine disturb most.

    PYTHONPATH=. python benchmarks/client_overhead.py [--events N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import psutil
from prometheus_client import CollectorRegistry, Histogram

from stallwatch.client import ReadSpan, transport, wire
from stallwatch.client.loop import Monitored
from stallwatch.keys import read_key

DRAIN = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    s.recv(1 << 18)
"""


def best_per_item(run: Callable[[list[int]], None], events: int, repeats: int = 7) -> float:
    """Nanoseconds per item, best of `repeats` (the least disturbed by the other tenants of the CPU).

    Items are fed in chunks of 8 batches with an untimed pause after each, so the draining process
    keeps up as an agent would at any sustainable rate (the kernel queues only ten datagrams here);
    flat out, the client would outrun the drain and drop batches, which costs no less to try.
    """
    chunk = list(range(8 * wire.MAX_EVENTS))
    timings = []
    for _ in range(repeats):
        elapsed = 0
        for _ in range(events // len(chunk)):
            start = time.perf_counter_ns()
            run(chunk)
            elapsed += time.perf_counter_ns() - start
            time.sleep(0.005)
        timings.append(elapsed / (events // len(chunk) * len(chunk)))
    return min(timings)


def per_event(events: int) -> dict[str, float]:
    channel = transport.sender().channel(wire.Source("bench", 0))

    def bare(items: list[int]) -> None:
        for _ in items:
            pass

    def monitored(items: list[int]) -> None:
        for _ in Monitored(items, channel):
            pass

    def recorded(items: list[int]) -> None:
        step = channel.step
        for index in items:
            step((index, 1, 2, 3))
        channel.flush()

    histogram = Histogram("bench_seconds", "benchmark", registry=CollectorRegistry())

    def observed(items: list[int]) -> None:
        observe = histogram.observe
        for _ in items:
            observe(0.01)

    def keyed(items: list[int]) -> None:
        for index in items:
            read_key("/datasets/imagenet/train/shard-000123.tar", index)

    results = {
        "bare loop": best_per_item(bare, events),
        "loop through monitor()": best_per_item(monitored, events),
        "record one event (append + pack + send)": best_per_item(recorded, events),
        "Histogram.observe": best_per_item(observed, events),
        "read_key (per dataset read)": best_per_item(keyed, events),
    }
    results["monitor() overhead per step"] = results["loop through monitor()"] - results["bare loop"]
    results["events dropped (must be 0)"] = channel.dropped_total
    return results


def per_batch(batches: int = 2000, size: int = 64) -> tuple[float, float]:
    """CPU µs a batch through a DataLoader without workers, plain and instrumented, best of 7: what
    `instrument` adds to each batch (numbering, the tagged collate, the step), free of worker noise."""
    from torch.utils.data import DataLoader, Dataset

    from stallwatch.client.torch import instrument

    class Indices(Dataset[int]):
        def __len__(self) -> int:
            return batches * size

        def __getitem__(self, index: int) -> int:
            return index

    def cost(loader: DataLoader[int]) -> float:
        start = time.process_time()
        for _ in loader:
            pass
        return (time.process_time() - start) / batches * 1e6

    def unchanged(samples: list[int]) -> list[int]:
        return samples

    plain = DataLoader(Indices(), batch_size=size, collate_fn=unchanged)
    instrumented = instrument(DataLoader(Indices(), batch_size=size, collate_fn=unchanged), job="bench", rank=0)
    plain_costs, instrumented_costs = [], []
    for _ in range(7):
        plain_costs.append(cost(plain))
        instrumented_costs.append(cost(instrumented))
    return min(plain_costs), min(instrumented_costs)


def pickling_cost(size: int = 64) -> float:
    """µs more than a plain list that a batch's numbered indices cost on their way to a worker."""
    from stallwatch.client.torch import NumberedIndices

    def best(indices: list[int]) -> float:
        timings = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(5000):
                pickle.loads(pickle.dumps(indices))
            timings.append((time.perf_counter() - start) / 5000 * 1e6)
        return min(timings)

    return best(NumberedIndices(range(size), 7)) - best(list(range(size)))


class Epoch(NamedTuple):
    samples_per_second: float  # wall clock: what training sees, and what other tenants of the CPU disturb most
    cpu_per_sample: float  # seconds of CPU, the trainer's and its workers': what the client adds to it


def pipeline_throughput(rounds: int) -> tuple[list[Epoch], list[Epoch]]:
    import torch
    from torch.utils.data import DataLoader, Dataset

    from stallwatch.client.torch import instrument

    class Samples(Dataset[torch.Tensor]):
        """In-memory samples with a recorded 'read' each, so the client's worker side is exercised."""

        def __init__(self) -> None:
            self.data = torch.randn(16384, 64)  # an epoch of ~0.5 s: long beside a scheduler hiccup

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, index: int) -> torch.Tensor:
            with ReadSpan("/datasets/bench.bin", index * 256) as span:
                sample = self.data[index]
                span.bytes = 256
            return sample * 2.0

    weights = torch.randn(64, 64)

    def cpu_seconds(loader: DataLoader[torch.Tensor]) -> float:
        """This process's CPU time and its loader workers' (persistent, so alive across epochs)."""
        workers = loader._iterator._workers if loader._iterator is not None else []  # type: ignore[attr-defined]
        return time.process_time() + sum(sum(psutil.Process(w.pid).cpu_times()[:2]) for w in workers)

    def epoch(loader: DataLoader[torch.Tensor]) -> Epoch:
        start, cpu_start, samples = time.perf_counter(), cpu_seconds(loader), 0
        for batch in loader:
            activations = batch
            for _ in range(40):  # the "training step"
                activations = torch.tanh(activations @ weights)
            samples += len(batch)
        return Epoch(samples / (time.perf_counter() - start), (cpu_seconds(loader) - cpu_start) / samples)

    torch.set_num_threads(1)
    plain_loader = DataLoader(Samples(), batch_size=64, num_workers=2, persistent_workers=True)
    instrumented = instrument(DataLoader(Samples(), batch_size=64, num_workers=2, persistent_workers=True),
                              job="bench", rank=0)
    epoch(plain_loader), epoch(instrumented)  # warm up: start the workers
    plain, with_client = [], []
    for round_number in range(rounds):  # the order flips every round, so neither side always goes first
        if round_number % 2:
            with_client.append(epoch(instrumented))
            plain.append(epoch(plain_loader))
        else:
            plain.append(epoch(plain_loader))
            with_client.append(epoch(instrumented))
    return plain, with_client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=8 * wire.MAX_EVENTS * 50)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "events.sock")
        drain = subprocess.Popen([sys.executable, "-c", DRAIN, path], stdout=subprocess.PIPE, text=True)
        try:
            assert drain.stdout is not None and drain.stdout.readline().strip() == "ready"
            transport.configure(path)
            costs = per_event(args.events)
            batch_plain, batch_instrumented = per_batch()
            pickling = pickling_cost()
            plain_rounds, client_rounds = pipeline_throughput(args.rounds)
        finally:
            drain.kill()
            drain.wait()
    print(f"per event ({args.events:,} events, best of 7, CPU count {os.cpu_count()}):")
    dropped = costs.pop("events dropped (must be 0)")
    for name, nanoseconds in costs.items():
        print(f"  {name:42s} {nanoseconds / 1000:8.3f} µs")
    print(f"  events the drain could not take (dropped)  {dropped:8.0f}")
    observe = costs["Histogram.observe"]
    record = costs["record one event (append + pack + send)"]
    print(f"  record one event / Histogram.observe       {record / observe:8.2f}x")
    print(f"  monitor() step overhead / Histogram.observe {costs['monitor() overhead per step'] / observe:7.2f}x")
    print("per batch of 64, DataLoader without workers (CPU, best of 7):")
    print(f"  plain {batch_plain:6.2f} µs, instrumented {batch_instrumented:6.2f} µs: instrument() adds "
          f"{batch_instrumented - batch_plain:.2f} µs a batch, and {pickling:.2f} µs pickling its numbered indices "
          "to a worker")
    print(f"DataLoader pipeline (2 workers, batch 64, {args.rounds} rounds of a plain and an instrumented epoch):")
    print(f"  plain          {statistics.median(e.samples_per_second for e in plain_rounds):10.0f} samples/s, "
          f"{1e6 * statistics.median(e.cpu_per_sample for e in plain_rounds):6.2f} µs CPU a sample (medians)")
    print(f"  with client    {statistics.median(e.samples_per_second for e in client_rounds):10.0f} samples/s, "
          f"{1e6 * statistics.median(e.cpu_per_sample for e in client_rounds):6.2f} µs CPU a sample (medians)")
    # Each round is a plain and an instrumented epoch side by side: its change pairs two neighbours in time.
    for name, field in (("throughput", 0), ("CPU a sample", 1)):
        changes = sorted(100 * (client[field] / plain[field] - 1)
                         for plain, client in zip(plain_rounds, client_rounds, strict=True))
        quartiles = statistics.quantiles(changes, n=4)
        print(f"  {name} change, median of the rounds {statistics.median(changes):+.2f} %; spread: quartiles "
              f"{quartiles[0]:+.2f} .. {quartiles[2]:+.2f} %, range {changes[0]:+.2f} .. {changes[-1]:+.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
