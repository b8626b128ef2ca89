"""`stallwatch demo`: a live agent on emulated GPUs, so a newcomer sees real metrics in a minute."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

from stallwatch import catalogue

LISTENING = re.compile(r"listening on (http://\S+?)'")
SHOWN = (catalogue.GPU_UTILIZATION, catalogue.GPU_UTILIZATION_MIN, catalogue.GPU_POWER, catalogue.GPU_IDLE_SECONDS)


def _show(url: str) -> None:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    wanted = tuple(m.name for m in SHOWN)
    for line in text.splitlines():
        if line.startswith(wanted):
            print("  " + line)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallwatch demo", description=__doc__)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds to run (default: %(default)s)")
    parser.add_argument("--listen", default="127.0.0.1:9842", help="agent address (default: %(default)s)")
    options = parser.parse_args(argv)
    agent = subprocess.Popen(
        [sys.executable, "-m", "stallwatch", "agent", "--web.listen-address", options.listen,
         "--gpu.fake-devices", "2", "--gpu.interval", "0.2"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        assert agent.stderr is not None
        url = None
        for line in agent.stderr:
            match = LISTENING.search(line)
            if match:
                url = match.group(1)
                break
        if url is None:
            print("stallwatch demo: the agent did not start", file=sys.stderr)
            return 1
        print(f"stallwatch agent with 2 emulated GPUs: {url}  (try: curl {url})")
        deadline = time.monotonic() + options.duration
        while time.monotonic() < deadline:
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
            print(time.strftime("%H:%M:%S"))
            _show(url)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        agent.terminate()
        agent.wait(timeout=10)
