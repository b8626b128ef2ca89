"""PyTorch integration: `instrument(loader)` times the training loop and tags worker reads by batch.

How the batch tag stays right: the loader is rebuilt around the same dataset, sampler and options
with three wrappers. In the main process, the batch sampler numbers every list of indices it hands
out (`NumberedIndices`, a list that carries its number, counting on across epochs so a number names
one batch of the whole run). In the worker, the dataset wrapper reads that number before fetching
the samples, so every read the dataset records carries it, and the collate wrapper returns
`(number, batch)`; the training loop gets the batch alone and its step records the same number.
The tag travels with the work itself, so it does not depend on the loader's round-robin dispatch:
it is exact with `in_order=False` (batches arrive out of order, each with its own number) and with
`persistent_workers=True` (workers outlive epochs, numbers keep counting).

Iterable-style datasets have no batch sampler: reads are recorded with their worker but batch -1,
and steps are numbered in arrival order; the correlator falls back to time overlap for them. The
same holds without automatic batching (`batch_size=None`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from stallwatch.client import reads, wire
from stallwatch.client.identity import source_from_environment
from stallwatch.client.loop import Monitored
from stallwatch.client.transport import sender


class NumberedIndices(list[Any]):
    """The indices of one batch and the batch's number; pickles to the worker with its number."""

    def __init__(self, indices: Iterable[Any], number: int) -> None:
        super().__init__(indices)
        self.number = number

    def __reduce__(self) -> tuple[Any, ...]:
        return NumberedIndices, (list(self), self.number)


class _NumberedBatches:
    def __init__(self, batch_sampler: Iterable[Sequence[Any]]) -> None:
        self._inner = batch_sampler
        self._next = 0

    def __iter__(self) -> Iterator[NumberedIndices]:
        for indices in self._inner:
            numbered = NumberedIndices(indices, self._next)
            self._next += 1
            yield numbered

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


def _bind_this_worker(source: wire.Source) -> None:
    info = get_worker_info()
    worker = -1 if info is None else info.id
    this_worker = wire.Source(source.job, source.rank, source.gpu, worker)
    if reads.bound_source() != this_worker:
        reads.bind_worker(this_worker)


class _RecordedMapDataset(Dataset[Any]):
    def __init__(self, inner: Dataset[Any], source: wire.Source) -> None:
        self._inner = inner
        self._source = source

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        _bind_this_worker(self._source)
        reads.set_batch(getattr(indices, "number", -1))
        fetch_many = getattr(self._inner, "__getitems__", None)
        if fetch_many is not None:
            return list(fetch_many(indices))
        return [self._inner[index] for index in indices]

    def __getitem__(self, index: Any) -> Any:
        _bind_this_worker(self._source)
        return self._inner[index]

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


class _RecordedIterableDataset(IterableDataset[Any]):
    def __init__(self, inner: IterableDataset[Any], source: wire.Source) -> None:
        self._inner = inner
        self._source = source

    def __iter__(self) -> Iterator[Any]:
        _bind_this_worker(self._source)
        return iter(self._inner)


class _TaggedCollate:
    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self._collate = collate

    def __call__(self, samples: list[Any]) -> tuple[int, int, Any]:
        batch = self._collate(samples)
        # The worker hands the batch over now: what the trainer waits after this is its delivery.
        return reads.current_batch(), time.monotonic_ns(), batch


def instrument(
    loader: DataLoader[Any], job: str | None = None, rank: int | None = None, gpu: int | None = None
) -> Monitored[Any]:
    """A monitored copy of `loader`: same dataset, sampler and options, with reads tagged by batch.

    Use the returned object instead of `loader` (iterating the copy's inner loader directly would
    yield `(number, batch)` pairs). Job, rank and gpu default from the environment.
    """
    source = source_from_environment(job, rank, gpu)
    options: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": loader.in_order,
    }
    dataset = loader.dataset
    channel = sender().channel(source)
    if isinstance(dataset, IterableDataset):
        rebuilt: DataLoader[Any] = DataLoader(
            _RecordedIterableDataset(dataset, source), batch_size=loader.batch_size, drop_last=loader.drop_last,
            collate_fn=loader.collate_fn, **options,
        )
        return Monitored(rebuilt, channel)
    if loader.batch_sampler is None:
        rebuilt = DataLoader(
            _RecordedMapDataset(dataset, source), batch_size=None, sampler=loader.sampler,
            collate_fn=loader.collate_fn, **options,
        )
        return Monitored(rebuilt, channel)
    rebuilt = DataLoader(
        _RecordedMapDataset(dataset, source), batch_sampler=_NumberedBatches(loader.batch_sampler),
        collate_fn=_TaggedCollate(loader.collate_fn), **options,
    )
    return Monitored(rebuilt, channel, tagged=True)
