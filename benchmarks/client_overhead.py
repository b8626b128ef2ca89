"""What the training client costs, measured side by side in one run.

1. Per event: a bare loop over a list, the same loop through `monitor()` (one step event each:
   two clock reads, the append, and the amortised pack and send of its batch), the recording
   call alone (append + amortised pack + send), one prometheus_client `Histogram.observe`, and
   `keys.read_key` (paid once per dataset read). Batches go to a real receiving socket drained by
   another process, as the agent would.
2. Throughput of a real DataLoader pipeline (2 persistent workers, a fixed CPU cost a sample and
   a batch, one recorded read a sample), plain and through `stallwatch.client.torch.instrument`,
   with three kinds of sample work (`--decode`): small matrix products (light, so the client's share
   shows), a real JPEG decoded with Pillow, and the same JPEGs read from files with `open()` as
   torchvision's ImageFolder reads them (`jpeg-files`: no recorded read in either loader, the
   instrumented one's captured as `stallwatch run` captures them). Several runs (`--runs`), each a fresh process
   (`pipeline_runs`) of many short rounds of four epochs (ABBA / BAAB, `round_order`) after discarded
   warm-up rounds, both loaders built anew every few rounds (`pipeline_rounds`). Each run gives the
   median of its rounds' changes in throughput (samples/s) and in CPU time a sample (the trainer's
   and its workers'); the figure is the median of the runs' medians, printed with its bootstrap 95 %
   confidence interval over the runs, beside each run's, and beside the pooled rounds' median with its
   own interval and spread. Throughput is what training sees; CPU time is what the client adds, and is
   less disturbed by the other tenants of a shared machine. `--control` compares the plain loader with
   a second plain one: the noise of the method itself, which should centre on 0. The throughput target
   (±0.5 %) is judged on the pipeline with real decoding; for the light synthetic one the benchmark
   prints the client's CPU a batch and the batch size in CPU from which it holds.

    PYTHONPATH=. python benchmarks/client_overhead.py [--events N] [--decode matmul|jpeg|jpeg-files|both] [--runs N]
        [--rounds R] [--samples S] [--rebuild-every K] [--warmup W] [--control]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy
import psutil
from prometheus_client import CollectorRegistry, Histogram

from stallwatch.client import ReadSpan, transport, wire
from stallwatch.client.keys import read_key
from stallwatch.client.loop import Monitored

DRAIN = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    s.recv(1 << 18)
"""


