"""What the training client costs, measured side by side in one run.

1. Per event: a bare loop over a list, the same loop through `monitor()` (one step event each:
   two clock reads, the append, and the amortised pack and send of its batch), the recording
   call alone (append + amortised pack + send), one prometheus_client `Histogram.observe`, and
   `keys.read_key` (paid once per dataset read). Batches go to a real receiving socket drained by
   another process, as the agent would.
2. Throughput of a real DataLoader pipeline (workers, collation, a small matmul per step), plain
   and through `stallwatch.client.torch.instrument` with every sample read recorded, run
   alternately: the median of the rounds' changes, and their spread.

    PYTHONPATH=. python benchmarks/client_overhead.py [--events N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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


def pipeline_throughput(rounds: int) -> tuple[list[float], list[float]]:
    import torch
    from torch.utils.data import DataLoader, Dataset

    from stallwatch.client.torch import instrument

    class Samples(Dataset[torch.Tensor]):
        """In-memory samples with a recorded 'read' each, so the client's worker side is exercised."""

        def __init__(self) -> None:
            self.data = torch.randn(4096, 64)

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, index: int) -> torch.Tensor:
            with ReadSpan("/datasets/bench.bin", index * 256) as span:
                sample = self.data[index]
                span.bytes = 256
            return sample * 2.0

    weights = torch.randn(64, 64)

    def epoch(loader: object) -> float:
        start, samples = time.perf_counter(), 0
        for batch in loader:  # type: ignore[attr-defined]
            activations = batch
            for _ in range(40):  # the "training step"
                activations = torch.tanh(activations @ weights)
            samples += len(batch)
        return samples / (time.perf_counter() - start)

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
    # Each round is a plain and an instrumented epoch side by side: its change pairs two neighbours in time.
    changes = sorted(100 * (client / plain - 1) for plain, client in zip(plain_rounds, client_rounds, strict=True))
    quartiles = statistics.quantiles(changes, n=4)
    print(f"DataLoader pipeline (2 workers, batch 64, {args.rounds} rounds of a plain and an instrumented epoch):")
    print(f"  plain          {statistics.median(plain_rounds):10.0f} samples/s (median)")
    print(f"  with client    {statistics.median(client_rounds):10.0f} samples/s (median)")
    print(f"  throughput change, median of the rounds {statistics.median(changes):+.2f} %")
    print(f"  spread of the rounds: quartiles {quartiles[0]:+.2f} .. {quartiles[2]:+.2f} %, "
          f"range {changes[0]:+.2f} .. {changes[-1]:+.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
