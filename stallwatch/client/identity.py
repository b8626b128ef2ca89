"""Who is training: job, rank and GPU, from what the launcher put in the environment.

torchrun sets TORCHELASTIC_RUN_ID, RANK, LOCAL_RANK; Slurm sets SLURM_JOB_ID, SLURM_PROCID,
SLURM_LOCALID; STALLWATCH_JOB overrides the job name. The GPU is the physical index the local
rank runs on: the LOCAL_RANK-th entry of CUDA_VISIBLE_DEVICES when that lists indices, the local
rank itself when nothing restricts visibility, and -1 (unknown) when the devices are named by UUID.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from stallwatch.client.wire import Source, job_name


def _first_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return None


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
        job = env.get("STALLWATCH_JOB") or env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "unknown"
    if rank is None:
        rank = _first_int(env, "RANK", "SLURM_PROCID") or 0
    if gpu is None:
        gpu = _gpu(env, _first_int(env, "LOCAL_RANK", "SLURM_LOCALID"))
    return Source(job=job_name(job), rank=max(rank, 0), gpu=max(min(gpu, 32767), -1), worker=worker)