def best_per_item(run: Callable[[list[int]], None], events: int, repeats: int = 7) -> float:
    """Nanoseconds per item, best of `repeats` (the least disturbed by the other tenants of the CPU).

    Items are fed in chunks of 8 batches with an untimed pause after each, so the draining process
    keeps up as an agent would at any sustainable rate (the kernel queues only ten datagrams here);
    flat out, the client would outrun the drain and drop batches, which costs no less to try.
    """
    chunk = list(range(8 * wire.MAX_EVENTS))
    timings = []
    for _ in range(repeats):
        elapsed = 0
        for _ in range(events // len(chunk)):
            start = time.perf_counter_ns()
            run(chunk)
            elapsed += time.perf_counter_ns() - start
            time.sleep(0.005)
        timings.append(elapsed / (events // len(chunk) * len(chunk)))
    return min(timings)


def paired_ratios(run: Callable[[list[int]], None], against: Callable[[list[int]], None], events: int,
                  rounds: int = 41) -> list[float]:
    """Per round, the time of `run` over `events` items divided by that of `against` over as many, the two
    timed one after the other (in alternating order), so that both meet the same moment of the machine: a
    ratio of two best-of-7 figures moved by a tenth from one run to the next on this 2-core machine."""
    chunk = list(range(8 * wire.MAX_EVENTS))
    ratios = []
    for round_number in range(rounds):
        elapsed = {run: 0, against: 0}
        for side in (run, against) if round_number % 2 == 0 else (against, run):
            for _ in range(max(1, events // len(chunk))):
                start = time.perf_counter_ns()
                side(chunk)
                elapsed[side] += time.perf_counter_ns() - start
                time.sleep(0.005)
        ratios.append(elapsed[run] / elapsed[against])
    return ratios


class FailedFlushes(logging.Handler):
    """Counts the flushes the transport logged as failed (it carries on; a batch that fails to pack is
    also counted as dropped): a cost measured with such batches would be the cost of failing."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def per_event(events: int) -> dict[str, Any]:
    channel = transport.sender().channel(wire.Source("bench", 0))
    failures = FailedFlushes()
    transport.log.addHandler(failures)
    transport.log.setLevel(logging.DEBUG)

    def bare(items: list[int]) -> None:
        for _ in items:
            pass

    def monitored(items: list[int]) -> None:
        for _ in Monitored(items, channel):
            pass

    def recorded(items: list[int]) -> None:
        step = channel.step
        for index in items:
            step((index, 1, 2, 3, 4))
        channel.flush()

    histogram = Histogram("bench_seconds", "benchmark", registry=CollectorRegistry())

    def observed(items: list[int]) -> None:
        observe = histogram.observe
        for _ in items:
            observe(0.01)

    def keyed(items: list[int]) -> None:
        for index in items:
            read_key("/datasets/imagenet/train/shard-000123.tar", index)

    timings = {
        "bare loop": best_per_item(bare, events),
        "loop through monitor()": best_per_item(monitored, events),
        "record one event (append + pack + send)": best_per_item(recorded, events),
        "Histogram.observe": best_per_item(observed, events),
        "read_key (per dataset read)": best_per_item(keyed, events),
    }
    results: dict[str, float | Spread] = {
        **timings, "monitor() overhead per step": timings["loop through monitor()"] - timings["bare loop"]}
    results["record / observe, paired rounds"] = spread(paired_ratios(recorded, observed, events // 10))
    results["events dropped (must be 0)"] = channel.dropped_total
    results["flushes failed (must be 0)"] = failures.count
    transport.log.removeHandler(failures)
    return results


def per_batch(batches: int = 2000, size: int = 64) -> tuple[float, float]:
    """CPU µs a batch through a DataLoader without workers, plain and instrumented, best of 7: what
    `instrument` adds to each batch (numbering, the tagged collate, the step), free of worker noise."""
    from torch.utils.data import DataLoader, Dataset

    from stallwatch.client.torch import instrument

    class Indices(Dataset[int]):
        def __len__(self) -> int:
            return batches * size

        def __getitem__(self, index: int) -> int:
            return index

    def cost(loader: DataLoader[int]) -> float:
        start = time.process_time()
        for _ in loader:
            pass
        return (time.process_time() - start) / batches * 1e6

    def unchanged(samples: list[int]) -> list[int]:
        return samples

    plain = DataLoader(Indices(), batch_size=size, collate_fn=unchanged)
    instrumented = instrument(DataLoader(Indices(), batch_size=size, collate_fn=unchanged), job="bench", rank=0)
    plain_costs, instrumented_costs = [], []
    for _ in range(7):
        plain_costs.append(cost(plain))
        instrumented_costs.append(cost(instrumented))
    return min(plain_costs), min(instrumented_costs)


def pickling_cost(size: int = 64) -> float:
    """µs more than a plain list that a batch's numbered indices cost on their way to a worker."""
    from stallwatch.client.torch import _NumberedBatches, _Workers, unnumbered

    def best(task: tuple[int, Any], unwrap: Callable[[Any], Any]) -> float:
        timings = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(5000):
                unwrap(pickle.loads(pickle.dumps(task)))
            timings.append((time.perf_counter() - start) / 5000 * 1e6)
        return min(timings)

    started = _Workers()
    started.unwrap = True  # as the loader sends them to workers started through its view's context
    numbered = next(iter(_NumberedBatches([list(range(size))], started)))
    return best((7, numbered), unnumbered) - best((7, list(range(size))), lambda task: task)


class Epoch(NamedTuple):
    seconds: float  # wall clock: what training sees, and what other tenants of the CPU disturb most
    cpu_seconds: float  # the trainer's and its workers': what the client adds to
    trainer_cpu_seconds: float  # the trainer's part of it (this process's, its queue threads included)
    step_seconds: float  # wall clock in the training steps; the rest of `seconds` is waiting in `next()`
    main_thread_cpu_seconds: float  # the trainer's main thread's; the rest of the trainer's is its other
    # threads' (the index queues' feeder threads, which pickle each batch's indices, and the flush thread)


class Round(NamedTuple):
    """The change, in %, from plain to instrumented across one round of four epochs (`round_order`)."""

    throughput: float  # samples/s: the plain epochs' time over the instrumented epochs'
    cpu_per_sample: float  # the instrumented epochs' CPU time over the plain epochs'


class Run(NamedTuple):
    """One process's rounds, and its measured epochs of each side."""

    rounds: list[Round]
    plain: list[Epoch]
    compared: list[Epoch]  # instrumented, or the second plain loader of `--control`


PLAIN, INSTRUMENTED = 0, 1
THROUGHPUT, CPU_PER_SAMPLE = 0, 1  # the fields of `Round`


def round_order(round_number: int) -> tuple[int, ...]:
    """The sides of one round's four epochs: ABBA, then BAAB, alternately.

    Within a round each side runs one epoch early and one late, so a drift of the machine's speed
    that is linear over the round cancels out of each side's sum. Flipping the order every round
    puts each side in the outer and the inner places equally often, and after an epoch of the other
    side as often (three times in four): with ABBA alone the inner pair measured 0.5 % less CPU than
    the outer one when both sides were the same plain loader (`--control`).
    """
    return (PLAIN, INSTRUMENTED, INSTRUMENTED, PLAIN) if round_number % 2 == 0 else (
        INSTRUMENTED, PLAIN, PLAIN, INSTRUMENTED)


def round_change(epochs: list[tuple[int, Epoch]]) -> Round:
    """The change across one round's epochs, each tagged PLAIN or INSTRUMENTED (equal samples each)."""
    def total(side: int, field: int) -> float:
        return sum(epoch[field] for tag, epoch in epochs if tag == side)

    return Round(100 * (total(PLAIN, 0) / total(INSTRUMENTED, 0) - 1),
                 100 * (total(INSTRUMENTED, 1) / total(PLAIN, 1) - 1))


class Spread(NamedTuple):
    median: float
    low: float  # bootstrap 95 % confidence interval of the median
    high: float
    first_quartile: float
    third_quartile: float
    smallest: float
    largest: float


def spread(values: list[float], resamples: int = 2000) -> Spread:
    """Median, its bootstrap 95 % confidence interval (percentiles of the medians of `resamples`
    resamplings of the rounds, seeded: the same rounds give the same interval), quartiles and range."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    quartiles = statistics.quantiles(values, n=4)
    return Spread(statistics.median(values), medians[round(0.025 * (resamples - 1))],
                  medians[round(0.975 * (resamples - 1))], quartiles[0], quartiles[2], min(values), max(values))


def stack(samples: list[numpy.ndarray]) -> numpy.ndarray:
    """The loaders' collate function: an array, which travels to the trainer pickled, by value. A
    tensor batch would travel in shared memory whose file descriptor each batch hands over in a
    socket handshake with its worker: a wait on thread scheduling that scattered the rounds."""
    return numpy.stack(samples)


def cpu_seconds(pid: int) -> float:
    """CPU time of a process's threads from the scheduler's own count (nanoseconds, where the kernel
    shows it), else from its clock-tick count (10 ms steps: coarse beside an epoch of tens of ms)."""
    try:
        total = 0.0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/sched") as sched:
                line = next(line for line in sched if line.startswith("se.sum_exec_runtime"))
            total += float(line.split(":")[1]) / 1000  # milliseconds
        return total
    except (OSError, StopIteration):
        return sum(psutil.Process(pid).cpu_times()[:2])


def jpeg_images(count: int = 64, size: int = 224) -> list[bytes]:
    """`count` distinct 224x224 RGB JPEGs (quality 90, ~30 KB, the size of a pre-resized training image):
    gradients with noise, so they compress and decode like photographs rather than flat colour."""
    from PIL import Image

    generator = numpy.random.default_rng(0)
    y, x = numpy.mgrid[0:size, 0:size]
    images = []
    for index in range(count):
        pixels = numpy.stack([(x * (index + 1)) % 256, (y * 3 + index) % 256, ((x + y) * 2) % 256], axis=-1)
        noisy = pixels + generator.normal(0, 20, pixels.shape)
        encoded = io.BytesIO()
        Image.fromarray(numpy.clip(noisy, 0, 255).astype(numpy.uint8)).save(encoded, "JPEG", quality=90)
        images.append(encoded.getvalue())
    return images


DECODES = ("matmul", "jpeg", "jpeg-files")
BOTH = ("matmul", "jpeg")  # `--decode both`
# Whether a decode is a real pipeline's work, on which the throughput target holds (DESIGN: "<= 0.5 %
# training throughput loss on a real DataLoader pipeline"), or synthetic work chosen light so that
# the client's fixed cost a batch shows: there the change is that cost over the batch's CPU time.
REAL_DECODING = {"matmul": False, "jpeg": True, "jpeg-files": True}
TARGET_THROUGHPUT_CHANGE = 0.5  # %, either way
BATCH = 64


def pipeline_rounds(
    rounds: int, warmup: int, samples: int, control: bool = False, decode: str = "matmul", rebuild_every: int = 5
) -> Run:
    """`rounds` measured rounds (`round_order`) of a plain and an instrumented loader (with `control`,
    a second plain one: the method's own noise), after `warmup` rounds that are discarded: the rounds'
    changes and every measured epoch of each side.

    Both loaders are built anew (fresh workers, the first built alternating) every `rebuild_every`
    rounds, each pair warmed up by one discarded round: a pair of loaders kept for a whole run carried
    a bias of its own (between two identical plain loaders kept for four rounds each, the pairs of one
    run differed by -4.0 % to +5.7 % in CPU a sample), which fresh pairs turn into noise that the
    median over many pairs averages out. A pair for each round, its loaders warmed up by an epoch
    each, was no steadier (rounds' quartiles -3.9 .. +3.4 % against -4.1 .. +3.5 %) and took half
    as long again a round.

    `decode` is each sample's work in its
    worker: "matmul", 12 small matrix products (~20 µs, light: the client's share shows), or "jpeg", a
    real 224x224 JPEG decoded with Pillow (~0.4 ms, still light beside decoding and augmenting a
    full-size photograph), or "jpeg-files", the same read from a file by `open()` and PIL, as
    torchvision's ImageFolder reads it, with no recorded read of its own: the instrumented loader's
    workers capture those reads (`instrument`'s default, what `stallwatch run` does to every loader)."""
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset

    from stallwatch.client.torch import instrument

    images = jpeg_images() if decode in ("jpeg", "jpeg-files") else []
    folder = tempfile.TemporaryDirectory()  # the files of "jpeg-files", in the page cache: CPU is compared
    files = []
    if decode == "jpeg-files":
        for index, image in enumerate(images):
            files.append(os.path.join(folder.name, f"{index}.jpg"))
            Path(files[-1]).write_bytes(image)

    class Samples(Dataset[numpy.ndarray]):
        """In-memory samples with a recorded 'read' each (in both loaders: what is compared is what
        `instrument` adds) and the same fixed CPU work for every sample, its "decoding"."""

        def __init__(self) -> None:
            generator = numpy.random.default_rng(0)
            self.data = generator.standard_normal((samples, 64), dtype=numpy.float32)
            self.mix = generator.standard_normal((64, 64), dtype=numpy.float32) / 8

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, index: int) -> numpy.ndarray:
            if files:  # torchvision's `pil_loader`
                with open(files[index % len(files)], "rb") as file:
                    pixels = numpy.asarray(Image.open(file).convert("RGB"))
                return pixels[::28, ::28].astype(numpy.float32).ravel()[:64] / 255 + self.data[index]
            with ReadSpan("/datasets/bench.bin", index * 256) as span:
                sample: numpy.ndarray = self.data[index]
                span.bytes = 256
            if images:  # decoded, then cut to the light pipeline's 64 floats: batches stay small in the queue
                pixels = numpy.asarray(Image.open(io.BytesIO(images[index % len(images)])).convert("RGB"))
                return pixels[::28, ::28].astype(numpy.float32).ravel()[:64] / 255 + sample
            for _ in range(12):  # its "decoding": with the step, ~30 µs of CPU a sample
                sample = numpy.tanh(sample @ self.mix)
            return sample

    dataset = Samples()  # one for both loaders: the same memory behind either side's reads
    weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))

    def used(loader: DataLoader[numpy.ndarray]) -> tuple[float, float]:
        """This process's CPU time and its loader workers' (persistent, so alive across epochs)."""
        workers = loader._iterator._workers if loader._iterator is not None else []  # type: ignore[attr-defined]
        return time.process_time(), sum(cpu_seconds(worker.pid) for worker in workers)

    def epoch(loader: DataLoader[numpy.ndarray]) -> Epoch:
        trainer_start, workers_start = used(loader)  # outside the timed span
        main_start = time.thread_time()
        start = time.perf_counter()
        stepping = 0.0
        for batch in loader:
            step_start = time.perf_counter()
            activations = torch.from_numpy(batch)
            for _ in range(40):  # the "training step"
                activations = torch.tanh(activations @ weights)
            stepping += time.perf_counter() - step_start
        elapsed = time.perf_counter() - start
        main = time.thread_time() - main_start
        trainer, workers = used(loader)
        return Epoch(elapsed, trainer - trainer_start + workers - workers_start, trainer - trainer_start, stepping,
                     main)

    def pair(number: int) -> dict[int, DataLoader[numpy.ndarray]]:
        loaders = {side: DataLoader(dataset, batch_size=BATCH, collate_fn=stack, num_workers=2, persistent_workers=True)
                   for side in dict.fromkeys(round_order(number))}  # both alike, persistent: started once
        if not control:
            instrument(loaders[INSTRUMENTED], job="bench", rank=0)
        return loaders

    def run(loaders: dict[int, DataLoader[numpy.ndarray]], number: int) -> list[tuple[int, Epoch]]:
        return [(side, epoch(loaders[side])) for side in round_order(number)]

    torch.set_num_threads(1)
    measured = Run([], [], [])
    loaders: dict[int, DataLoader[numpy.ndarray]] = {}
    for number in range(rounds):
        if number % rebuild_every == 0:
            for loader in loaders.values():
                loader._iterator._shutdown_workers()  # type: ignore[union-attr]
            loaders = pair(number // rebuild_every)
            for block_round in range(warmup if number == 0 else 1):  # start the workers; the first side alternates
                run(loaders, number // rebuild_every + block_round)
        this_round = run(loaders, number)
        measured.rounds.append(round_change(this_round))
        for side, result in this_round:
            (measured.plain if side == PLAIN else measured.compared).append(result)
    folder.cleanup()
    return measured


def pipeline_runs(runs: int, rounds: int, warmup: int, samples: int, control: bool, decode: str,
                  rebuild_every: int, events: str) -> list[Run]:
    """`runs` runs of `pipeline_rounds`, each in a fresh interpreter sending to the socket `events`: a run
    carried a bias of its own too (the instrumented workers of one used 5 % less CPU a sample
    throughout its 80 pairs of loaders), which the median of the runs sets aside."""
    command = [sys.executable, __file__, "--one-run", decode, "--socket", events, "--rounds", str(rounds),
               "--warmup", str(warmup), "--samples", str(samples), "--rebuild-every", str(rebuild_every),
               *(["--control"] if control else [])]
    done = []
    for _ in range(runs):
        rounds_done, plain, compared = json.loads(subprocess.run(command, check=True, capture_output=True,
                                                                 text=True).stdout)
        done.append(Run([Round(*change) for change in rounds_done], [Epoch(*epoch) for epoch in plain],
                        [Epoch(*epoch) for epoch in compared]))
    return done


def run_medians(runs: list[Run], field: int) -> list[float]:
    """Each run's median of one field of `Round`."""
    return [statistics.median(change[field] for change in run.rounds) for run in runs]


def median_of_runs(runs: list[Run], field: int) -> float:
    return statistics.median(run_medians(runs, field))


def client_cost_per_batch(runs: list[Run], samples: int) -> float:
    """µs of CPU the client adds to a batch: the median of the runs' median changes in CPU a sample,
    applied to the plain epochs' median CPU a batch."""
    plain = [epoch.cpu_seconds for run in runs for epoch in run.plain]
    return median_of_runs(runs, CPU_PER_SAMPLE) / 100 * statistics.median(plain) / samples * BATCH * 1e6


def verdict(decode: str, runs: list[Run], samples: int) -> str:
    """The throughput target's verdict on a real pipeline, on the median of the runs' medians; on a
    synthetic one, the client's cost a batch and the CPU a batch from which that cost stays within
    the target."""
    if REAL_DECODING[decode]:
        change = median_of_runs(runs, THROUGHPUT)
        met = "met" if abs(change) <= TARGET_THROUGHPUT_CHANGE else "MISSED"
        return (f"throughput target (within ±{TARGET_THROUGHPUT_CHANGE} % on a real pipeline, the median of the "
                f"runs): {met}, {change:+.2f} %")
    cost = client_cost_per_batch(runs, samples)
    floor = max(cost, 0.0) / (TARGET_THROUGHPUT_CHANGE / 100) / 1000
    return (f"synthetic pipeline, no target: the client adds {cost:.1f} µs of CPU a batch, within ±"
            f"{TARGET_THROUGHPUT_CHANGE} % of a batch of {floor:.1f} ms of CPU or more "
            f"({floor * 1000 / BATCH:.0f} µs a sample at batch {BATCH})")


def other_threads(epoch: Epoch) -> float:
    return epoch.trainer_cpu_seconds - epoch.main_thread_cpu_seconds


# Per decode: runs (fresh processes), measured rounds a run, samples an epoch, rounds a pair of loaders
# serves (a JPEG round takes ~1.4 s). For the jpeg pipeline, forty runs of 30 rounds (~41 min): the runs'
# medians spread by several points either way on a busy 2-core machine (a control's twelve runs: -2.91 ..
# +1.06 %), so that the median of twelve runs was only good to about ±0.9 %, and of forty to ±0.5 %.
PIPELINE_DEFAULTS = {"matmul": (4, 200, 2048, 10), "jpeg": (40, 30, 1024, 5), "jpeg-files": (40, 30, 1024, 5)}


def print_pipeline(decode: str, samples: int, warmup: int, rebuild_every: int, control: bool, runs: list[Run]) -> None:
    side = "a second plain loader (--control)" if control else "instrumented"
    rounds = [change for run in runs for change in run.rounds]
    print(f"DataLoader pipeline, {decode} decoding (2 persistent workers, batch {BATCH}, {samples} samples an epoch), "
          f"plain against {side}: {len(runs)} runs, each a fresh process of {len(runs[0].rounds)} rounds of four "
          f"epochs (ABBA, BAAB) after {warmup} discarded, both loaders built anew every {rebuild_every} rounds "
          "(one more discarded)")
    for name, epochs in (("plain", [e for run in runs for e in run.plain]),
                         ("second plain" if control else "with client", [e for run in runs for e in run.compared])):
        def micro(value: Callable[[Epoch], float], epochs: list[Epoch] = epochs) -> float:
            """µs a sample, the median of the epochs."""
            return 1e6 * statistics.median(value(e) / samples for e in epochs)

        print(f"  {name:12s} {statistics.median(samples / e.seconds for e in epochs):10.0f} samples/s, "
              f"{micro(lambda e: e.cpu_seconds):7.2f} µs CPU a sample, of which the trainer "
              f"{micro(lambda e: e.trainer_cpu_seconds):6.2f} (its main thread "
              f"{micro(lambda e: e.main_thread_cpu_seconds):6.2f}, its other threads {micro(other_threads):5.2f}); "
              f"steps {micro(lambda e: e.step_seconds):6.2f}, waits {micro(lambda e: e.seconds - e.step_seconds):6.2f}"
              " µs a sample (medians of the epochs)")
    for name, field in (("throughput", THROUGHPUT), ("CPU a sample", CPU_PER_SAMPLE)):
        medians = run_medians(runs, field)
        among = spread(medians) if len(medians) > 1 else None  # how far the median of this many runs may be off
        print(f"  {name} change, median of the runs {statistics.median(medians):+.2f} %"
              + (f" (95 % CI {among.low:+.2f} .. {among.high:+.2f} %)" if among else "") + "; the runs' medians "
              + ", ".join(f"{median:+.2f}" for median in medians) + " %")
        pooled = spread([change[field] for change in rounds])
        print(f"    all {len(rounds)} rounds: median {pooled.median:+.2f} % (95 % CI {pooled.low:+.2f} .. "
              f"{pooled.high:+.2f} %), quartiles {pooled.first_quartile:+.2f} .. {pooled.third_quartile:+.2f} %, "
              f"range {pooled.smallest:+.2f} .. {pooled.largest:+.2f} %")
    print(f"  {verdict(decode, runs, samples)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=8 * wire.MAX_EVENTS * 50)
    parser.add_argument("--decode", choices=[*DECODES, "both"], default="both",
                        help="each sample's work in the DataLoader pipeline (pipeline_rounds)")
    parser.add_argument("--runs", type=int,
                        help="runs of each pipeline, each a fresh process (default: PIPELINE_DEFAULTS)")
    parser.add_argument("--rounds", type=int, help="measured rounds a run (default: PIPELINE_DEFAULTS)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds a run runs first and discards")
    parser.add_argument("--samples", type=int, help="samples an epoch (default: PIPELINE_DEFAULTS)")
    parser.add_argument("--rebuild-every", type=int,
                        help="rounds one pair of loaders serves (default: PIPELINE_DEFAULTS)")
    parser.add_argument("--control", action="store_true",
                        help="compare the plain loader with a second plain one instead: the method's own noise")
    parser.add_argument("--one-run", choices=DECODES, help=argparse.SUPPRESS)  # a run's process (pipeline_runs)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:
        transport.configure(args.socket)
        print(json.dumps(pipeline_rounds(args.rounds, args.warmup, args.samples, args.control, args.one_run,
                                         args.rebuild_every)))
        return 0
    decodes = BOTH if args.decode == "both" else (args.decode,)
    pipelines = {decode: tuple(given or default for given, default in zip(
        (args.runs, args.rounds, args.samples, args.rebuild_every), PIPELINE_DEFAULTS[decode], strict=True))
        for decode in decodes}
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "events.sock")
        drain = subprocess.Popen([sys.executable, "-c", DRAIN, path], stdout=subprocess.PIPE, text=True)
        try:
            assert drain.stdout is not None and drain.stdout.readline().strip() == "ready"
            transport.configure(path)
            costs = per_event(args.events)
            batch_plain, batch_instrumented = per_batch()
            pickling = pickling_cost()
            measured = {decode: pipeline_runs(runs, rounds, args.warmup, samples, args.control, decode, every, path)
                        for decode, (runs, rounds, samples, every) in pipelines.items()}
        finally:
            drain.kill()
            drain.wait()
    print(f"per event ({args.events:,} events, best of 7, CPU count {os.cpu_count()}):")
    dropped = costs.pop("events dropped (must be 0)")
    failed = costs.pop("flushes failed (must be 0)")
    paired = costs.pop("record / observe, paired rounds")
    for name, nanoseconds in costs.items():
        print(f"  {name:42s} {nanoseconds / 1000:8.3f} µs")
    print(f"  events the drain could not take (dropped)  {dropped:8.0f}")
    print(f"  flushes that failed (must be 0)            {failed:8.0f}")
    observe = costs["Histogram.observe"]
    record = costs["record one event (append + pack + send)"]
    print(f"  record one event / Histogram.observe       {record / observe:8.2f}x (the best of each)")
    print(f"  the same, median of paired rounds          {paired.median:8.2f}x (95 % CI {paired.low:.2f} .. "
          f"{paired.high:.2f}; quartiles {paired.first_quartile:.2f} .. {paired.third_quartile:.2f})")
    print(f"  monitor() step overhead / Histogram.observe {costs['monitor() overhead per step'] / observe:7.2f}x")
    print("per batch of 64, DataLoader without workers (CPU, best of 7):")
    print(f"  plain {batch_plain:6.2f} µs, instrumented {batch_instrumented:6.2f} µs: instrument() adds "
          f"{batch_instrumented - batch_plain:.2f} µs a batch, and {pickling:.2f} µs pickling its numbered indices "
          "to a worker")
    for decode, (_, _, samples, rebuild_every) in pipelines.items():
        print_pipeline(decode, samples, args.warmup, rebuild_every, args.control, measured[decode])
    return 0


if __name__ == "__main__":
    sys.exit(main())
