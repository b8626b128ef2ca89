"""Real frameworks, 2 CPU ranks each: plain DDP under torchrun and PyTorch Lightning's DDP strategy.

Each run writes the sample ids every rank trained on. With stallwatch the ranks must read exactly
the shards they read without it, and each rank's loader waits and reads must reach a real agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stallwatch.harness import AgentProcess, scrape, wait_for
from tests.conftest import ROOT

pytestmark = pytest.mark.slow
SAMPLES, EPOCHS, BATCH = 64, 2, 4
SAMPLE_BYTES = 2240  # examples/sample_files.py: one read with the data, one empty read at the end


def run(command: list[str], tmp_path: Path, socket: str, **env: str) -> dict[int, list[int]]:
    """Run a 2-rank training script; the ids each rank trained on."""
    ids = tmp_path / f"ids-{len(list(tmp_path.glob('ids-*')))}"
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("STALLWATCH_", "SLURM_", "TORCHELASTIC_"))}
    result = subprocess.run(
        [*command, "--data", str(tmp_path / "data"), "--samples", str(SAMPLES), "--epochs", str(EPOCHS),
         "--ids-out", str(ids)],
        env={**clean, "PYTHONPATH": str(ROOT), "STALLWATCH_SOCKET": socket, **env},
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {rank: json.loads((ids / f"rank-{rank}.json").read_text()) for rank in (0, 1)}


def assert_each_rank_read_its_own_shard(served: dict[int, list[int]]) -> None:
    per_epoch = SAMPLES // 2
    for epoch in range(EPOCHS):
        shards = [set(served[rank][epoch * per_epoch:(epoch + 1) * per_epoch]) for rank in (0, 1)]
        assert len(served[0]) == len(served[1]) == EPOCHS * per_epoch
        assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == set(range(SAMPLES))


def assert_the_agent_saw_every_rank(agent: AgentProcess, job: str, served: dict[int, list[int]]) -> None:
    def labels(rank: int, **extra: str) -> tuple[tuple[str, str], ...]:
        return tuple(sorted({"training_job": job, "rank": str(rank), **extra}.items()))

    def arrived() -> bool:
        metrics = scrape(agent.url)
        return all(
            metrics.get(("stallwatch_loader_wait_seconds_count", labels(rank))) == len(ids) // BATCH
            and metrics.get(("stallwatch_dataset_read_bytes_total", labels(rank))) == SAMPLE_BYTES * len(ids)
            for rank, ids in served.items()
        )

    wait_for(f"every rank's steps and reads of {job} at the agent", arrived, 30, agent.process, agent.log)
    metrics = scrape(agent.url)
    for rank, ids in served.items():
        # One read of each sample's file (under 4 KiB) with its bytes. The empty read that ends it is an event
        # only when it took 1 ms or more (EMPTY_READ_NS): on a busy machine a few are preempted that long.
        reads = metrics[("stallwatch_dataset_reads_total", labels(rank, verdict="unknown"))]
        assert len(ids) <= reads <= 2 * len(ids), (rank, reads)  # at most the data read and the empty one
        assert metrics[("stallwatch_step_compute_seconds_count", labels(rank))] == len(ids) // BATCH


@pytest.fixture
def agent(agent_factory: Callable[..., AgentProcess], tmp_path: Path) -> tuple[AgentProcess, str]:
    socket = str(Path(os.path.realpath(tmp_path)) / "events.sock")
    return agent_factory("--no-collector.gpu", "--events.socket", socket), socket


def test_plain_ddp_under_torchrun(agent: tuple[AgentProcess, str], tmp_path: Path) -> None:
    process, socket = agent

    def torchrun(run_id: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-id", run_id,
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "examples/ddp_torchrun.py"]

    # The dataset records its reads either way (open_recorded): the plain run counts under its own run id.
    without = run([*torchrun("ddp-plain"), "--no-stallwatch"], tmp_path, socket)
    assert_each_rank_read_its_own_shard(without)
    with_stallwatch = run(torchrun("ddp-run-1"), tmp_path, socket)
    assert with_stallwatch == without
    assert_the_agent_saw_every_rank(process, "ddp-run-1", with_stallwatch)  # the job is torchrun's run id


def test_lightning_ddp_keeps_injecting_its_distributed_sampler(agent: tuple[AgentProcess, str], tmp_path: Path) -> None:
    process, socket = agent
    script = [sys.executable, "examples/lightning_ddp.py"]
    without = run([*script, "--stallwatch", "off"], tmp_path, socket)
    assert_each_rank_read_its_own_shard(without)
    for mode in ("callback", "instrument"):
        served = run([*script, "--stallwatch", mode], tmp_path, socket, STALLWATCH_JOB=f"lightning-{mode}")
        assert served == without, mode
        assert_the_agent_saw_every_rank(process, f"lightning-{mode}", served)
