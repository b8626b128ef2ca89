"""The fuzz targets of tests/test_fuzz.py with a larger budget (CI runs 200 examples per target).

    PYTHONPATH=. .venv/bin/python benchmarks/fuzz.py [--examples 20000]

Runs the same test file under pytest with `STALLWATCH_FUZZ_EXAMPLES` raised, and hypothesis's statistics
(examples run, time per example, the slowest) so a hang or a slow path shows in the report.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20_000, help="examples per target (default: %(default)s)")
    args = parser.parse_args()
    env = dict(os.environ, STALLWATCH_FUZZ_EXAMPLES=str(args.examples))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics",
               str(ROOT / "tests" / "test_fuzz.py")]
    return subprocess.run(command, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
