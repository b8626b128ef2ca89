"""`monitor()`: time a training loop's waits for batches and the steps between them."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Generic, NamedTuple, TypeVar

from stallwatch.client.identity import source_from_environment
from stallwatch.client.transport import Channel, sender

T = TypeVar("T")


class TaggedBatch(NamedTuple):
    """A batch and the number its worker built it under (the PyTorch integration's collate returns these).

    A named tuple because `pin_memory` keeps named tuples as they are (it turns plain tuples into lists).
    """

    number: int
    batch: Any


def timed_steps(items: Iterator[Any], channel: Channel) -> Iterator[Any]:
    """Yield what `items` yields, recording one step per item into `channel`.

    A step is the wait inside `next()` (wait_start..wait_end) and the work that follows until the
    loop asks for the next item (compute_end). The last step ends when the loop asks again and the
    items are exhausted, or when the loop leaves early (`break`, an exception): the generator is
    closed then and its `finally` records the step. The buffered events are flushed at the end.

    A `TaggedBatch` is unwrapped: its step records the batch's own number and the loop gets the
    batch alone. Other items are numbered in arrival order from 0.
    """
    clock, record = time.monotonic_ns, channel.step
    index = 0
    wait_start = clock()
    try:
        for item in items:
            wait_end = clock()
            if type(item) is TaggedBatch:
                index, item = item  # noqa: PLW2901
            try:
                yield item
            finally:
                compute_end = clock()
                record((index, wait_start, wait_end, compute_end))
            index += 1
            wait_start = compute_end
    finally:
        channel.flush()


class Monitored(Generic[T]):
    """An iterable that yields what the wrapped one yields and records one step per item
    (`timed_steps`); each `iter()` is one epoch."""

    def __init__(self, iterable: Iterable[Any], channel: Channel) -> None:
        self._iterable = iterable
        self._channel = channel

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]  # raises as the wrapped loader would

    def __iter__(self) -> Iterator[T]:
        return timed_steps(iter(self._iterable), self._channel)


def monitor(
    loader: Iterable[T], job: str | None = None, rank: int | None = None, gpu: int | str | None = None
) -> Monitored[T]:
    """Wrap any iterable of batches; job, rank and gpu default from the environment (see `instrument`)."""
    return Monitored(loader, sender().channel(source_from_environment(job, rank, gpu)))
