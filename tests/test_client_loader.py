"""`instrument()` leaves the loader what it was: the same object, attributes, batches and resumption."""

from __future__ import annotations

import copy
import gc
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from stallwatch.client import reads, transport
from stallwatch.client.torch import instrument


class Numbers(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 23

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class Range(IterableDataset[int]):
    """The PyTorch docs' sharded iterable: each worker's `worker_init_fn` narrows its own copy."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))


def shard_range(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    dataset = info.dataset  # the user's own dataset, not a wrapper: setting its fields must work
    assert isinstance(dataset, Range)
    per_worker = (dataset.end - dataset.start + info.num_workers - 1) // info.num_workers
    dataset.start += worker_id * per_worker
    dataset.end = min(dataset.start + per_worker, dataset.end)


class ResumableLoader(DataLoader[Any]):
    """A DataLoader subclass of the user's with a method and an attribute of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.label = "mine"

    def describe(self) -> str:
        return f"{self.label}: {len(self)} batches"


@pytest.fixture(autouse=True)
def no_agent(tmp_path: Path) -> Iterator[None]:
    transport.configure(str(tmp_path / "absent.sock"))  # recording goes nowhere: only the loader matters here
    yield
    transport.sender().close()


def batches(loader: DataLoader[Any], epochs: int = 1) -> list[list[Any]]:
    served = []
    for epoch in range(epochs):
        for sampler in (loader.sampler, loader.batch_sampler):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)  # type: ignore[union-attr]  # the DDP tutorial's idiom, through the loader's own sampler
        served += [batch.tolist() if isinstance(batch, torch.Tensor) else batch for batch in loader]
    return served


CONFIGS: dict[str, Callable[[], DataLoader[Any]]] = {
    "shuffled, 2 workers": lambda: DataLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2,
                                               generator=torch.Generator().manual_seed(7)),
    "distributed sampler, rank 1 of 3": lambda: DataLoader(
        Numbers(), batch_size=3, sampler=DistributedSampler(Numbers(), num_replicas=3, rank=1, seed=5)),
    "persistent workers, prefetch 4": lambda: DataLoader(Numbers(), batch_size=5, num_workers=2,
                                                         persistent_workers=True, prefetch_factor=4),
    "custom batch sampler, drop_last": lambda: DataLoader(
        Numbers(), batch_sampler=BatchSampler(range(23), batch_size=6, drop_last=True), num_workers=1),
    "spawned workers": lambda: DataLoader(Numbers(), batch_size=6, num_workers=1, multiprocessing_context="spawn",
                                          persistent_workers=True),
    "no automatic batching": lambda: DataLoader(Numbers(), batch_size=None, num_workers=2),
    "sharded iterable dataset": lambda: DataLoader(Range(0, 19), batch_size=4, num_workers=2,
                                                   worker_init_fn=shard_range),
    "iterable dataset in the main process": lambda: DataLoader(Range(3, 12), batch_size=2),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_the_instrumented_loader_serves_the_same_batches(config: str) -> None:
    make = CONFIGS[config]
    assert batches(instrument(make()), epochs=2) == batches(make(), epochs=2)


def test_out_of_order_loading_serves_the_same_batches_in_its_own_order() -> None:
    def make() -> DataLoader[Any]:
        return DataLoader(Numbers(), batch_size=4, num_workers=2, in_order=False)

    assert sorted(batches(instrument(make()))) == sorted(batches(make()))


def test_the_loader_is_the_same_object_with_every_attribute_as_it_was() -> None:
    def init(worker_id: int) -> None:
        pass

    loader = ResumableLoader(Numbers(), batch_size=4, shuffle=True, num_workers=2, worker_init_fn=init,
                             prefetch_factor=3, persistent_workers=True, drop_last=True)
    before = {name: value for name, value in vars(loader).items() if not name.startswith("_")}
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    assert instrument(loader) is loader
    assert isinstance(loader, ResumableLoader) and isinstance(loader, DataLoader)
    assert {name: value for name, value in vars(loader).items() if not name.startswith("_")} == before
    assert loader.sampler is sampler and loader.batch_sampler is batch_sampler
    assert loader.worker_init_fn is init and loader.collate_fn is before["collate_fn"]
    assert (loader.batch_size, loader.num_workers, loader.prefetch_factor, len(loader)) == (4, 2, 3, 5)
    assert loader.describe() == "mine: 5 batches"
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        loader.batch_size = 8  # DataLoader's own guard still holds
    assert instrument(loader, job="again") is loader and type(loader).__mro__[1] is ResumableLoader


def test_a_copied_or_pickled_loader_is_still_instrumented() -> None:
    loader = instrument(DataLoader(Numbers(), batch_size=5), job="copied")
    for restored in (copy.copy(loader), copy.deepcopy(loader), pickle.loads(pickle.dumps(loader))):
        assert type(restored) is type(loader) and restored.__dict__["_stallwatch"].job == "copied"
        assert batches(restored) == batches(loader)


def stateful(**options: Any) -> StatefulDataLoader:
    return StatefulDataLoader(Numbers(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(3),
                              **options)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_resumes_where_it_stopped(workers: int) -> None:
    def resumed(wrap: Callable[[StatefulDataLoader], StatefulDataLoader]) -> tuple[list[Any], list[Any]]:
        first = wrap(stateful(num_workers=workers))
        served = iter(first)
        head = [next(served).tolist() for _ in range(3)]
        state = first.state_dict()
        second = wrap(stateful(num_workers=workers))
        second.load_state_dict(state)
        return head, [batch.tolist() for batch in second]

    plain_head, plain_rest = resumed(lambda loader: loader)
    head, rest = resumed(instrument)
    assert (head, rest) == (plain_head, plain_rest)
    assert len(plain_head) + len(plain_rest) == 8 and plain_rest  # resumed mid-epoch, not from the start


def test_two_loaders_of_one_process_never_give_two_batches_one_number() -> None:
    """A rank's training and validation loaders record as the same source: a batch number names one batch
    of either, so their reads are never joined to the other loader's steps."""
    train, validation = (instrument(DataLoader(Numbers(), batch_size=5), job="two", rank=0) for _ in range(2))
    numbers = []
    for loader in (train, validation, train):
        for _ in loader:
            numbers.append(reads.current_batch())  # no workers: the batch being served in this process
    assert len(numbers) == 15 and len(set(numbers)) == 15


def test_a_dropped_loader_shuts_its_workers_down_at_once() -> None:
    """No reference cycle through the instrumentation: dropping the last reference shuts the workers down
    (they finish and flush what they read) instead of leaving them to be killed when the process exits."""
    gc.disable()
    try:
        loader = instrument(DataLoader(Numbers(), batch_size=5, num_workers=2, persistent_workers=True))
        assert batches(loader) == batches(DataLoader(Numbers(), batch_size=5))
        workers = loader._iterator._workers  # type: ignore[union-attr]
        del loader
        assert not any(worker.is_alive() for worker in workers)
    finally:
        gc.enable()
