"""One rank of the multi-node demo's job: PyTorch DDP-style data parallelism on CPU (gloo), for real.

Each rank reads its share of the shards (`DistributedSampler`) through its node's spoke with a real,
instrumented DataLoader, emulates the step's compute with a fixed sleep, then joins a real gloo
all-reduce of a gradient-sized tensor: the collective in which every rank waits for the slowest one.
Every rank runs the same number of steps, so none is left waiting in a collective at the end.

It writes the scenario's ground truth, one JSON line per step (`--timings`): wall-clock end of the
step, the loader wait, the emulated compute and the all-reduce as this rank measured them.

    python -m stallwatch.demo.ddp_trainer --spoke URL --rank 2 --world 4 --local-rank 0 \
        --master tcp://127.0.0.1:PORT --steps 300 --timings rank-2.jsonl --trace gpu.trace
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from stallwatch.client.torch import instrument
from stallwatch.demo.trainer import ShardDataset
from stallwatch.exporters.nvml_fake import ComputeTrace

GRADIENT_ELEMENTS = 256 * 1024  # a 1 MiB float32 gradient: the all-reduce moves real bytes


def batches(loader: Any, sampler: DistributedSampler[Any]) -> Iterator[Any]:
    """The loader's batches epoch after epoch, each epoch shuffled differently (the same on every rank)."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spoke", required=True, help="base URL of this node's spoke")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-seconds", type=float, default=0.1, help="emulated compute per step")
    parser.add_argument("--steps", type=int, required=True, help="steps every rank runs")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True, help="the rank's GPU on its node")
    parser.add_argument("--master", required=True, help="gloo rendezvous, tcp://HOST:PORT")
    parser.add_argument("--job", default="demo")
    parser.add_argument("--timings", type=Path, required=True, help="ground truth, one JSON line per step")
    parser.add_argument("--trace", type=Path, required=True, help="compute-span file the node's fake GPU follows")
    options = parser.parse_args(argv)

    dist.init_process_group("gloo", init_method=options.master, rank=options.rank, world_size=options.world,
                            timeout=timedelta(minutes=5))
    dataset = ShardDataset(options.spoke, options.shards)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=options.world, rank=options.rank)
    loader: Any = instrument(
        DataLoader(dataset, batch_size=options.batch_size, sampler=sampler, num_workers=options.workers,
                   persistent_workers=True),
        job=options.job, rank=options.rank, gpu=options.local_rank,
    )
    gradient = torch.ones(GRADIENT_ELEMENTS)
    dist.barrier()  # every rank starts its first step together
    records = []
    stream = batches(loader, sampler)
    for step in range(options.steps):
        asked = time.monotonic()
        next(stream)
        got = time.monotonic()
        started = time.time()
        ComputeTrace.append_span(options.trace, started, started + options.step_seconds)
        time.sleep(options.step_seconds)
        computed = time.monotonic()
        dist.all_reduce(gradient)
        gradient.div_(options.world)  # the mean, as DDP averages gradients
        reduced = time.monotonic()
        records.append({"step": step, "end": time.time(), "wait": got - asked, "compute": computed - got,
                        "allreduce": reduced - computed})
        if options.rank == 0:
            print(f"step {step + 1}/{options.steps}", flush=True)
    options.timings.write_text("".join(json.dumps(r) + "\n" for r in records))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
