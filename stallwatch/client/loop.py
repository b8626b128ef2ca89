"""`monitor()`: time a training loop's waits for batches and the steps between them."""

from __future__ import annotations

import dis
import time
import weakref
from collections.abc import Generator, Iterable, Iterator
from types import GeneratorType
from typing import Any, Generic, TypeVar, cast

from stallwatch.client import reads, wire
from stallwatch.client.identity import source_from_environment
from stallwatch.client.transport import FULL, OPEN_AFTER_NS, Channel, sender

T = TypeVar("T")


# A batch and the number its worker built it under, as the PyTorch integration's collate returns it:
# `(TAG, number, batch, handed_over_ns)`, the last when the worker finished the batch (the trainer's
# wait after it is delivery; -1 unknown). A plain tuple with a bytes marker rather than a class of
# our own: unpickling a class's instance in the trainer looks the class up by name, ~1 µs a batch
# (measured), and a tuple of builtins needs no lookup; `pin_memory` keeps tuples as tuples.
TAG = b"\0stallwatch.tagged-batch"
TaggedBatch = tuple[bytes, int, Any, int]


def tagged(number: int, batch: Any, handed_over_ns: int = -1) -> TaggedBatch:
    return (TAG, number, batch, handed_over_ns)


def timed_steps(items: Iterator[Any], channel: Channel, length: int | None = None) -> Iterator[Any]:
    """Yield what `items` yields, recording one step per item into `channel`; `length`: the steps the loop will
    take, when its loader knows (`len()`), reported with its progress (`wire.OPEN_EPOCH`).

    A step is the wait inside `next()` (wait_start..wait_end) and the work that follows until the
    loop asks for the next item (compute_end). The last step ends when the loop asks again and the
    items are exhausted, or when the loop leaves early (`break`, an exception): the generator is
    closed then and its `finally` records the step. The buffered events are flushed at the end, with
    the loop's end (`wire.OPEN_ENDED`).

    A tagged batch (`tagged`) is unwrapped: its step records the batch's own number and the loop gets the
    batch alone. Other items are numbered in arrival order from 0.

    While the loop waits in `next()`, the channel's flushes report the wait (`_OpenLoop`).
    """
    loop = _OpenLoop(length)
    steps = _timed_steps(items, channel, loop)
    # Weak: a loop left unfinished is still collected, and so closed.
    loop.generator = weakref.ref(cast("GeneratorType[Any, None, None]", steps))
    return steps


def _timed_steps(items: Iterator[Any], channel: Channel, loop: _OpenLoop) -> Generator[Any, None, None]:
    # `Channel.step` inlined: a Python call less a batch, paid where the trainer's caches are cold
    # after its step (each call there costs several times its `timeit` figure, docs/benchmarks.md).
    clock, steps, flush_full = time.monotonic_ns, channel.steps, channel.flush_full
    index = 0
    wait_start = loop.start_ns = clock()
    loop.steps_before = channel.steps_recorded()
    outer, channel.loop = channel.loop, loop  # once an epoch; a loop run inside another's step gives it back
    try:
        for item in items:  # _WAIT_LINE: the flush thread sees the wait here, so a step stores nothing for it
            wait_end = clock()
            if type(item) is tuple and len(item) == 4 and type(item[0]) is bytes and item[0] == TAG:
                _, index, item, handed_over = item  # noqa: PLW2901
            else:
                handed_over = -1
            try:
                yield item
            finally:
                compute_end = clock()
                steps.append((index, wait_start, wait_end, compute_end, handed_over))
                if len(steps) >= FULL:
                    flush_full()
                index += 1
                wait_start = compute_end
    finally:
        channel.end_loop(loop, outer, wait_start)


# The line of `_timed_steps` where its generator, running, waits inside `next(items)`. Running elsewhere it
# is between a step's end and that step's append, where the channel's last step is not yet the wait's start.
_WAIT_LINE = next(instruction.positions.lineno for instruction in dis.get_instructions(_timed_steps)
                  if instruction.opname.startswith("FOR_ITER") and instruction.positions is not None)


class _OpenLoop:
    """A `timed_steps` loop as its channel's flushes see it: waiting while its generator runs at
    `_WAIT_LINE`, since the last step's compute end, or since the loop began before its first step; and, when
    its length is known, how many of its steps it has taken."""

    __slots__ = ("generator", "length", "start_ns", "steps_before")

    def __init__(self, length: int | None = None) -> None:
        self.generator: weakref.ref[GeneratorType[Any, None, None]] | None = None
        self.start_ns = -1
        self.length = length
        self.steps_before = 0  # the channel's steps when the loop began (`Channel.steps_recorded`)

    def open_records(self, channel: Channel, as_of_ns: int) -> list[wire.Open]:
        records = self._progress(channel, as_of_ns)
        generator = None if self.generator is None else self.generator()
        if generator is None or not generator.gi_running:
            return records
        frame = generator.gi_frame
        if frame is None or frame.f_lineno != _WAIT_LINE:
            return records
        # A loop's steps end after it began, and steps before it (another loop's) ended before it began.
        since = max(self.start_ns, channel.last_step_end())
        if as_of_ns - since >= OPEN_AFTER_NS:
            records.append((wire.OPEN_WAIT, -1, 0, since, as_of_ns))
        return records

    def _progress(self, channel: Channel, as_of_ns: int) -> list[wire.Open]:
        """The epoch's progress, from the channel's count of steps: a step costs nothing more."""
        if not self.length or self.start_ns < 0:
            return []
        done = min(channel.steps_recorded() - self.steps_before, self.length)
        return [(wire.OPEN_EPOCH, done, self.length, self.start_ns, as_of_ns)]


class Monitored(Generic[T]):
    """An iterable that yields what the wrapped one yields and records one step per item
    (`timed_steps`); each `iter()` is one epoch."""

    def __init__(self, iterable: Iterable[Any], channel: Channel) -> None:
        self._iterable = iterable
        self._channel = channel

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]  # raises as the wrapped loader would

    def __iter__(self) -> Iterator[T]:
        steps = timed_steps(iter(self._iterable), self._channel, length_of(self._iterable))
        # Reads in this process during the loop (no loader workers) are the loop's job's, not the environment's.
        return steps if reads.bound() else _reading_as(steps, self._channel.source)


def length_of(iterable: object) -> int | None:
    """The steps an epoch of `iterable` takes, if it says (a DataLoader over a map-style dataset does; an
    iterable-style one raises TypeError, and `len()` of anything else may raise anything)."""
    try:
        length = len(iterable)  # type: ignore[arg-type]
    except Exception:  # a length it cannot give is no length
        return None
    return length if type(length) is int and length > 0 else None


def _reading_as(steps: Iterator[T], source: wire.Source) -> Iterator[T]:
    with reads.reads_as(source):
        yield from steps


def monitor(
    loader: Iterable[T], job: str | None = None, rank: int | None = None, gpu: int | str | None = None
) -> Monitored[T]:
    """Wrap any iterable of batches; job, rank and gpu default from the environment (see `instrument`)."""
    return Monitored(loader, sender().channel(source_from_environment(job, rank, gpu)))
