"""`monitor()`: time a training loop's waits for batches and the steps between them."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from stallwatch.client.identity import source_from_environment
from stallwatch.client.transport import Channel, sender

T = TypeVar("T")


class Monitored(Generic[T]):
    """An iterable that yields what the wrapped one yields and records one step per item.

    A step is the wait inside `next()` (wait_start..wait_end) and the work that follows until the
    loop asks for the next item (compute_end). The last step of an iteration ends when the loop asks
    again and the loader is exhausted, or when the loop leaves early (`break`, an exception): the
    generator is closed then and its `finally` records the step. Each `iter()` is one epoch; the
    buffered events are flushed at its end.

    Steps are numbered in arrival order from 0 each epoch, unless `tagged`: then the wrapped loader
    yields `(batch_index, handed_over_ns, batch)` (the PyTorch integration tags each batch in the
    worker that built it, and stamps when the worker finished it), the step records the index and
    the handover and the loop gets the batch alone. Untagged steps record the handover as -1.
    """

    def __init__(self, iterable: Iterable[Any], channel: Channel, tagged: bool = False) -> None:
        self._iterable = iterable
        self._channel = channel
        self._tagged = tagged

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]  # raises as the wrapped loader would

    def __iter__(self) -> Iterator[T]:
        return self._steps(iter(self._iterable))

    def _steps(self, items: Iterator[Any]) -> Iterator[T]:
        clock, record, tagged = time.monotonic_ns, self._channel.step, self._tagged
        index, handed_over = 0, -1
        wait_start = clock()
        try:
            for item in items:
                wait_end = clock()
                if tagged:
                    index, handed_over, item = item  # noqa: PLW2901
                try:
                    yield item
                finally:
                    compute_end = clock()
                    record((index, wait_start, wait_end, compute_end, handed_over))
                index += 1
                wait_start = compute_end
        finally:
            self._channel.flush()


def monitor(
    loader: Iterable[T], job: str | None = None, rank: int | None = None, gpu: int | None = None
) -> Monitored[T]:
    """Wrap any iterable of batches; job, rank and gpu default from the environment."""
    return Monitored(loader, sender().channel(source_from_environment(job, rank, gpu)))
