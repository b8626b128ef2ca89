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

With `--pipeline`, the whole client on the DataLoader pipeline itself, every process counted: the
jpeg-files loader of `client_overhead.py` (2 persistent workers, batches of 64 stacked, the trainer's
step of matrix products), plain and through `instrument` with its workers capturing their reads, for one
epoch of 256 samples and for four; callgrind follows each worker's fork, and the difference of the two
runs' totals over the 768 extra samples is what a sample costs in the trainer and its workers together:
numbering, tagging and handing over batches, the steps, the capture and the sending. The flush thread
wakes on the wall clock, so its interval is stretched by valgrind's slowdown (`VALGRIND_SLOWDOWN`) to
wake as often a sample as at full speed. One count a side: a pipeline's threads make it vary by a few
hundred instructions a sample.

Instructions are not time: the capture's code runs with the caches each decode left cold, at fewer
instructions a cycle than the decoder (docs/benchmarks.md). They say where the cost is and whether a
change took any away, in one run, however busy the host. With `--cache`, valgrind's cachegrind
simulates the caches as well and the figures a sample are its counts: instructions, first-level
instruction-cache misses (the capture's code, evicted by each decode, is fetched again), first-level
and last-level data misses. Needs valgrind (and `setarch`); says so and exits 0 without them.

    PYTHONPATH=. python benchmarks/capture_instructions.py [--samples N] [--pipeline] [--cache]
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

from benchmarks.client_overhead import BATCH, DRAIN, jpeg_images, stack

FEW = 64
REPEATS = 3  # the median of three: one invocation in ten counted a side's samples 5 % high, cause unknown
SIDES = ("plain", "captured")
PIPELINE_SIDES = ("plain", "instrumented")
EPOCH = 256  # samples an epoch of the pipeline: four batches
VALGRIND_SLOWDOWN = 50  # about how much slower a sample runs under callgrind (~0.6 ms natively, ~30 ms there)
ENV = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
       "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}


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


def load_pipeline(side: str, epochs: int, folder: str) -> None:
    """The child of `--pipeline`: `epochs` epochs of the jpeg-files loader, through `instrument` on its side."""
    import numpy
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset

    from stallwatch.client import transport
    from stallwatch.client.torch import instrument

    transport.FLUSH_INTERVAL_NS *= VALGRIND_SLOWDOWN
    transport.configure(os.path.join(folder, "events.sock"))
    files = sorted(str(path) for path in Path(folder).glob("*.jpg"))

    class Files(Dataset[numpy.ndarray]):
        def __len__(self) -> int:
            return EPOCH

        def __getitem__(self, index: int) -> numpy.ndarray:  # torchvision's `pil_loader`, cut to 64 floats
            with open(files[index % len(files)], "rb") as file:
                pixels = numpy.asarray(Image.open(file).convert("RGB"))
            return pixels[::28, ::28].astype(numpy.float32).ravel()[:64] / 255

    loader = DataLoader(Files(), batch_size=BATCH, collate_fn=stack, num_workers=2, persistent_workers=True)
    if side == "instrumented":
        instrument(loader, job="bench", rank=0)
    torch.set_num_threads(1)
    weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(epochs):
        for batch in loader:
            activations = torch.from_numpy(batch)
            for _ in range(40):  # the trainer's step, as in client_overhead.py
                activations = torch.tanh(activations @ weights)
    loader._iterator._shutdown_workers()  # type: ignore[union-attr]


# What `--cache` reports, by cachegrind's event names: each a sum of its events.
CACHE_FIGURES = {"instructions": ("Ir",), "I1 misses": ("I1mr",), "D1 misses": ("D1mr", "D1mw"),
                 "last-level misses": ("ILmr", "DLmr", "DLmw")}


def under_valgrind(tool: list[str], side: str, samples: int, folder: str, pipeline: bool) -> str:
    """Run one child under valgrind's `tool` (its options, each process's output file `<out>.<pid>` in `folder`);
    valgrind's report on stderr."""
    name = tool[0].removeprefix("--tool=")
    out = os.path.join(folder, f"{name}.{side}.{samples}")
    command = ["setarch", "-R", "valgrind", *tool, f"--{name}-out-file={out}.%p", sys.executable, __file__,
               "--child", side, str(samples), folder, *(["--pipeline"] if pipeline else [])]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ENV}, check=True).stderr


