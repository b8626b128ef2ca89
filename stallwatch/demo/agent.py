"""Starting the demo's node agents: one per emulated node, each with its own socket, port and spoke."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from stallwatch.harness import AgentProcess, start_agent, stop_agent


@dataclass(frozen=True)
class AgentSetup:
    """What one node's agent watches: its fake GPUs, its events socket, its spoke (nginx, or a JuiceFS mount) and
    that spoke's hub."""

    workdir: Path
    spoke_log: Path | None  # the nginx spoke's access log; None when the spoke is `juicefs_mount`
    spoke_name: str
    hub_url: str
    cache_bytes: int
    window_seconds: float
    gpus: int = 1
    lateness_seconds: float | None = None  # None: the agent's default
    juicefs_mount: Path | None = None
    dataset_bytes: int | None = None  # for the warm-up forecast; None: it learns the working set from reuse

    @property
    def socket(self) -> Path:
        return self.workdir / "events.sock"

    @property
    def trace(self) -> Path:
        return self.workdir / "gpu.trace"

    @property
    def windows(self) -> Path:
        return self.workdir / "windows.jsonl"

    def flags(self) -> list[str]:
        lateness = [] if self.lateness_seconds is None else ["--correlator.lateness", str(self.lateness_seconds)]
        dataset = [] if self.dataset_bytes is None else ["--correlator.dataset-size", str(self.dataset_bytes)]
        spoke = (["--collector.spoke_juicefs", "--spoke_juicefs.mount", str(self.juicefs_mount),
                  "--spoke_juicefs.name", self.spoke_name] if self.juicefs_mount is not None else
                 ["--collector.spoke_nginx", "--spoke_nginx.log", str(self.spoke_log), "--spoke_nginx.name",
                  self.spoke_name])
        return [
            "--gpu.fake-devices", str(self.gpus), "--gpu.fake-trace", str(self.trace), "--gpu.interval", "0.5",
            "--events.socket", str(self.socket), *spoke,
            "--collector.hub_probe", "--hub_probe.target", f"{self.spoke_name}={self.hub_url}/",
            "--hub_probe.interval", "2",
            "--correlator.cache-capacity", str(self.cache_bytes),
            "--correlator.window", str(self.window_seconds), *lateness, *dataset,
            "--correlator.record-windows", str(self.windows),
        ]


def start_node_agent(stack: contextlib.ExitStack, setup: AgentSetup) -> AgentProcess:
    """Start the node's agent (stopped when `stack` closes), once it listens."""
    setup.workdir.mkdir(parents=True, exist_ok=True)
    agent = start_agent(setup.flags(), setup.workdir / "agent.log", timeout=30)
    stack.callback(stop_agent, agent)
    return agent
