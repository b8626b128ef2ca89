"""Run every benchmark once, one after the other, and print what each prints.

    python benchmarks/run_all.py            # the short set: minutes
    python benchmarks/run_all.py --long     # adds the hour-long soak and the long fuzz run

Each benchmark measures its comparisons side by side in one run and prints ratios; this only
sequences them (running them at once would make them measure each other).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

SHORT = [
    ["gpu_check.py"],
    ["scrape.py"],
    ["client_overhead.py"],
    ["capture_overhead.py"],
    ["capture_instructions.py"],  # valgrind only: says so and exits 0 without it
    ["kernel_capture.py"],  # root and bpftrace only: says so and exits 0 without them
    ["correlator_throughput.py"],
    ["flood.py", "--seconds", "20"],
    ["soak.py", "--seconds", "60", "--sample", "5"],
    ["fuzz.py", "--examples", "3000"],
]
LONG = [
    ["soak.py"],
    ["fuzz.py"],
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="also run the hour-long soak and the long fuzz run")
    options = parser.parse_args()
    failed = []
    for command in SHORT + (LONG if options.long else []):
        print(f"\n=== {' '.join(command)}", flush=True)
        started = time.monotonic()
        result = subprocess.run([sys.executable, str(HERE / command[0]), *command[1:]])
        print(f"=== {command[0]}: exit {result.returncode} after {time.monotonic() - started:.0f} s", flush=True)
        if result.returncode != 0:
            failed.append(command[0])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
