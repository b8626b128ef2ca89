"""Kernel-level read capture, tried: what a BPF program on the read system calls' tracepoints costs a read,
and what the page-cache tracepoints see that capture in Python cannot (a memory-mapped array).

1. Cost. 16 KiB `pread`s of a file in the page cache, timed in this process with no program attached
   (plain), with a program on `syscalls:sys_enter_pread64`/`sys_exit_pread64` that keeps another
   process's reads only (what every other process on the node pays), with one that times and sums this
   process's reads per thread in the kernel (a capture's work, nothing sent out), and with one that
   captures them (each read an event to user space: thread, descriptor, offset, bytes, start, end, as a
   capture joined to the client's batches needs). Each round times every side once, in an order that
   alternates from round to round; the figures are medians over the rounds. The consumer's CPU (bpftrace
   reading the events) is its own process's, given a read.
2. What it sees. A NumPy array saved to a file and loaded with `mmap_mode="r"`, then summed: the read
   system calls of this process (all that Python-level capture could see: the header) against the
   file's pages the `filemap:mm_filemap_fault` and `mm_filemap_map_pages` tracepoints report.

Needs root, bpftrace (Debian: `apt-get install bpftrace`) and tracefs mounted; without them it says so and
exits 0.

    python benchmarks/kernel_capture.py [--reads 100000] [--rounds 7] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

try:
    from client_overhead import cpu_seconds  # run as a script: a sibling
except ImportError:  # imported as benchmarks.kernel_capture
    from benchmarks.client_overhead import cpu_seconds

READ_SIZE = 16 * 1024
FILE_SIZE = 64 * 1024 * 1024
ATTACH_TIMEOUT_S = 30.0
TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")

# Keeps the reads of process $1: each one's start, descriptor and offset at entry, an event at exit.
CAPTURE = """
tracepoint:syscalls:sys_enter_pread64 /pid == $1/ { @start[tid] = nsecs; @fd[tid] = args->fd; @pos[tid] = args->pos; }
tracepoint:syscalls:sys_exit_pread64 /@start[tid]/ {
  printf("%d %d %d %d %d %d\\n", tid, @fd[tid], @pos[tid], args->ret, @start[tid], nsecs);
  delete(@start[tid]); delete(@fd[tid]); delete(@pos[tid]);
}
"""
# The same reads timed and summed per thread in the kernel: a capture's work without sending each read out.
SUMMED = """
tracepoint:syscalls:sys_enter_pread64 /pid == $1/ { @start[tid] = nsecs; }
tracepoint:syscalls:sys_exit_pread64 /@start[tid]/ {
  @reads[tid] = count(); @bytes[tid] = sum(args->ret); @ns[tid] = sum(nsecs - @start[tid]); delete(@start[tid]);
}
"""
# Process $1's read system calls (any descriptor) and the pages of inode $2 it faulted in or had mapped.
SEEN = """
tracepoint:syscalls:sys_exit_read, tracepoint:syscalls:sys_exit_pread64 /pid == $1 && args->ret > 0/ {
  @read_calls = count(); @read_bytes = sum(args->ret);
}
tracepoint:filemap:mm_filemap_fault /pid == $1 && args->i_ino == $2/ { @faults = count(); }
tracepoint:filemap:mm_filemap_map_pages /pid == $1 && args->i_ino == $2/ {
  @mapped = count(); @first_page = min(args->index); @last_page = max(args->last_index);
}
"""


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (BPF programs)"
    if shutil.which("bpftrace") is None:
        return "needs bpftrace (apt-get install bpftrace)"
    if not any(Path(folder, "events", "syscalls").is_dir() for folder in TRACEFS):
        return "needs tracefs, where the tracepoints are listed (mount -t tracefs nodev /sys/kernel/tracing)"
    return None


@contextmanager
def bpftrace(program: str, *arguments: int, output: Path) -> Iterator[subprocess.Popen[bytes]]:
    """bpftrace running `program` with its output to `output`, attached before the block, stopped (its maps
    printed) after it."""
    with output.open("wb") as sink:
        process = subprocess.Popen(["bpftrace", "-e", program, *map(str, arguments)], stdout=sink,
                                   stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while b"Attaching" not in output.read_bytes():
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bpftrace did not attach: {output.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        time.sleep(0.2)  # "Attaching" comes before the last probe is in place
        yield process
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


def reading(fd: int, reads: int) -> Callable[[], float]:
    """A chunk of `reads` 16 KiB preads across the file (`pread64`, one system call each); its nanoseconds a read."""
    offsets = [(i * READ_SIZE) % FILE_SIZE for i in range(reads)]

    def chunk() -> float:
        start = time.perf_counter_ns()
        for offset in offsets:
            os.pread(fd, READ_SIZE, offset)
        return (time.perf_counter_ns() - start) / reads
    return chunk


def cost(path: Path, work: Path, reads: int, rounds: int) -> None:
    other = subprocess.Popen(["sleep", "3600"])  # the process the filtered program keeps
    fd = os.open(path, os.O_RDONLY)
    chunk = reading(fd, reads)
    chunk()  # the file into the page cache, the loop warm
    sides: dict[str, list[float]] = {"plain": [], "filtered": [], "summed": [], "captured": []}
    events, consumer_cpu = [], []  # a round's events received, and bpftrace's CPU seconds an event
    try:
        for round_ in range(rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for side in order:
                if side == "plain":
                    sides[side].append(chunk())
                    continue
                output = work / f"{side}.out"
                program = SUMMED if side == "summed" else CAPTURE
                with bpftrace(program, other.pid if side == "filtered" else os.getpid(), output=output) as tracer:
                    before = cpu_seconds(tracer.pid)
                    sides[side].append(chunk())
                    if side == "captured":
                        time.sleep(0.5)  # the last events drained
                        consumed = cpu_seconds(tracer.pid) - before
                if side == "captured":
                    events.append(sum(1 for line in output.read_text(errors="replace").splitlines()
                                      if line.split(" ", 1)[0].isdigit()))
                    consumer_cpu.append(consumed / max(events[-1], 1))
    finally:
        os.close(fd)
        other.kill()
        other.wait()
    plain, filtered, summed, captured = (statistics.median(sides[side]) for side in sides)
    print(f"cost: {reads:,} preads of 16 KiB a side, {rounds} rounds, medians")
    print(f"  plain pread (page cache)                          {plain:8.0f} ns")
    print(f"  with the program keeping another process's reads  {filtered:8.0f} ns  (+{filtered - plain:.0f} ns)")
    print(f"  with this process's reads summed in the kernel     {summed:8.0f} ns  (+{summed - plain:.0f} ns)")
    print(f"  with the program capturing this process's reads   {captured:8.0f} ns  (+{captured - plain:.0f} ns)")
    print(f"  events received by bpftrace: {statistics.median(events):,.0f} of {reads:,} a round "
          f"(fewest {min(events):,})")
    print(f"  bpftrace's CPU reading them: {statistics.median(consumer_cpu) * 1e9:.0f} ns an event (its process)")


def seen(work: Path) -> None:
    path = work / "array.npy"
    np.save(path, np.arange(FILE_SIZE // 8, dtype=np.int64))
    inode = path.stat().st_ino
    output = work / "seen.out"
    with bpftrace(SEEN, os.getpid(), inode, output=output):
        array = np.load(path, mmap_mode="r")
        total = int(array.sum())
        del array
    assert total == (FILE_SIZE // 8) * (FILE_SIZE // 8 - 1) // 2
    maps = {}
    for line in output.read_text(errors="replace").splitlines():
        if line.startswith("@") and ":" in line:
            name, value = line.split(":", 1)
            maps[name.strip("@ ")] = int(value)
    print(f"what it sees: np.load(mmap_mode='r') of a {FILE_SIZE >> 20} MiB array, summed")
    print(f"  read system calls of the process: {maps.get('read_calls', 0)}, {maps.get('read_bytes', 0):,} bytes "
          "(what Python-level capture can see: the header, through the file object)")
    first, last = maps.get("first_page", 0) * 4096, (maps.get("last_page", -1) + 1) * 4096
    print(f"  page-cache events of the file: {maps.get('faults', 0):,} faults, {maps.get('mapped', 0):,} fault-around "
          f"mappings (pages already cached, mapped a folio at a time), covering offsets {first >> 20} to "
          f"{last / 2**20:.1f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=100_000, help="preads a side a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where its files go: a disk file system "
                        "(a tmpfs's pages fault through shmem, not filemap)")
    options = parser.parse_args()
    reason = unavailable()
    if reason is not None:
        print(f"kernel capture not measured: {reason}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kernel-capture-", dir=options.dir) as folder:
        work = Path(folder)
        data = work / "data.bin"
        data.write_bytes(os.urandom(FILE_SIZE))
        cost(data, work, options.reads, options.rounds)
        seen(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
