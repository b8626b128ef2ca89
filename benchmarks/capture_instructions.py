"""What read capture costs a sample, counted in instructions: a figure these noisy machines cannot move.

The jpeg-files pipeline of `client_overhead.py` in one process, without the DataLoader: each sample a
JPEG opened with `open()` and decoded by PIL, as torchvision's ImageFolder reads it (64 files of ~27 KB),
plain and with read capture on (the process bound as a loader worker, events sent to a real socket
drained by another process). Each side runs under valgrind's callgrind twice, for a few samples and for
many more, and the difference of the two counts is the instructions of the extra samples alone: start-up
and imports cancel. The samples are deterministic to a few instructions once the interpreter's hash seed, the
address space's layout, OpenBLAS's threads (its idle threads spin by the wall clock, which valgrind
slows fiftyfold) and malloc's mmap threshold are fixed: glibc moves the threshold as large blocks are
freed, and whether a decoded image's buffer then comes zeroed from mmap or is cleared on the heap moved
a sample by 68,000 instructions with the order of the files alone. The flush thread's timer is pushed
past the run, so the events are packed as full buffers fill and at the end, in the process and
counted.

Instructions are not time: the capture's code runs with the caches each decode left cold, at fewer
instructions a cycle than the decoder (docs/benchmarks.md). They say where the cost is and whether a
change took any away, in one run, however busy the host. Needs valgrind (and `setarch`); says so and
exits 0 without them.

    PYTHONPATH=. python benchmarks/capture_instructions.py [--samples N]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.client_overhead import DRAIN, jpeg_images

FEW = 64
REPEATS = 3  # the median of three: one invocation in ten counted a side's samples 5 % high, cause unknown
SIDES = ("plain", "captured")


def load(side: str, samples: int, folder: str) -> None:
    """The child: `samples` JPEGs opened and decoded, with capture on for the captured side."""
    import numpy
    from PIL import Image

    from stallwatch.client import capture, reads, transport, wire

    transport.FLUSH_INTERVAL_NS = 10**13  # hours: packed as buffers fill and at the end, in this thread
    transport.configure(os.path.join(folder, "events.sock"))
    reads.bind_worker(wire.Source("bench", rank=0, worker=0))
    reads.set_batch(1)
    if side == "captured":
        capture.start({})
    files = sorted(Path(folder).glob("*.jpg"))
    for index in range(samples):
        with open(str(files[index % len(files)]), "rb") as file:
            numpy.asarray(Image.open(file).convert("RGB"))
    transport.sender().flush_all()


def instructions(side: str, samples: int, folder: str) -> int:
    out = os.path.join(folder, f"callgrind.{side}.{samples}")
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}
    done = subprocess.run(["setarch", "-R", "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                           sys.executable, __file__, "--child", side, str(samples), folder],
                          capture_output=True, text=True, env=env, check=True)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=320, help="samples of the long run (the short has 64)")
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "SAMPLES", "FOLDER"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        side, samples, folder = options.child
        load(side, int(samples), folder)
        return 0
    missing = [tool for tool in ("valgrind", "setarch") if shutil.which(tool) is None]
    if missing:
        print(f"capture_instructions: needs {' and '.join(missing)}; skipped")
        return 0
    with tempfile.TemporaryDirectory() as folder:
        for index, image in enumerate(jpeg_images()):
            Path(folder, f"{index:02d}.jpg").write_bytes(image)
        drain = subprocess.Popen([sys.executable, "-c", DRAIN, os.path.join(folder, "events.sock")],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert drain.stdout is not None and drain.stdout.readline().strip() == "ready"
            extra = options.samples - FEW
            per_sample = {side: statistics.median(
                (instructions(side, options.samples, folder) - instructions(side, FEW, folder)) / extra
                for _ in range(REPEATS)) for side in SIDES}
        finally:
            drain.kill()
            drain.wait()
    added = per_sample["captured"] - per_sample["plain"]
    print(f"instructions a sample (a JPEG opened and decoded), {extra} samples, medians of {REPEATS}: "
          f"plain {per_sample['plain']:,.0f}, captured {per_sample['captured']:,.0f}")
    print(f"capture adds {added:,.0f} instructions a sample: {100 * added / per_sample['plain']:+.2f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
