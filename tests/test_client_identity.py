"""Who the client says is training: job, rank and GPU from each launcher's environment."""

from __future__ import annotations

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


@pytest.mark.parametrize(("env", "gpu"), [
    ({}, -1),
    ({"LOCAL_RANK": "1"}, 1),
    ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,6"}, 6),
    ({"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "GPU-1f2a"}, -1),
])
def test_the_gpu_is_the_physical_index_of_the_local_rank(env: dict[str, str], gpu: int) -> None:
    assert source_from_environment(env=env).gpu == gpu
