"""What the PyTorch integration adds to each batch's trip between trainer and worker: numbered indices
and tagged batches round-trip intact as builtins only (a class to look up or a Python method to call
is ~1 µs of the trainer's threads a batch, measured in benchmarks/client_overhead.py)."""

from __future__ import annotations

import pickletools
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch

from stallwatch.client import reads, transport, wire
from stallwatch.client.loop import tagged, timed_steps
from stallwatch.client.torch import NUMBERED, _NumberedBatches, _Workers, unnumbered


def globals_looked_up(payload: bytes) -> int:
    return sum(1 for opcode, _, _ in pickletools.genops(payload) if opcode.name in ("GLOBAL", "STACK_GLOBAL"))


def as_a_loader_queue_sends(item: Any) -> Any:
    payload = bytes(ForkingPickler.dumps(item))
    return payload, ForkingPickler.loads(payload)


def test_numbered_indices_are_builtins_and_arrive_whole_setting_the_batch() -> None:
    payload, task = as_a_loader_queue_sends((7, ([5, 3, 9], 41, NUMBERED)))
    assert globals_looked_up(payload) == 0
    reads.set_batch(-1)
    assert unnumbered(task) == (7, [5, 3, 9])
    assert reads.current_batch() == 41  # the worker's reads that follow serve batch 41


def test_torchdatas_task_shape_is_unnumbered_too_and_other_messages_pass_unchanged() -> None:
    reads.set_batch(-1)
    snapshot = {"state": 1}
    assert unnumbered((8, (([1, 2], 42, NUMBERED), snapshot))) == (8, ([1, 2], snapshot))
    assert reads.current_batch() == 42
    for message in (None, (3, [1, 2]), (3, ([1], 43, b"other")), (4, ([1], 44, torch.zeros(3))), (5, ([1], None))):
        assert unnumbered(message) is message
    assert reads.current_batch() == 42


def test_a_tagged_batch_is_builtins_only_and_keeps_the_users_batch() -> None:
    batch = (torch.arange(4), ["a", "b"])
    _, arrived = as_a_loader_queue_sends((3, tagged(12, batch, 999)))
    assert globals_looked_up(bytes(ForkingPickler.dumps((3, tagged(12, [1, 2], 999))))) == 0
    send_index, (_, number, user_batch, handed_over) = arrived
    assert (send_index, number, handed_over) == (3, 12, 999)
    assert torch.equal(user_batch[0], batch[0]) and user_batch[1] == batch[1]


class Kept(transport.Channel):
    """Keeps its events instead of sending them."""

    __slots__ = ()

    def flush(self) -> None:
        pass


def test_only_tagged_batches_are_unwrapped_and_a_users_own_tuples_pass_as_they_are(tmp_path: Path) -> None:
    channel = Kept(transport.Sender(str(tmp_path / "no-agent.sock")), wire.Source("job", 0))
    own = (torch.zeros(2), 12, "x", 999)  # four items, like a tagged batch, but the user's
    items = [tagged(40, "first", 7), own, (b"other", 1, 2, 3), tagged(41, "last")]
    assert list(timed_steps(iter(items), channel)) == ["first", own, (b"other", 1, 2, 3), "last"]
    assert [(row[0], row[4]) for row in channel.steps] == [(40, 7), (41, -1), (42, -1), (41, -1)]


@pytest.mark.parametrize(("workers", "unwrapping", "numbered"), [(2, True, True), (2, False, False), (0, True, False)])
def test_indices_are_sent_numbered_only_to_workers_that_unwrap_them(workers: int, unwrapping: bool,
                                                                    numbered: bool) -> None:
    """A loader whose workers were not started through the view's context (or that has none now) gets its
    indices as the sampler made them: a numbered tuple would reach its dataset as indices."""
    started = _Workers()
    started.unwrap = unwrapping
    served = list(_NumberedBatches([[0, 1], [2, 3]], started if workers else None))
    if numbered:
        assert [indices for indices, _, marker in served if marker == NUMBERED] == [[0, 1], [2, 3]]
        assert served[1][1] == served[0][1] + 1
    else:
        assert served == [[0, 1], [2, 3]]
