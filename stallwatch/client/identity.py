"""Who is training: job, rank and GPU, from what the launcher put in the environment.

The job name, first found wins (`JOB_SOURCES`): STALLWATCH_JOB; the Kubernetes object that owns
the pod (STALLWATCH_POD_OWNER, which the pod spec fills from the owner's label through the downward
API, prefixed by STALLWATCH_POD_NAMESPACE when given); Slurm's SLURM_JOB_ID; torchrun's
TORCHELASTIC_RUN_ID, except its default "none". Schedulers come before torchrun because their job
is what operators look up, while torchrun's run id is often a per-launch random id (`--standalone`).
Rank: RANK (torchrun), else the rank of an initialized torch.distributed process group (launchers
that set no RANK: Lightning's own, `torch.multiprocessing.spawn`), else SLURM_PROCID.

The GPU is sent by its UUID, which names one physical device on the node whatever a container sees:
from torch.cuda when the process uses CUDA, else from CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES
when they name devices (`GPU-...`, `MIG-...`); the agent maps it to its NVML index. Beside it goes
the local index resolved through those lists (a container's `0` is not the node's GPU 0 when the
runtime's list says `5`), the last resort for an agent that cannot map the UUID.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from stallwatch.client import wire
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


# Where a container runtime or the user restricts which GPUs a process sees, innermost first: CUDA's
# own list selects among what the NVIDIA container runtime's list exposed. Entries are indices into the
# next list out (into the node's GPUs at the last), or UUIDs (`GPU-...`) and MIG ids (`MIG-...`).
VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
_NAMED = ("GPU-", "MIG-")


def _visible(env: Mapping[str, str], name: str) -> list[str] | None:
    value = env.get(name)
    if value is None or (name == "NVIDIA_VISIBLE_DEVICES" and value.strip().lower() == "all"):
        return None  # no restriction at this level
    return [device.strip() for device in value.split(",") if device.strip()]


def _gpu_from_environment(env: Mapping[str, str], ordinal: int) -> tuple[int, str]:
    """(node index or -1, UUID or "") of the process's `ordinal`-th visible GPU."""
    for name in VISIBLE_DEVICES:
        devices = _visible(env, name)
        if devices is None:
            continue
        entry = devices[ordinal] if 0 <= ordinal < len(devices) else ""
        if entry.isdigit():
            ordinal = int(entry)
            continue
        return -1, entry if entry.startswith(_NAMED) else ""  # named, or "none"/"void"/out of range
    return ordinal, ""


def _gpu_uuid_from_torch(ordinal: int) -> str:
    """The UUID CUDA reports for the device, when this process already uses CUDA (never initialise it here:
    in a forked loader worker that would fail)."""
    cuda: Any = sys.modules.get("torch.cuda")
    try:
        if cuda is None or not cuda.is_initialized():
            return ""
        device = ordinal if 0 <= ordinal < cuda.device_count() else cuda.current_device()
        uuid = str(cuda.get_device_properties(device).uuid)
    except Exception:  # an odd build or driver: the environment still says what it can
        return ""
    return uuid if uuid.startswith(_NAMED) else f"GPU-{uuid}"


def _sendable(uuid: str) -> str:
    """The UUID if the agent accepts it as a source attribute, else nothing (never a rejected batch)."""
    fits = len(uuid) + len(wire.GPU_UUID) + 1 <= wire.MAX_JOB_NAME
    return uuid if fits and uuid.isprintable() else ""


def gpu_identity(env: Mapping[str, str], gpu: int | str | None) -> tuple[int, str]:
    """(node index or -1, UUID or "") of this process's GPU.

    `gpu` is the CUDA device index the process trains on (as torch numbers them), or its UUID; by
    default the local rank's device. The UUID comes from torch.cuda when the process uses CUDA, else
    from the visible-device lists when they name devices; the index is the local one resolved through
    those lists, the last resort when no UUID is known.
    """
    if isinstance(gpu, str):
        return -1, _sendable(gpu.strip())
    ordinal = gpu if gpu is not None else _first_int(env, "LOCAL_RANK", "SLURM_LOCALID")
    if ordinal is None and not any(name in env for name in VISIBLE_DEVICES):
        return -1, _gpu_uuid_from_torch(-1)
    index, named = _gpu_from_environment(env, ordinal or 0)
    from_torch = _gpu_uuid_from_torch(ordinal or 0)
    # CUDA reports a MIG device's UUID without saying it is one: the runtime's MIG id is the name NVML knows.
    uuid = named if named.startswith("MIG-") or not from_torch else from_torch
    return max(min(index, 32767), -1), _sendable(uuid)


def source_from_environment(
    job: str | None = None,
    rank: int | None = None,
    gpu: int | str | None = None,
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
    index, uuid = gpu_identity(env, gpu)
    return Source(job=job_name(job), rank=max(rank, 0), gpu=index, worker=worker, gpu_uuid=uuid)
