"""Who the client says is training: job, rank and GPU from each launcher's environment."""

from __future__ import annotations

import sys
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from stallwatch.client import wire
from stallwatch.client.identity import source_from_environment

TORCHRUN = {"TORCHELASTIC_RUN_ID": "run-7", "RANK": "3", "LOCAL_RANK": "1"}
SLURM = {"SLURM_JOB_ID": "991", "SLURM_PROCID": "9", "SLURM_LOCALID": "0"}
KUBERNETES = {"STALLWATCH_POD_OWNER": "llama-pretrain", "STALLWATCH_POD_NAMESPACE": "research"}


@pytest.mark.parametrize(("env", "job"), [
    ({}, "unknown"),
    (TORCHRUN, "run-7"),
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}, "unknown"),  # torchrun without --rdzv-id
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none", **SLURM}, "991"),
    ({**TORCHRUN, **SLURM}, "991"),  # the scheduler's job, not the launch's rendezvous id
    ({**TORCHRUN, **SLURM, **KUBERNETES}, "research/llama-pretrain"),
    ({**TORCHRUN, "STALLWATCH_POD_OWNER": "llama-pretrain"}, "llama-pretrain"),
    ({**TORCHRUN, "STALLWATCH_POD_OWNER": " ", "STALLWATCH_POD_NAMESPACE": "research"}, "run-7"),
    ({**TORCHRUN, **SLURM, **KUBERNETES, "STALLWATCH_JOB": "mine"}, "mine"),
    ({"STALLWATCH_JOB": "tab\there" + "x" * 200}, "tab_here" + "x" * 120),
])
def test_the_job_is_the_most_specific_name_the_environment_gives(env: dict[str, str], job: str) -> None:
    assert source_from_environment(env=env).job == job


@pytest.mark.parametrize(("env", "rank"), [({}, 0), (TORCHRUN, 3), (SLURM, 9), ({**SLURM, **TORCHRUN}, 3),
                                           ({"RANK": "junk"}, 0)])
def test_the_rank_comes_from_torchrun_or_slurm(env: dict[str, str], rank: int) -> None:
    assert source_from_environment(env=env).rank == rank


def test_explicit_arguments_win() -> None:
    env = {**TORCHRUN, **SLURM, **KUBERNETES, "STALLWATCH_JOB": "env"}
    assert source_from_environment(job="given", rank=4, gpu=2, env=env) == wire.Source("given", 4, 2)


NODE = [f"GPU-{index:08x}-1111-4222-8333-944445555666" for index in range(8)]  # a node of eight GPUs
MIG = "MIG-0d5e7c2a-aaaa-4bbb-8ccc-dddddddddddd"


@pytest.mark.parametrize(("env", "gpu"), [
    ({}, (-1, "")),
    ({"LOCAL_RANK": "1"}, (1, "")),  # nothing says more: the local index, the last resort
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}, (6, "")),
    ({"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": NODE[3]}, (-1, NODE[3])),
    # A pod that sees one GPU of eight: the device plugin names it; the container calls it 0.
    ({"LOCAL_RANK": "0", "NVIDIA_VISIBLE_DEVICES": NODE[5]}, (-1, NODE[5])),
    ({"LOCAL_RANK": "1", "NVIDIA_VISIBLE_DEVICES": f"{NODE[2]},{NODE[7]}"}, (-1, NODE[7])),
    ({"LOCAL_RANK": "1", "NVIDIA_VISIBLE_DEVICES": "3,5"}, (5, "")),  # the runtime's indices are the node's
    ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": "3,5"}, (5, "")),
    ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "1", "NVIDIA_VISIBLE_DEVICES": f"{NODE[2]},{NODE[6]}"},
     (-1, NODE[6])),
    ({"LOCAL_RANK": "1", "NVIDIA_VISIBLE_DEVICES": "all"}, (1, "")),
    ({"LOCAL_RANK": "0", "NVIDIA_VISIBLE_DEVICES": "void"}, (-1, "")),
    ({"LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, (-1, "")),  # a rank beyond what it sees
    ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": MIG}, (-1, MIG)),
    ({"CUDA_VISIBLE_DEVICES": "GPU-" + "f" * 200}, (-1, "")),  # too long to send: never a rejected batch
])
def test_the_gpu_is_named_by_uuid_when_the_environment_names_it(env: dict[str, str], gpu: tuple[int, str]) -> None:
    source = source_from_environment(env=env)
    assert (source.gpu, source.gpu_uuid) == gpu


def test_an_explicit_gpu_is_a_device_index_or_a_uuid() -> None:
    env = {"LOCAL_RANK": "0", "NVIDIA_VISIBLE_DEVICES": f"{NODE[4]},{NODE[1]}"}
    assert source_from_environment(gpu=1, env=env).gpu_uuid == NODE[1]
    assert source_from_environment(gpu=NODE[6], env=env).gpu_uuid == NODE[6]


class FakeCuda:
    """torch.cuda as a process that already trains on GPUs sees it (the only GPU part faked here)."""

    def __init__(self, uuids: list[str], initialized: bool = True) -> None:
        self.uuids, self.initialized = uuids, initialized

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.uuids)

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device: int) -> Any:
        return SimpleNamespace(uuid=uuid.UUID(self.uuids[device].removeprefix("GPU-")))


def test_a_process_using_cuda_names_its_gpu_as_cuda_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.cuda", FakeCuda([NODE[2], NODE[3]]))
    assert source_from_environment(env={"LOCAL_RANK": "1"}).gpu_uuid == NODE[3]
    assert source_from_environment(env={}).gpu_uuid == NODE[2]  # no local rank: the current device
    # CUDA cannot tell a MIG device's UUID from a GPU's: the runtime's MIG id is the one NVML knows.
    assert source_from_environment(env={"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": MIG}).gpu_uuid == MIG


def test_cuda_is_never_initialised_by_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda([NODE[2]], initialized=False)
    monkeypatch.setitem(sys.modules, "torch.cuda", cuda)
    assert source_from_environment(env={"LOCAL_RANK": "0"}).gpu_uuid == ""
