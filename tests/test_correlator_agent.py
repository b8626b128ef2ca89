"""The correlator inside a real agent process: on by default, fed by the gpu collector's batches."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"listening on (http://\S+?)(?:'|$)", re.MULTILINE)


def test_agent_feeds_gpu_batches_to_the_correlator_and_serves_its_metrics(tmp_path: Path) -> None:
    events = tmp_path / "events.bin"
    agent = subprocess.Popen(
        [sys.executable, "-m", "stallwatch", "agent", "--web.listen-address", "127.0.0.1:0",
         "--gpu.fake-devices", "2", "--gpu.interval", "0.1", "--no-collector.host",
         "--correlator.window", "0.5", "--correlator.lateness", "0.2", "--correlator.record-events", str(events)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert agent.stderr is not None
        url, seen = None, ""
        deadline = time.monotonic() + 30
        while url is None and time.monotonic() < deadline:
            seen += agent.stderr.readline()
            found = LISTENING.search(seen)
            url = found.group(1) if found else None
        assert url is not None, seen
        windows = 0.0
        while windows < 3 and time.monotonic() < deadline:
            time.sleep(0.3)
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            match = re.search(r"^stallwatch_correlator_windows_total (\S+)$", text, re.MULTILINE)
            windows = float(match.group(1)) if match else 0.0
        assert windows >= 3
        assert 'stallwatch_scrape_collector_success{collector="correlator"} 1.0' in text
    finally:
        agent.terminate()
        agent.wait(timeout=10)
    # The batches the agent saw went to the event file, gpu_util ones included.
    done = subprocess.run([sys.executable, "-m", "stallwatch", "correlate", str(events)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.count("\n") >= 1
