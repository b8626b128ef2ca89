"""The agent under ordinary use that outgrows it and input that tries to: label caps that forget finished
jobs, collectors that overrun their deadline, a recording on a full disk. Real agents throughout."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stallwatch.catalogue import JOB_LABEL as JOB
from stallwatch.catalogue import WARMUP_PHASE
from stallwatch.client import wire
from stallwatch.correlator.eventfile import read_events
from stallwatch.eventbatch import OVERFLOW, Interner
from stallwatch.exporters.openmetrics_mapping import mapping_text
from stallwatch.harness import AgentProcess, Samples, scrape, timed_scrape, wait_for
from stallwatch.harness import total as of

DATA = Path(__file__).parent / "data"


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {dict(ls)[label] for (n, ls) in samples if n == name}


class Sender:
    """Sends client batches straight to an agent's socket, as the training client does."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def steps(self, job: str, rank: int, count: int = 1) -> None:
        now = time.monotonic_ns()
        steps = [(n, now - 3_000_000, now - 2_000_000, now - 1_000_000, -1) for n in range(count)]
        self._socket.sendto(wire.encode(wire.Source(job, rank), steps, [], len(steps), 0, 0, now, time.time_ns()),
                            self.path)

    def close(self) -> None:
        self._socket.close()


@pytest.fixture
def full_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 64 KiB tmpfs where mount works, so a file there fills the disk; else /dev/full's
    directory, where every write fails with ENOSPC (then the recorder's path is /dev/full itself)."""
    mount_point = tmp_path / "full"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                             capture_output=True).returncode == 0
    try:
        yield mount_point if mounted else Path("/dev")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)


# --- item 4: a full disk under the correlator's recorders --------------------------------------------
def test_a_full_disk_under_the_recorders_never_stops_attribution(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path, full_filesystem: Path,
) -> None:
    on_tmpfs = full_filesystem != Path("/dev")
    events_path = full_filesystem / "events.sw" if on_tmpfs else Path("/dev/full")
    windows_path = full_filesystem / "windows.jsonl" if on_tmpfs else Path("/dev/full")
    path = str(tmp_path / "events.sock")
    agent = agent_factory("--no-collector.gpu", "--no-collector.host", "--events.socket", path,
                          "--correlator.window", "0.5", "--correlator.lateness", "0.25",
                          "--correlator.record-events", str(events_path),
                          "--correlator.record-windows", str(windows_path))
    sender = Sender(path)
    try:
        def attributed() -> bool:
            for rank in range(4):
                sender.steps("full-disk", rank, 100)
            samples = scrape(agent.url)
            return (of(samples, "stallwatch_correlator_windows_total") >= 10
                    and of(samples, "stallwatch_correlator_record_errors_total", recording="events") > 0)

        wait_for("windows closed and record errors counted", attributed, 30, agent.process, agent.log)
        samples = scrape(agent.url)
    finally:
        sender.close()
    steps = of(samples, "stallwatch_receiver_events_total", kind="step")
    errors = {dict(ls)["recording"]: v for (n, ls), v in samples.items()
              if n == "stallwatch_correlator_record_errors_total"}
    print(f"{'64 KiB tmpfs' if on_tmpfs else '/dev/full'}: {of(samples, 'stallwatch_correlator_windows_total'):.0f} "
          f"windows closed, {steps:.0f} steps received, record errors {errors}")
    assert of(samples, "stallwatch_compute_seconds_total", **{JOB: "full-disk"}) > 0  # attributed
    assert of(samples, "stallwatch_correlator_record_errors_total", recording="events", reason="ENOSPC") > 0
    assert of(samples, "stallwatch_correlator_dropped_events_total") == 0
    log = agent.stderr()
    assert "Traceback" not in log
    assert log.count("cannot record events") == 1, log  # once per cause, however many failed
    if on_tmpfs:  # what did fit is whole records: the file replays
        assert sum(len(batch) for batch in read_events(events_path)) > 0
        with contextlib.suppress(FileNotFoundError):
            for line in windows_path.read_text().splitlines():
                assert line.startswith("{") and line.endswith("}")


