"""PyTorch integration: `instrument(loader)` times the training loop and tags worker reads by batch.

The loader is instrumented in place and stays the same object: its class becomes a subclass of its
own class (made once per loader class), so `isinstance` checks, every attribute (`dataset`,
`sampler`, `batch_sampler`, `batch_size`, `collate_fn`...), `len()`, `state_dict()` and frameworks
that re-create loaders from their arguments (Lightning injecting its `DistributedSampler`) see the
loader they were given. Only `__iter__` differs: it yields the same batches and records one step
per batch (`loop.timed_steps`).

How the batch tag stays right: the loader's own iterator is built from a *view* of the loader, an
object of a second subclass sharing the loader's `__dict__`, whose `_index_sampler`, `collate_fn`
and `worker_init_fn` are wrapped while the loader's own attributes stay as they are:

- the index sampler numbers every list of indices it hands out (`NumberedIndices`, counting on
  across epochs so that a number names one batch of the whole run);
- a worker unpickles those indices from its index queue right before it fetches them, and the
  unpickling sets the worker's current batch, so every read the dataset records carries it (in
  the main process, with `num_workers=0`, the sampler sets it as it hands the indices out);
- the collate function returns the batch tagged with its number (`loop.tagged`), which the step unwraps;
- each worker's init function binds its reads to the worker's own source before the user's runs.

The dataset itself is never wrapped, so `get_worker_info().dataset` is the user's dataset (the
usual place to shard an `IterableDataset`). The tag travels with the work, so it is exact with
`in_order=False` and `persistent_workers=True`, for map-style and iterable datasets alike. Without
automatic batching (`batch_size=None`) there is no list of indices to number: steps are numbered
in arrival order and reads carry batch -1; the correlator falls back to time overlap for them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from torch.utils.data import DataLoader

from stallwatch.client import reads, wire
from stallwatch.client.identity import source_from_environment
from stallwatch.client.loop import TaggedBatch, tagged, timed_steps
from stallwatch.client.transport import sender

L = TypeVar("L", bound=DataLoader[Any])
_STATE = "_stallwatch"


@dataclasses.dataclass
class Instrumentation:
    """What an instrumented loader keeps in its `__dict__`: who it records as, the next batch number."""

    source: wire.Source
    next_number: int = 0


class NumberedIndices(list[Any]):
    """The indices of one batch and the batch's number (`number`, set after construction, so that
    making one costs only the list's own copy); pickles to the worker with its number.

    The pickle is the list's items and the number as the state, rebuilt by C code but for
    `__setstate__`: one class lookup a batch, against a class and a function (`__reduce__` to a
    module-level function measured ~0.4 µs a batch more in the trainer's queue feeder threads).
    """

    __slots__ = ("number",)
    number: int

    def __reduce_ex__(self, protocol: object) -> tuple[Any, ...]:
        return NumberedIndices, (), self.number, iter(self)

    def __setstate__(self, number: int) -> None:
        """Unpickling in a loader worker, which fetches these indices next: the reads that follow serve them."""
        self.number = number
        reads.set_batch(number)


def _is_stateful(component: object) -> bool:  # torchdata's Stateful protocol (StatefulDataLoader resumption)
    return callable(getattr(component, "state_dict", None)) and callable(getattr(component, "load_state_dict", None))


class _Numbering:
    """Wraps a batch sampler, or one epoch's iterator of it; `counter` numbers the lists of indices."""

    def __init__(self, inner: Any, counter: Instrumentation, in_this_process: bool) -> None:
        self._inner = inner
        self._counter = counter
        self._in_this_process = in_this_process


class _NumberedIterator(_Numbering):
    def __iter__(self) -> _NumberedIterator:
        return self

    def __next__(self) -> NumberedIndices:
        indices = next(self._inner)
        number = self._counter.next_number
        self._counter.next_number = number + 1
        if self._in_this_process:
            reads.set_batch(number)
        found = NumberedIndices(indices)
        found.number = number
        return found


class _NumberedBatches(_Numbering):
    """The batch sampler as the loader's iterator sees it: the same lists of indices, numbered."""

    def __iter__(self) -> _NumberedIterator:
        inner = iter(self._inner)
        numbered = _StatefulNumberedIterator if _is_stateful(inner) else _NumberedIterator
        return numbered(inner, self._counter, self._in_this_process)

    def __len__(self) -> int:
        return len(self._inner)  # raises as the wrapped sampler would


class _ForwardsState(_Numbering):
    """Resumption (torchdata's StatefulDataLoader) saves and restores the wrapped sampler's own state."""

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._inner.load_state_dict(state)


class _StatefulNumberedIterator(_ForwardsState, _NumberedIterator):
    pass


class _StatefulNumberedBatches(_ForwardsState, _NumberedBatches):
    pass


class _TaggedCollate:
    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self._collate = collate

    def __call__(self, samples: list[Any]) -> TaggedBatch:
        batch = self._collate(samples)
        # The worker hands the batch over now: what the trainer waits after this is its delivery.
        return tagged(reads.current_batch(), batch, time.monotonic_ns())


class _BindWorker:
    def __init__(self, source: wire.Source, init: Callable[[int], None] | None) -> None:
        self._source = source
        self._init = init

    def __call__(self, worker_id: int) -> None:
        reads.bind_worker(dataclasses.replace(self._source, worker=worker_id))
        if self._init is not None:
            self._init(worker_id)


def _instrumentation(loader: DataLoader[Any]) -> Instrumentation:
    found: Instrumentation | None = loader.__dict__.get(_STATE)
    if found is None:  # re-created by a framework from the loader's own arguments: the environment says who
        found = Instrumentation(source_from_environment())
        setattr(loader, _STATE, found)
    return found


# The view's attributes, computed from the loader's own each time its iterator reads them.
def _view_index_sampler(view: DataLoader[Any]) -> Any:
    if view.batch_sampler is None:
        return view.sampler
    numbered = _StatefulNumberedBatches if _is_stateful(view.batch_sampler) else _NumberedBatches
    return numbered(view.batch_sampler, _instrumentation(view), in_this_process=view.num_workers == 0)


def _view_collate_fn(view: DataLoader[Any]) -> Any:
    collate = view.__dict__["collate_fn"]
    return collate if view.batch_sampler is None else _TaggedCollate(collate)


def _view_worker_init_fn(view: DataLoader[Any]) -> _BindWorker:
    return _BindWorker(_instrumentation(view).source, view.__dict__["worker_init_fn"])


_instrumented: dict[type[DataLoader[Any]], type[DataLoader[Any]]] = {}
_base_of: dict[type[DataLoader[Any]], type[DataLoader[Any]]] = {}


def _instrumented_class(base: type[DataLoader[Any]]) -> type[DataLoader[Any]]:
    found = _instrumented.get(base)
    if found is not None:
        return found
    view_class = type(f"{base.__name__}View", (base,), {
        "__module__": __name__,
        "_index_sampler": property(_view_index_sampler),
        "collate_fn": property(_view_collate_fn),
        "worker_init_fn": property(_view_worker_init_fn),
    })

    def iterate(loader: DataLoader[Any]) -> Iterator[Any]:
        state = _instrumentation(loader)
        view: DataLoader[Any] = object.__new__(view_class)
        object.__setattr__(view, "__dict__", loader.__dict__)  # one state: `_iterator`, resumption, epochs
        steps = timed_steps(base.__iter__(view), sender().channel(state.source))
        return _reading_here(state.source, steps) if loader.num_workers == 0 else steps

    found = type(f"Instrumented{base.__name__}", (base,), {
        "__module__": __name__,
        "__doc__": base.__doc__,
        "__iter__": iterate,
        "__reduce_ex__": _reduce,
    })
    _instrumented[base] = found
    _base_of[found] = base
    return found


def _reading_here(source: wire.Source, steps: Iterator[Any]) -> Iterator[Any]:
    """Without workers the dataset reads in this process: as the loader's source, during its epoch only."""
    with reads.reads_as(source):
        yield from steps


def _reduce(loader: DataLoader[Any], protocol: object) -> tuple[Any, ...]:
    """Pickle and copy as an instance of the loader's own class, instrumented again when restored."""
    return _restore, (_base_of[type(loader)],), loader.__dict__


def _restore(base: type[DataLoader[Any]]) -> DataLoader[Any]:
    loader: DataLoader[Any] = object.__new__(base)
    loader.__class__ = _instrumented_class(base)
    return loader


def instrument(
    loader: L, job: str | None = None, rank: int | None = None, gpu: int | str | None = None
) -> L:
    """Instrument `loader` in place and return it: iterating it records the loop's steps, and the reads
    its dataset records carry the batch they serve. Job, rank and gpu default from the environment
    (`identity.source_from_environment`; gpu is the CUDA device index the process trains on, or its UUID).

    Call it before the loader's first iteration: a `persistent_workers` iterator made earlier keeps its
    workers, whose batches are then numbered in arrival order. Instrumenting again only updates who
    the loader records as.
    """
    source = source_from_environment(job, rank, gpu)
    found: Instrumentation | None = loader.__dict__.get(_STATE)
    if found is None:
        setattr(loader, _STATE, Instrumentation(source))
    else:  # keeps counting batches: a number names one batch of the run
        found.source = source
    if type(loader) not in _base_of:
        loader.__class__ = _instrumented_class(type(loader))  # type: ignore[assignment]  # a subclass of L
    return loader
