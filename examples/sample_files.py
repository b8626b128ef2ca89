"""The examples' dataset: one small file per sample, read through `open_recorded`, so every read is an event."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import Dataset

from stallwatch.client import open_recorded


class SampleFiles(Dataset[tuple[int, torch.Tensor]]):
    """Sample i is the file `sample-i.bin` of `directory`; it yields (i, the file's mean byte value)."""

    def __init__(self, directory: Path) -> None:
        self.paths = sorted(directory.glob("sample-*.bin"), key=lambda path: int(path.stem.split("-")[1]))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        with open_recorded(self.paths[index]) as file:
            data = b"".join(iter(lambda: file.read(4096), b""))
        return index, torch.tensor([sum(data) / max(len(data), 1) / 255.0])


def make_samples(directory: Path, count: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        (directory / f"sample-{index}.bin").write_bytes(bytes(range(index % 200, index % 200 + 56)) * 40)


def write_ids(directory: Path | None, rank: int, ids: list[int]) -> None:
    """The sample ids this rank trained on, in order: how a run shows which shard each rank read."""
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank-{rank}.json").write_text(json.dumps(ids))
