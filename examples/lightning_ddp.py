"""PyTorch Lightning DDP with stallwatch: 2 CPU processes, Lightning's own DistributedSampler.

    python examples/lightning_ddp.py --data DIR [--stallwatch callback|instrument|off]

`callback` adds `StallwatchCallback()` to the Trainer; `instrument` wraps the loader where the
LightningModule makes it. Either way the loader stays a DataLoader, so Lightning still injects its
DistributedSampler and each rank reads its own half of the samples.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning
import torch
from sample_files import SampleFiles, make_samples, write_ids
from torch.utils.data import DataLoader, TensorDataset

from stallwatch.client.lightning import StallwatchCallback
from stallwatch.client.torch import instrument


class Regression(lightning.LightningModule):
    def __init__(self, data: Path, stallwatch: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.data = data
        self.stallwatch = stallwatch
        self.seen: list[int] = []

    def train_dataloader(self) -> DataLoader[Any]:
        # Persistent workers, as DDP jobs run them: forked once, before the rank's threads (gloo's, the
        # queue feeders, stallwatch's flush thread) are busy; a worker forked anew each epoch from that
        # many threads hung in the child, in C before Python's own after-fork (seen about once in 15 runs).
        loader = DataLoader(SampleFiles(self.data), batch_size=4, shuffle=True, num_workers=1,
                            persistent_workers=True)
        return instrument(loader) if self.stallwatch == "instrument" else loader

    def val_dataloader(self) -> DataLoader[Any]:  # in memory; its waits are not training stalls
        return DataLoader(TensorDataset(torch.rand(16, 1)), batch_size=4)

    def validation_step(self, batch: list[torch.Tensor], batch_index: int) -> None:
        self.log("val_loss", self.layer(batch[0]).pow(2).mean(), sync_dist=True)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_index: int) -> torch.Tensor:
        ids, features = batch
        self.seen += ids.tolist()
        return self.layer(features).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="sample files (made when missing)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--stallwatch", choices=["callback", "instrument", "off"], default="callback")
    parser.add_argument("--ids-out", type=Path, help="write the sample ids each rank trained on here")
    options = parser.parse_args()

    if not options.data.exists():  # before the Trainer starts the second process, which runs this script again
        make_samples(options.data, options.samples)
    lightning.seed_everything(0)
    model = Regression(options.data, options.stallwatch)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=options.epochs,
        callbacks=[StallwatchCallback()] if options.stallwatch == "callback" else [],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model)
    write_ids(options.ids_out, trainer.global_rank, model.seen)


if __name__ == "__main__":
    main()