def instructions(side: str, samples: int, folder: str, pipeline: bool = False) -> int:
    """The instructions of one child run under callgrind, of every process it forked (each its own file)."""
    stderr = under_valgrind(["--tool=callgrind"], side, samples, folder, pipeline)
    counts = [int(found) for found in re.findall(r"Collected : (\d+)", stderr)]
    if not counts:
        raise RuntimeError(f"callgrind printed no count:\n{stderr[-2000:]}")
    # A forked worker's count starts from its parent's at the fork, the same in the short and the long run.
    return sum(counts)


def cache_counts(side: str, samples: int, folder: str, pipeline: bool = False) -> dict[str, int]:
    """CACHE_FIGURES of one child run under cachegrind with its cache simulation, every process summed."""
    under_valgrind(["--tool=cachegrind", "--cache-sim=yes"], side, samples, folder, pipeline)
    events: dict[str, int] = {}
    for path in Path(folder).glob(f"cachegrind.{side}.{samples}.*"):
        lines = path.read_text().splitlines()
        names = next(line.split()[1:] for line in lines if line.startswith("events:"))
        totals = next(line.split()[1:] for line in lines if line.startswith("summary:"))
        for name, count in zip(names, totals, strict=True):
            events[name] = events.get(name, 0) + int(count)
        path.unlink()
    if not events:
        raise RuntimeError("cachegrind wrote no counts")
    return {figure: sum(events[name] for name in names) for figure, names in CACHE_FIGURES.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=320, help="samples of the long run (the short has 64)")
    parser.add_argument("--pipeline", action="store_true",
                        help="the whole client on the jpeg-files DataLoader pipeline (1 and 4 epochs of 256 samples)")
    parser.add_argument("--cache", action="store_true",
                        help="count with cachegrind's cache simulation: instructions and cache misses a sample")
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "SAMPLES", "FOLDER"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        side, samples, folder = options.child
        (load_pipeline if options.pipeline else load)(side, int(samples), folder)
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
            if options.cache:
                sides, (few, many) = (PIPELINE_SIDES, (1, 4)) if options.pipeline else (SIDES, (FEW, options.samples))
                extra = (many - few) * (EPOCH if options.pipeline else 1)
                counted = {(side, n): cache_counts(side, n, folder, options.pipeline)
                           for side in sides for n in (few, many)}
            elif options.pipeline:
                extra = 3 * EPOCH
                per_sample = {side: (instructions(side, 4, folder, True) - instructions(side, 1, folder, True)) / extra
                              for side in PIPELINE_SIDES}
            else:
                extra = options.samples - FEW
                per_sample = {side: statistics.median(
                    (instructions(side, options.samples, folder) - instructions(side, FEW, folder)) / extra
                    for _ in range(REPEATS)) for side in SIDES}
        finally:
            drain.kill()
            drain.wait()
    if options.cache:
        workload = "of the jpeg-files DataLoader pipeline (the trainer and its 2 workers)" if options.pipeline else (
            "(a JPEG opened and decoded)")
        print(f"cachegrind's counts a sample {workload}, {extra} samples:")
        for figure in CACHE_FIGURES:
            plain, client = ((counted[side, many][figure] - counted[side, few][figure]) / extra for side in sides)
            change = f" ({100 * (client - plain) / plain:+.2f} %)" if plain >= 100 else ""  # none of a handful
            print(f"  {figure}: {sides[0]} {plain:,.1f}, {sides[1]} {client:,.1f}, {client - plain:+,.1f}{change}")
        return 0
    plain, client = per_sample.values()
    if options.pipeline:
        print(f"instructions a sample of the jpeg-files DataLoader pipeline (the trainer and its 2 workers), "
              f"{extra} samples: plain {plain:,.0f}, instrumented with read capture {client:,.0f}")
        print(f"the client adds {client - plain:,.0f} instructions a sample: {100 * (client - plain) / plain:+.2f} %")
    else:
        print(f"instructions a sample (a JPEG opened and decoded), {extra} samples, medians of {REPEATS}: "
              f"plain {plain:,.0f}, captured {client:,.0f}")
        print(f"capture adds {client - plain:,.0f} instructions a sample: {100 * (client - plain) / plain:+.2f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
