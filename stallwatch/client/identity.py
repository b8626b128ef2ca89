"""Who is training: job, rank and GPU, from what the launcher put in the environment.

The job name, first found wins (`JOB_SOURCES`): STALLWATCH_JOB; the Kubernetes object that owns
the pod (STALLWATCH_POD_OWNER, which the pod spec fills from the owner's label through the downward
API, prefixed by STALLWATCH_POD_NAMESPACE when given); Slurm's SLURM_JOB_ID; torchrun's
TORCHELASTIC_RUN_ID, except its default "none". Schedulers come before torchrun because their job
is what operators look up, while torchrun's run id is often a per-launch random id (`--standalone`).
Rank: RANK (torchrun), else the rank of an initialized torch.distributed process group (launchers
that set no RANK: Lightning's own, `torch.multiprocessing.spawn`), else SLURM_PROCID. The GPU is
the physical index the local rank runs on: the LOCAL_RANK-th entry of CUDA_VISIBLE_DEVICES when
that lists indices, the local rank itself when nothing restricts visibility, and -1 (unknown) when
the devices are named by UUID.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from stallwatch.client.wire import Source, job_name


def _first_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return None


# torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID to this: a launcher default, never a job's name.
TORCHRUN_DEFAULT_RUN_ID = "none"


def _kubernetes_owner(env: Mapping[str, str]) -> str | None:
    owner = env.get("STALLWATCH_POD_OWNER", "").strip()
    if not owner:
        return None
    namespace = env.get("STALLWATCH_POD_NAMESPACE", "").strip()
    return f"{namespace}/{owner}" if namespace else owner


def _torchrun_run_id(env: Mapping[str, str]) -> str | None:
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    return run_id if run_id and run_id != TORCHRUN_DEFAULT_RUN_ID else None


JOB_SOURCES: tuple[Callable[[Mapping[str, str]], str | None], ...] = (
    lambda env: env.get("STALLWATCH_JOB", "").strip() or None,
    _kubernetes_owner,
    lambda env: env.get("SLURM_JOB_ID", "").strip() or None,
    _torchrun_run_id,
)


def job_from_environment(env: Mapping[str, str] = os.environ) -> str:
    return next((name for name in (source(env) for source in JOB_SOURCES) if name), "unknown")


def _process_group_rank() -> int | None:
    distributed: Any = sys.modules.get("torch.distributed")  # never imported here: the client runs without torch
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return None
    return int(distributed.get_rank())


def _gpu(env: Mapping[str, str], local_rank: int | None) -> int:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return -1 if local_rank is None else local_rank
    devices = [device.strip() for device in visible.split(",") if device.strip()]
    if not devices or not all(device.isdigit() for device in devices):
        return -1
    index = 0 if local_rank is None else local_rank
    return int(devices[index]) if 0 <= index < len(devices) else -1


def source_from_environment(
    job: str | None = None,
    rank: int | None = None,
    gpu: int | None = None,
    worker: int = -1,
    env: Mapping[str, str] = os.environ,
) -> Source:
    """Explicit arguments win; the environment fills in the rest."""
    if job is None:
        job = job_from_environment(env)
    if rank is None:
        rank = _first_int(env, "RANK")
        if rank is None:
            rank = _process_group_rank()
        if rank is None:
            rank = _first_int(env, "SLURM_PROCID") or 0
    if gpu is None:
        gpu = _gpu(env, _first_int(env, "LOCAL_RANK", "SLURM_LOCALID"))
    return Source(job=job_name(job), rank=max(rank, 0), gpu=max(min(gpu, 32767), -1), worker=worker)
