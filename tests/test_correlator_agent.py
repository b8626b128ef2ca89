"""The correlator inside a real agent process: on by default, fed by the gpu collector's batches."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from stallwatch.harness import AgentProcess, stop_agent
from tests.conftest import ROOT


def test_agent_feeds_gpu_batches_to_the_correlator_and_serves_its_metrics(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    events = tmp_path / "events.bin"
    agent = agent_factory(
        "--gpu.fake-devices", "2", "--gpu.interval", "0.1", "--no-collector.host",
        "--correlator.window", "0.5", "--correlator.lateness", "0.2", "--correlator.record-events", str(events),
    )
    windows, deadline = 0.0, time.monotonic() + 30
    while windows < 3 and time.monotonic() < deadline:
        time.sleep(0.3)
        text = urllib.request.urlopen(agent.url, timeout=5).read().decode()
        match = re.search(r"^stallwatch_correlator_windows_total (\S+)$", text, re.MULTILINE)
        windows = float(match.group(1)) if match else 0.0
    assert windows >= 3
    assert 'stallwatch_scrape_collector_success{collector="correlator"} 1.0' in text
    stop_agent(agent)  # the event file is complete once the agent has stopped
    # The batches the agent saw went to the event file, gpu_util ones included.
    done = subprocess.run([sys.executable, "-m", "stallwatch", "correlate", str(events)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.count("\n") >= 1