# --- item 3: a collector wedged on a file that blocks ----------------------------------------------
def threads_of(agent: AgentProcess) -> int:
    status = Path(f"/proc/{agent.process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def wedging_nfs(tmp_path: Path) -> tuple[list[str], Path]:
    """spoke_nfs reading its mountstats from a FIFO: each read waits for a writer, as a hung file system's
    would (a hung mount cannot be made here; the nginx tailer no longer opens what is not a regular file)."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    return (["--collector.spoke_nfs", "--spoke_nfs.mount", "a=/mnt/a", "--spoke_nfs.proc", str(proc)],
            proc / "self" / "mountstats")


def test_a_collector_wedged_on_a_fifo_fails_alone_and_makes_the_agent_unhealthy(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    flags, mountstats = wedging_nfs(tmp_path)
    mountstats.write_text("")
    agent = agent_factory("--no-collector.gpu", *flags, "--collector.timeout", "1")
    assert scrape(agent.url)[("stallwatch_scrape_collector_success", (("collector", "spoke_nfs"),))] == 1
    mountstats.unlink()
    os.mkfifo(mountstats)  # reading it blocks until a writer comes: the collector's call wedges
    durations, threads = [], []
    for _ in range(6):
        started = time.monotonic()
        samples = scrape(agent.url, timeout=30)
        durations.append(time.monotonic() - started)
        threads.append(threads_of(agent))
    healthy = urllib.request.Request(agent.base + "/-/healthy")
    with pytest.raises(urllib.error.HTTPError) as unhealthy:
        urllib.request.urlopen(healthy, timeout=10)
    answer = unhealthy.value.read().decode().strip()
    print(f"wedged: scrapes took {', '.join(f'{d:.2f}' for d in durations)} s; agent threads {threads}; "
          f"/-/healthy {unhealthy.value.code} {answer!r}")
    success = {dict(ls)["collector"]: v for (n, ls), v in samples.items() if n == "stallwatch_scrape_collector_success"}
    assert success.pop("spoke_nfs") == 0 and set(success.values()) == {1.0}, success
    assert of(samples, "stallwatch_receiver_up") == 1  # the rest are served
    assert max(durations) < 5  # the deadline is 1 s: never the blocked call's time
    assert max(threads) - min(threads) <= 1  # one call outstanding, however many scrapes
    assert unhealthy.value.code == 503 and answer == "wedged collectors: spoke_nfs"
    writer = os.open(mountstats, os.O_WRONLY | os.O_NONBLOCK)  # the blocked reader is there: it opens at once
    regular = tmp_path / "mountstats"
    regular.write_text("")
    os.replace(regular, mountstats)  # later reads find a file again
    os.close(writer)  # the blocked read ends

    def recovered() -> bool:
        served = scrape(agent.url)
        return served[("stallwatch_scrape_collector_success", (("collector", "spoke_nfs"),))] == 1

    wait_for("spoke_nfs to answer again", recovered, 20, agent.process, agent.log)
    with urllib.request.urlopen(healthy, timeout=10) as reply:
        assert reply.status == 200
    assert agent.stderr().count("collector spoke_nfs overran its deadline") == 1


def test_a_fifo_at_the_nginx_log_path_when_the_agent_starts_neither_holds_it_nor_the_other_collectors(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    """The tailer opened the path at start-up and waited there for a writer: the agent never served. Now it
    is refused as no log, said once, the collector reported failed; a log put there later is read."""
    log_path = tmp_path / "nginx.log"
    os.mkfifo(log_path)
    started = time.monotonic()
    agent = agent_factory("--no-collector.gpu", "--collector.spoke_nginx", "--spoke_nginx.log", str(log_path),
                          "--spoke_nginx.interval", "0.2")
    samples = scrape(agent.url, timeout=10)
    with urllib.request.urlopen(agent.base + "/-/healthy", timeout=10) as reply:
        assert reply.status == 200
    print(f"served {time.monotonic() - started:.2f} s after the start")
    success = {dict(ls)["collector"]: v for (n, ls), v in samples.items() if n == "stallwatch_scrape_collector_success"}
    assert success.pop("spoke_nginx") == 0 and set(success.values()) == {1.0}, success
    assert of(samples, "stallwatch_spoke_collector_errors_total", reason="read_error") >= 1
    assert agent.stderr().count(f"{log_path} is a FIFO, not a log file") == 1
    line = next(line for line in (DATA / "nginx-stallwatch.log").read_text().splitlines() if line[0] != "#") + "\n"
    regular = tmp_path / "written.log"
    regular.write_text(line * 3)
    os.replace(regular, log_path)
    wait_for("the log's lines", lambda: of(scrape(agent.url), "stallwatch_spoke_requests_total") == 3, 10,
             agent.process, agent.log)


def test_a_collector_whose_set_up_blocks_is_reported_failed_and_the_agent_serves(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    """A mapping file that blocks on open (a FIFO; a hung mount alike): the agent serves after the set-up
    deadline, the collector reported failed and named by the health check until its set-up ends."""
    mapping = tmp_path / "mapping.yaml"
    os.mkfifo(mapping)
    started = time.monotonic()
    agent = agent_factory("--no-collector.gpu", "--collector.spoke_openmetrics", "--spoke_openmetrics.url",
                          "http://127.0.0.1:9/metrics", "--spoke_openmetrics.mapping", str(mapping))
    served = time.monotonic() - started
    samples = scrape(agent.url, timeout=10)
    healthy = urllib.request.Request(agent.base + "/-/healthy")
    with pytest.raises(urllib.error.HTTPError) as unhealthy:
        urllib.request.urlopen(healthy, timeout=10)
    answer = unhealthy.value.read().decode().strip()
    print(f"served {served:.2f} s after the start; /-/healthy {unhealthy.value.code} {answer!r}")
    assert served < 15
    assert of(samples, "stallwatch_scrape_collector_success", collector="spoke_openmetrics") == 0
    assert of(samples, "stallwatch_scrape_collector_success", collector="host") == 1
    assert re.fullmatch(r"spoke_openmetrics: still setting up after \d+ s", answer), answer
    with open(mapping, "w") as writer:  # the set-up's open returns; it reads the built-in mapping's text
        writer.write(mapping_text("juicefs")[0])
    wait_for("the set-up to end", lambda: urllib.request.urlopen(healthy, timeout=10).status == 200, 10,
             agent.process, agent.log)
    assert of(scrape(agent.url), "stallwatch_spoke_collector_errors_total", reason="unreachable") >= 1


# --- item 1: caps that forget finished jobs -------------------------------------------------------
def job_ranks(samples: Samples, name: str, job: str) -> set[str]:
    return {dict(ls)["rank"] for (n, ls) in samples if n == name and dict(ls).get(JOB) == job}


LOADER, CORRELATOR = "stallwatch_loader_wait_seconds_count", "stallwatch_compute_seconds_total"
PHASE = WARMUP_PHASE.name


def test_two_hundred_short_jobs_never_fill_the_caps_and_finished_ones_expire(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    path = str(tmp_path / "events.sock")
    windows = tmp_path / "windows.jsonl"
    agent = agent_factory("--no-collector.gpu", "--no-collector.host", "--events.socket", path,
                          "--events.expire-after", "0.5", "--correlator.window", "0.25",
                          "--correlator.lateness", "0.25", "--correlator.record-windows", str(windows))
    sender = Sender(path)
    most_jobs = most_pairs = 0

    def correlator_ranks_of_job_10() -> set[int]:
        """From the published windows' record: the job's series live only 0.5 s, less than a loaded
        machine may take between two scrapes."""
        lines = windows.read_text().splitlines() if windows.exists() else []
        return {rank["rank"] for line in lines for rank in json.loads(line)["ranks"] if rank["job"] == "slurm-10"}

    try:
        for number in range(200):  # 8-rank jobs one after another, 0.2 s each: about 5 live at a time
            job = f"slurm-{number}"
            for _ in range(4):
                for rank in range(8):
                    sender.steps(job, rank, 5)
                time.sleep(0.05)
            samples = scrape(agent.url)
            loader_jobs = label_values(samples, LOADER, JOB)
            most_jobs = max(most_jobs, len(loader_jobs))
            most_pairs = max(most_pairs, sum(1 for (n, _) in samples if n == LOADER))
            assert job_ranks(samples, LOADER, job) == {str(rank) for rank in range(8)}, (number, loader_jobs)
            if number == 10:
                wait_for("job 10's correlator windows", lambda: len(correlator_ranks_of_job_10()) == 8, 20,
                         agent.process, agent.log)
        live = scrape(agent.url)

        def all_expired() -> bool:
            samples = scrape(agent.url)
            # A job's per-job series go with its warm-up state, a window or two after its rank series.
            return not any(label_values(samples, name, JOB) for name in (LOADER, CORRELATOR, PHASE))

        wait_for("every job's series to expire", all_expired, 10, agent.process, agent.log)
        after = scrape(agent.url)
    finally:
        sender.close()
    print(f"200 jobs x 8 ranks: at most {most_jobs} jobs and {most_pairs} (job, rank) loader series at once; "
          f"folded: receiver {of(live, 'stallwatch_receiver_folded_label_values_total'):.0f}, correlator "
          f"{of(live, 'stallwatch_correlator_folded_label_values_total'):.0f}; "
          f"{of(after, 'stallwatch_receiver_events_total', kind='step'):.0f} steps; all series gone after 0.5 s idle")
    assert of(live, "stallwatch_receiver_folded_label_values_total") == 0
    assert of(live, "stallwatch_correlator_folded_label_values_total") == 0
    assert of(after, "stallwatch_receiver_events_total", kind="step") == 200 * 4 * 8 * 5
    assert most_pairs <= 64
    assert not label_values(after, "stallwatch_stall_seconds_total", JOB)
    assert not label_values(after, "stallwatch_gpu_stall_idle_seconds_total", JOB)
    assert not label_values(after, "stallwatch_warmup_phase", JOB)


# --- item 2: the correlator's series under any number of ranks ----------------------------------------
def peak_rss_mib(agent: AgentProcess) -> float:
    status = Path(f"/proc/{agent.process.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


RANKS = 50_000
RSS_LIMIT_MIB = 256  # the systemd unit's MemoryMax and the chart's memory limit


def test_fifty_thousand_ranks_fold_in_the_correlator_and_the_agent_stays_under_its_memory_limit(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    path = str(tmp_path / "events.sock")
    agent = agent_factory("--no-collector.gpu", "--no-collector.host", "--events.socket", path,
                          "--correlator.window", "1", "--correlator.lateness", "10",
                          # Each rank steps once and falls silent: its window is published once the hold
                          # (the retention) gives up waiting for the rank's next step.
                          "--correlator.retention", "5")
    sender = Sender(path)
    try:
        for rank in range(RANKS):  # one step each: a rank per datagram, as a client sends
            sender.steps("wide", rank)

        def accounted(samples: Samples) -> float:  # steps attributed (1 ms of compute each) or counted late
            attributed = of(samples, CORRELATOR, **{JOB: "wide"}) / 0.001
            return attributed + of(samples, "stallwatch_correlator_late_events_total")

        def attributed() -> bool:
            return accounted(scrape(agent.url)) >= RANKS - 0.5

        wait_for("every step attributed or counted late", attributed, 60, agent.process, agent.log)
        scrape_s, samples = timed_scrape(agent.url)
    finally:
        sender.close()
    peak = peak_rss_mib(agent)
    print(f"{RANKS:,} ranks: {len(samples):,} samples, scrape {scrape_s * 1e3:.0f} ms, "
          f"peak RSS {peak:.1f} MiB; "
          f"folded ranks: receiver {of(samples, 'stallwatch_receiver_folded_label_values_total', label='rank'):.0f}, "
          f"correlator {of(samples, 'stallwatch_correlator_folded_label_values_total', label='rank'):.0f} "
          f"({of(samples, 'stallwatch_correlator_late_events_total'):.0f} steps late)")
    assert job_ranks(samples, CORRELATOR, "wide") == {*(str(rank) for rank in range(64)), "__other__"}
    late = of(samples, "stallwatch_correlator_late_events_total")
    assert of(samples, "stallwatch_correlator_folded_label_values_total", label="rank") == RANKS - late - 64
    assert of(samples, "stallwatch_receiver_folded_label_values_total", label="rank") == RANKS - 64
    assert accounted(samples) == pytest.approx(RANKS)  # folded, not lost
    assert len(samples) < 5_000
    assert peak < RSS_LIMIT_MIB


def test_the_job_cap_counts_live_jobs_and_a_released_id_still_names_its_job() -> None:
    now = [0]
    jobs = Interner(limit=2, expire_after_s=1.0, clock_ns=lambda: now[0])
    first, second = jobs.intern("a"), jobs.intern("b")
    assert jobs.name(jobs.intern("c")) == OVERFLOW and jobs.folded == 1  # two live: full
    now[0] = 1_500_000_000
    jobs.intern("b")  # b is live again, a has been idle past the expiry
    third = jobs.intern("d")
    assert jobs.name(third) == "d" and third not in (first, second)  # a's place, not its id
    assert jobs.name(first) == "a"  # a lagging consumer can still name it
    now[0] = 3_000_000_000
    jobs.intern("e")
    assert jobs.name(first) == OVERFLOW and jobs.names() == ["e"]


def test_an_agent_with_a_wedged_collector_still_exits_on_sigterm(
    agent_factory: Callable[..., AgentProcess], tmp_path: Path,
) -> None:
    flags, mountstats = wedging_nfs(tmp_path)
    os.mkfifo(mountstats)
    agent = agent_factory("--no-collector.gpu", *flags, "--collector.timeout", "1")
    scrape(agent.url)
    started = time.monotonic()
    agent.process.send_signal(signal.SIGTERM)
    assert agent.process.wait(timeout=20) == 0
    print(f"exited {time.monotonic() - started:.1f} s after SIGTERM with spoke_nfs wedged")
