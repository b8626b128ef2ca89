"""Starting the demo's node agents: one per emulated node, each with its own socket, port and spoke."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from stallwatch.demo.processes import stop_process

LISTENING = re.compile(r"listening on (http://\S+?)'")


@dataclass(frozen=True)
class AgentSetup:
    """What one node's agent watches: its fake GPUs, its events socket, its nginx spoke and that spoke's hub."""

    workdir: Path
    spoke_log: Path
    spoke_name: str
    hub_url: str
    cache_bytes: int
    window_seconds: float
    gpus: int = 1
    lateness_seconds: float | None = None  # None: the agent's default

    @property
    def socket(self) -> Path:
        return self.workdir / "events.sock"

    @property
    def trace(self) -> Path:
        return self.workdir / "gpu.trace"

    @property
    def windows(self) -> Path:
        return self.workdir / "windows.jsonl"

    def command(self) -> list[str]:
        lateness = [] if self.lateness_seconds is None else ["--correlator.lateness", str(self.lateness_seconds)]
        return [
            sys.executable, "-m", "stallwatch", "agent", "--web.listen-address", "127.0.0.1:0",
            "--gpu.fake-devices", str(self.gpus), "--gpu.fake-trace", str(self.trace), "--gpu.interval", "0.5",
            "--events.socket", str(self.socket),
            "--collector.spoke_nginx", "--spoke_nginx.log", str(self.spoke_log), "--spoke_nginx.name", self.spoke_name,
            "--collector.hub_probe", "--hub_probe.target", f"{self.spoke_name}={self.hub_url}/",
            "--hub_probe.interval", "2",
            "--correlator.cache-capacity", str(self.cache_bytes),
            "--correlator.window", str(self.window_seconds), *lateness,
            "--correlator.record-windows", str(self.windows),
        ]


def start_agent(stack: contextlib.ExitStack, setup: AgentSetup) -> str:
    """Start the agent (stopped when `stack` closes); its metrics URL once it listens."""
    setup.workdir.mkdir(parents=True, exist_ok=True)
    log_path = setup.workdir / "agent.log"
    with log_path.open("w") as log:
        agent = subprocess.Popen(setup.command(), stdout=log, stderr=subprocess.STDOUT, text=True)
    stack.callback(stop_process, agent)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        match = LISTENING.search(log_path.read_text())
        if match:
            return match.group(1)
        if agent.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"the agent did not start:\n{log_path.read_text()[-2000:]}")
