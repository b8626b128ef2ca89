"""Plain PyTorch DDP with stallwatch: torchrun, the gloo backend, a DistributedSampler.

    torchrun --nproc-per-node 2 --standalone examples/ddp_torchrun.py --data DIR [--no-stallwatch]

The only stallwatch line is `instrument(loader)`: the loader stays the same DataLoader, so
`loader.sampler.set_epoch(epoch)` works as in PyTorch's DDP tutorial; job and rank come from what
torchrun puts in the environment (TORCHELASTIC_RUN_ID, RANK).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from sample_files import SampleFiles, make_samples, write_ids
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from stallwatch.client.torch import instrument


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="sample files (made when missing)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--no-stallwatch", dest="stallwatch", action="store_false")
    parser.add_argument("--ids-out", type=Path, help="write the sample ids each rank trained on here")
    options = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0 and not options.data.exists():
        make_samples(options.data, options.samples)
    dist.barrier()
    dataset = SampleFiles(options.data)
    loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, seed=0), num_workers=2)
    if options.stallwatch:
        loader = instrument(loader)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[int] = []
    for epoch in range(options.epochs):
        loader.sampler.set_epoch(epoch)
        for ids, features in loader:
            loss = model(features).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += ids.tolist()
    write_ids(options.ids_out, rank, seen)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
