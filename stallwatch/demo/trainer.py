"""The demo's emulated training job: a real PyTorch DataLoader reading shards through the spoke.

Loader workers fetch each sample's shard over HTTP from the spoke (`stallwatch.client.http_get`
records the read and the spoke's `X-Cache-Status`), or with `--mount` read it with plain `open()` from a
JuiceFS mount (read capture records it, the mount being a spoke's); the training step is emulated by a fixed sleep,
as MLPerf Storage's DLIO emulates accelerators, and each step's span is appended to the fake GPU's
trace so the agent's emulated GPU is busy exactly while the job computes.

    python -m stallwatch.demo.trainer --spoke URL --shards 96 --trace FILE --duration 120
    STALLWATCH_SPOKE_MOUNTS=/mnt/jfs python -m stallwatch.demo.trainer --mount /mnt/jfs/dataset --trace FILE

Prints `epoch E step S/N` as every step begins, for the demo's progress bar and epoch lines.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from stallwatch.client import http_get
from stallwatch.client.torch import instrument
from stallwatch.demo.hub import shard_name
from stallwatch.exporters.nvml_fake import ComputeTrace

RETRY_SECONDS = 1.0


class ShardDataset(Dataset[torch.Tensor]):
    """Sample i is shard i, read whole through the spoke (a URL, or a mounted folder); a failed read is retried
    (the hub may be out)."""

    def __init__(self, spoke: str, shards: int, mounted: bool = False) -> None:
        self.spoke = spoke if mounted else spoke.rstrip("/")
        self.shards, self.mounted = shards, mounted

    def __len__(self) -> int:
        return self.shards

    def _read(self, index: int) -> bytes:
        if self.mounted:
            with open(Path(self.spoke, shard_name(index)), "rb") as shard:
                return shard.read()
        return http_get(f"{self.spoke}/{shard_name(index)}", timeout=300)

    def __getitem__(self, index: int) -> torch.Tensor:
        while True:
            try:
                data = self._read(index)
                break
            except OSError:
                time.sleep(RETRY_SECONDS)
        # A token of preprocessing: the first bytes as a tensor.
        return torch.frombuffer(bytearray(data[:64]), dtype=torch.uint8).to(torch.float32)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--spoke", help="base URL of the spoke")
    source.add_argument("--mount", help="the dataset's folder on a mounted spoke (JuiceFS)")
    parser.add_argument("--shards", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=0.1, help="emulated compute per step")
    parser.add_argument("--duration", type=float, default=120.0, help="stop after this many seconds")
    parser.add_argument("--trace", type=Path, required=True, help="compute-span file the fake GPU follows")
    parser.add_argument("--job", default="demo")
    options = parser.parse_args(argv)

    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    loader: Any = instrument(
        DataLoader(ShardDataset(options.mount or options.spoke, options.shards, options.mount is not None),
                   batch_size=options.batch_size, shuffle=True,
                   num_workers=options.workers, persistent_workers=True),
        job=options.job, rank=0, gpu=0,
    )
    steps_per_epoch = (options.shards + options.batch_size - 1) // options.batch_size
    deadline = time.monotonic() + options.duration
    epoch = 0
    while not stop["now"] and time.monotonic() < deadline:
        epoch += 1
        for step, _batch in enumerate(loader, start=1):
            # The span is known before the step runs (it is a fixed sleep): the fake GPU reads it live.
            started = time.time()
            ComputeTrace.append_span(options.trace, started, started + options.step_seconds)
            # Said as the step begins: after an epoch's last one, its reads are all done and the next
            # epoch's not begun for a whole step.
            print(f"epoch {epoch} step {step}/{steps_per_epoch}", flush=True)
            time.sleep(options.step_seconds)
            if stop["now"] or time.monotonic() >= deadline:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
