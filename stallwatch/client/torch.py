"""PyTorch integration: `instrument(loader)` times the training loop and tags worker reads by batch.

The loader is instrumented in place and stays the same object: its class becomes a subclass of its
own class (made once per loader class), so `isinstance` checks, every attribute (`dataset`,
`sampler`, `batch_sampler`, `batch_size`, `collate_fn`...), `len()`, `state_dict()` and frameworks
that re-create loaders from their arguments (Lightning injecting its `DistributedSampler`) see the
loader they were given. Only `__iter__` differs: it yields the same batches and records one step
per batch (`loop.timed_steps`).

How the batch tag stays right: the loader's own iterator is built from a *view* of the loader, an
object of a second subclass sharing the loader's `__dict__`, whose `_index_sampler`, `collate_fn`,
`worker_init_fn` and `multiprocessing_context` are wrapped while the loader's own attributes stay
as they are:

- the index sampler numbers every list of indices it hands out, from one count for the process, so
  that a number names one batch of the rank's whole run (every epoch, every loader); the indices
  travel to the worker as a tuple of builtins with their number (`NUMBERED`);
- a worker reads its index queue through `unnumbered`, which sets the worker's current batch right
  before the worker fetches those indices, so every read the dataset records carries it (in the main
  process, with `num_workers=0`, the sampler sets it as it hands the indices out): the view's
  `multiprocessing_context` starts each worker through `_WorkerLoop`, which wraps the `get` of its
  queues in the worker. Only to workers started so are the indices sent numbered; a loader that
  starts its workers another way gets them plain, and its workers' reads carry batch -1;
- the collate function returns the batch tagged with its number (`loop.tagged`), which the step unwraps,
  and marks it handed over (`reads.handed_over`: the worker's latest, as its flushes report);
- each worker's init function binds its reads to the worker's own source before the user's runs.

The dataset itself is never wrapped, so `get_worker_info().dataset` is the user's dataset (the
usual place to shard an `IterableDataset`). The tag travels with the work, so it is exact with
`in_order=False` and `persistent_workers=True`, for map-style and iterable datasets alike. Without
automatic batching (`batch_size=None`) there is no list of indices to number: steps are numbered
in arrival order and reads carry batch -1; the correlator falls back to time overlap for them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import multiprocessing.queues
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.multiprocessing
from torch.utils.data import DataLoader

from stallwatch.client import capture, reads, wire
from stallwatch.client.identity import source_from_environment
from stallwatch.client.loop import TaggedBatch, length_of, tagged, timed_steps
from stallwatch.client.transport import sender

L = TypeVar("L", bound=DataLoader[Any])
_STATE = "_stallwatch"
_CAPTURE = "_stallwatch_capture"  # whether the loader's workers capture their reads
_WORKERS = "_stallwatch_workers"  # the loader's `_Workers`


class _Workers:
    """Whether the loader's workers were started through the view's context, and so unwrap numbered
    indices. Its own object, kept in the loader's `__dict__`: the loader's iterator holds it through
    the index sampler, and holding the `__dict__` itself (which holds the iterator) would make a cycle
    that outlives the loader, its workers killed at exit instead of shut down."""

    __slots__ = ("unwrap",)

    def __init__(self) -> None:
        self.unwrap = False


def _workers(loader_state: dict[str, Any]) -> _Workers:
    found: _Workers | None = loader_state.get(_WORKERS)
    if found is None:
        found = loader_state[_WORKERS] = _Workers()
    return found


# The indices of one batch on their way to a worker: `(indices, number, NUMBERED)`. Builtins only, so
# that the trainer's queue feeder threads pickle them in C (a list subclass carrying the number cost a
# Python call and a class lookup a batch there), and in this order so that `zip` makes them in C too.
NUMBERED = b"\0stallwatch.numbered-indices"

# The process's batch numbers: one names one batch of the rank's whole run, whichever loader served it.
_numbers = itertools.count()


def _number_of(payload: object) -> int | None:
    if type(payload) is tuple and len(payload) == 3 and type(payload[2]) is bytes and payload[2] == NUMBERED:
        return payload[1]  # type: ignore[no-any-return]
    return None


def unnumbered(task: Any) -> Any:
    """A task as a worker's index queue delivers it -> the task as the loader's worker loop expects it,
    the indices' number set as the batch that the reads that follow serve. A task is `(send_idx,
    indices)`, or `(send_idx, (indices, snapshot))` from torchdata's StatefulDataLoader; anything
    else (the loaders' control messages) passes unchanged."""
    if type(task) is not tuple or len(task) != 2 or type(task[1]) is not tuple:
        return task
    send_index, payload = task
    number = _number_of(payload)
    if number is not None:
        reads.set_batch(number)
        return send_index, payload[0]
    number = _number_of(payload[0]) if len(payload) == 2 else None
    if number is not None:
        reads.set_batch(number)
        return send_index, (payload[0][0], payload[1])
    return task


def _unnumbering(get: Callable[..., Any]) -> Callable[..., Any]:
    def get_unnumbered(*args: Any, **kwargs: Any) -> Any:
        return unnumbered(get(*args, **kwargs))

    return get_unnumbered


class _WorkerLoop:
    """A loader worker's target: the loader's own loop, reading its queues through `unnumbered` (only the
    index queue is read in a worker; the result queue is written)."""

    def __init__(self, loop: Callable[..., None]) -> None:
        self._loop = loop

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        for argument in (*args, *kwargs.values()):
            if isinstance(argument, multiprocessing.queues.Queue):
                argument.get = _unnumbering(argument.get)  # type: ignore[method-assign]
        self._loop(*args, **kwargs)


class _NumberingContext:
    """The loader's multiprocessing context (or module), starting its workers through `_WorkerLoop` and
    noting that they unwrap numbered indices."""

    def __init__(self, context: Any, workers: _Workers) -> None:
        self._context = context
        self._workers = workers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802  # the context's own name
        if kwargs.get("target") is not None:  # as both torch's and torchdata's loaders start their workers
            kwargs["target"] = _WorkerLoop(kwargs["target"])
            self._workers.unwrap = True
        return self._context.Process(*args, **kwargs)


def _is_stateful(component: object) -> bool:  # torchdata's Stateful protocol (StatefulDataLoader resumption)
    return callable(getattr(component, "state_dict", None)) and callable(getattr(component, "load_state_dict", None))


class _Numbering:
    """Wraps a batch sampler, or one epoch's iterator of it, numbering its lists of indices (`_numbers`)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner


class _NumberedIterator(_Numbering):
    """Numbers in Python: to set the batch in this process, or to forward the iterator's state.
    `to_workers`: the indices go to workers that unwrap them."""

    def __init__(self, inner: Any, to_workers: bool) -> None:
        super().__init__(inner)
        self._to_workers = to_workers

    def __iter__(self) -> _NumberedIterator:
        return self

    def __next__(self) -> Any:
        indices = next(self._inner)
        number = next(_numbers)
        if self._to_workers:
            return (indices, number, NUMBERED)
        reads.set_batch(number)  # the reads of this process; a worker's then carry batch -1
        return indices


class _NumberedBatches(_Numbering):
    """The batch sampler as the loader's iterator sees it: the same lists of indices, numbered for this
    process (`workers` None) or for the loader's workers."""

    def __init__(self, inner: Any, workers: _Workers | None) -> None:
        super().__init__(inner)
        self._workers = workers

    def __iter__(self) -> Iterator[Any]:
        inner = iter(self._inner)
        # Asked once an epoch has started its workers: only those started through the view's context unwrap.
        to_workers = self._workers is not None and self._workers.unwrap
        if _is_stateful(inner):
            return _StatefulNumberedIterator(inner, to_workers)
        if not to_workers:
            return _NumberedIterator(inner, to_workers)
        # Numbered in C, once a batch in the trainer's main thread; `inner` first, so that the end of
        # an epoch takes no number.
        return zip(inner, _numbers, itertools.repeat(NUMBERED))

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
        number, handed_ns = reads.current_batch(), time.monotonic_ns()
        reads.handed_over(number, handed_ns)
        return tagged(number, batch, handed_ns)


class _BindWorker:
    def __init__(self, source: wire.Source, init: Callable[[int], None] | None, capture_reads: bool) -> None:
        self._source = source
        self._init = init
        self._capture_reads = capture_reads

    def __call__(self, worker_id: int) -> None:
        reads.bind_worker(dataclasses.replace(self._source, worker=worker_id))
        if self._capture_reads:  # here, not in the trainer: its opens stay untouched
            capture.start()  # its settings from this worker's environment, if the trainer's capture came along
        if self._init is not None:
            self._init(worker_id)


def _source(loader: DataLoader[Any]) -> wire.Source:
    """Who the loader records as, kept in its `__dict__`."""
    found: wire.Source | None = loader.__dict__.get(_STATE)
    if found is None:  # re-created by a framework from the loader's own arguments: the environment says who
        found = source_from_environment()
        setattr(loader, _STATE, found)
    return found


# The view's attributes, computed from the loader's own each time its iterator reads them.
def _view_index_sampler(view: DataLoader[Any]) -> Any:
    if view.batch_sampler is None:
        return view.sampler
    numbered = _StatefulNumberedBatches if _is_stateful(view.batch_sampler) else _NumberedBatches
    return numbered(view.batch_sampler, _workers(view.__dict__) if view.num_workers > 0 else None)


def _view_collate_fn(view: DataLoader[Any]) -> Any:
    collate = view.__dict__["collate_fn"]
    return collate if view.batch_sampler is None else _TaggedCollate(collate)


def _view_worker_init_fn(view: DataLoader[Any]) -> _BindWorker:
    return _BindWorker(_source(view), view.__dict__["worker_init_fn"], view.__dict__.get(_CAPTURE, False))


def _view_multiprocessing_context(view: DataLoader[Any]) -> _NumberingContext:
    context = super(type(view), view).multiprocessing_context  # type: ignore[misc]  # the loader's own
    return _NumberingContext(torch.multiprocessing if context is None else context, _workers(view.__dict__))


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
        "multiprocessing_context": property(_view_multiprocessing_context),
    })

    def iterate(loader: DataLoader[Any]) -> Iterator[Any]:
        source = _source(loader)
        view: DataLoader[Any] = object.__new__(view_class)
        object.__setattr__(view, "__dict__", loader.__dict__)  # one state: `_iterator`, resumption, epochs
        steps = timed_steps(base.__iter__(view), sender().channel(source), length_of(loader))
        if loader.num_workers > 0:
            _shut_down_at_exit(loader.__dict__.get("_iterator"))
            return steps
        if loader.__dict__.get(_CAPTURE, False) and not capture.installed():
            capture.start()
        return _reading_here(source, steps)

    found = type(f"Instrumented{base.__name__}", (base,), {
        "__module__": __name__,
        "__doc__": base.__doc__,
        "__iter__": iterate,
        "__reduce_ex__": _reduce,
    })
    _instrumented[base] = found
    _base_of[found] = base
    return found


def _shut_down_at_exit(iterator: object) -> None:
    """Persistent workers still running when the trainer exits are terminated by multiprocessing's exit hook,
    and the reads they have not flushed yet are lost; torch's own hook, which lets them exit (and flush), is
    registered only with `pin_memory`. Asked for each epoch's iterator: a weak set holds them."""
    register = getattr(iterator, "_register_persistent_workers_atexit", None)
    if register is not None:
        register()


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
    loader: L, job: str | None = None, rank: int | None = None, gpu: int | str | None = None,
    capture_reads: bool = True,
) -> L:
    """Instrument `loader` in place and return it: iterating it records the loop's steps, and the reads
    its dataset makes carry the batch they serve. Job, rank and gpu default from the environment
    (`identity.source_from_environment`; gpu is the CUDA device index the process trains on, or its UUID).

    With `capture_reads` (unless `capture.CAPTURE_ENV` is "0"), the files its workers (or, without
    workers, its epochs) read through `open()` are recorded too (`stallwatch.client.capture`); reads
    the dataset records itself (`open_recorded`, `ReadSpan`) are recorded either way.

    Call it before the loader's first iteration: a `persistent_workers` iterator made earlier keeps its
    workers, whose batches are then numbered in arrival order. Instrumenting again only changes who
    the loader records as and whether it captures.
    """
    setattr(loader, _STATE, source_from_environment(job, rank, gpu))
    setattr(loader, _CAPTURE, capture_reads and capture.enabled())
    if type(loader) not in _base_of:
        loader.__class__ = _instrumented_class(type(loader))  # type: ignore[assignment]  # a subclass of L
    return loader


def instrument_every_loader() -> None:
    """Instrument every DataLoader made from now on as it is made (`stallwatch run`): each as
    `instrument(loader)` with its defaults, the environment naming job, rank and GPU."""
    if getattr(DataLoader.__init__, _STATE, False):
        return
    made = DataLoader.__init__

    @functools.wraps(made)
    def made_instrumented(loader: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
        made(loader, *args, **kwargs)
        if type(loader) not in _base_of:  # a framework re-creating an instrumented loader keeps its source
            try:
                instrument(loader)
            except Exception as error:  # the loader trains uninstrumented
                print(f"stallwatch: {type(loader).__name__} not instrumented: {error!r}", file=sys.stderr)

    setattr(made_instrumented, _STATE, True)
    DataLoader.__init__ = made_instrumented  # type: ignore[method-assign,assignment]
