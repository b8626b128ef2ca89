"""PyTorch Lightning: `StallwatchCallback` instruments the training loaders the Trainer iterates.

    trainer = lightning.Trainer(callbacks=[StallwatchCallback()], strategy="ddp", ...)

Where: Lightning builds its training loaders (from the module's or datamodule's `train_dataloader`
or the loaders given to `fit`), injects its `DistributedSampler` by re-creating them, hands each to
its strategy's `process_dataloader`, and starts the first epoch's iterator, all before any epoch
hook runs. So at `setup` the callback wraps that one public seam of the Trainer's strategy: each
training loader it returns is instrumented in place (`stallwatch.client.torch.instrument`) with the
Trainer's global rank and the device it trains on, and stays the DataLoader Lightning made.
Validation, test and predict loaders are left alone: their waits are not training stalls. The
strategy gets its own method back at `teardown`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader

from stallwatch.client.torch import instrument


class StallwatchCallback(pl.Callback):
    def __init__(self, job: str | None = None) -> None:
        self.job = job

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy.process_dataloader, _Instrumenting):
            return
        strategy.process_dataloader = _Instrumenting(trainer, strategy.process_dataloader, self.job)  # type: ignore[method-assign]

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy.process_dataloader, _Instrumenting):
            del trainer.strategy.process_dataloader  # the class's method again


class _Instrumenting:
    def __init__(self, trainer: pl.Trainer, process: Callable[[object], object], job: str | None) -> None:
        self._trainer = trainer
        self._process = process
        self._job = job

    def __call__(self, dataloader: object) -> object:
        processed = self._process(dataloader)
        trainer = self._trainer
        if trainer.state.stage == RunningStage.TRAINING and isinstance(processed, DataLoader):
            device = trainer.strategy.root_device
            gpu = device.index if device.type == "cuda" else None
            loader: DataLoader[Any] = processed
            instrument(loader, job=self._job, rank=trainer.global_rank, gpu=gpu)
        return processed
