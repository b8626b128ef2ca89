"""The demo's lines, without running it: each epoch's figures over its own span, from the agent's window file
and the spoke's counters; the flags' help says the defaults the demo uses; where its files stay."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from stallwatch import catalogue as c
from stallwatch.demo.epochs import EpochFigures, WindowFile, epoch_line, spoke_requests
from stallwatch.demo.hub import Hub
from stallwatch.demo.outputs import files_left
from stallwatch.demo.run import Demo, Settings, main
from stallwatch.harness import Samples


def window(start: float, stall: float, compute: float, phase: str, job: str = "demo") -> dict[str, object]:
    """A window file line of 0.5 s: one rank's stall (all remote fetches) and compute, the job's phase."""
    stalls = {cause: 0.0 for cause in c.CAUSES} | {"remote_fetch": stall}
    return {"start_s": start, "end_s": start + 0.5, "gpus": [], "whatif_hit_ratio": {},
            "ranks": [{"job": job, "rank": 0, "steps": 1, "wait_s": stall, "compute_s": compute,
                       "input_bound_ratio": 0.0, "stall_s": stalls}],
            "jobs": [{"job": job, "phase": phase, "hit_ratio": 1.0, "reads": 1, "hub_bytes": 0}]}


def test_an_epoch_takes_the_windows_of_its_own_span_once_they_are_out(tmp_path: Path) -> None:
    path = tmp_path / "windows.jsonl"
    # The epoch runs 100.0 to 102.0: a cold window before it, then stalls in its first second only.
    lines = [window(99.5, 0.5, 0.0, "cold"), window(100.0, 0.4, 0.1, "cold"), window(100.5, 0.3, 0.2, "transition"),
             window(101.0, 0.0, 0.5, "transition"), window(101.5, 0.0, 0.5, "steady"),
             window(101.5, 0.1, 0.0, "steady", job="other")]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"start_s": 102.0, "end')
    windows = WindowFile(path, "demo")
    windows.read()
    assert not windows.covers(102.0)  # the window after the epoch is still being written
    stalled, computed, phases = windows.booked(100.0, 102.0)
    assert (stalled, computed) == pytest.approx((0.7, 1.3)) and phases == ("cold", "transition", "steady")
    with path.open("a") as handle:
        handle.write(json.dumps(window(102.0, 0.0, 0.5, "steady"))[len('{"start_s": 102.0, "end'):] + "\n")
    windows.read()
    assert windows.covers(102.0)
    assert windows.booked(102.0, 103.0)[1] == pytest.approx(0.5)


def test_the_runs_last_epoch_takes_the_window_of_its_last_step_whose_middle_comes_after_it(tmp_path: Path) -> None:
    # Epoch 1 runs 100.0 to 102.0, epoch 2 (the run's last, ended on its last step) 102.0 to 104.0; the
    # window of that step runs 103.9 to 104.4, its middle after the epoch's end; then one with no step.
    path = tmp_path / "windows.jsonl"
    lines = [window(100.0, 0.4, 0.1, "cold"), window(101.6, 0.0, 0.4, "cold"), window(102.0, 0.1, 0.3, "steady"),
             window(103.9, 0.0, 0.3, "steady"), window(104.4, 0.0, 0.0, "steady")]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    windows = WindowFile(path, "demo")
    windows.read()
    demo = Demo(Settings(quiet=True, workdir=tmp_path))
    demo._trainer_until = 103.0  # the trainer stops on its first step boundary from here
    demo._epoch_from(100.0, {})
    demo._epoch_running = 1
    demo._epoch_ended(1, 2, {}, 102.0)
    demo._say_epochs(windows)  # epoch 2's first batch not yet in (an outage): epoch 1 ended before the deadline
    assert [e.epoch for e in demo.epochs] == [1]
    demo._epoch_running = 2
    demo._epoch_ended(2, 2, {}, 104.0)
    demo._say_epochs(windows)
    assert windows.covers(104.0) and [e.epoch for e in demo.epochs] == [1]  # epoch 2 may be the run's last
    demo._say_epochs(windows, final=True)
    booked = [seconds for e in demo.epochs for seconds in (e.stall_seconds, e.compute_seconds)]
    assert booked == pytest.approx([0.4, 0.5, 0.1, 0.6])
    assert sum(e.compute_seconds for e in demo.epochs) == pytest.approx(0.1 + 0.4 + 0.3 + 0.3)  # every window's


def test_the_final_line_says_the_phase_the_job_ended_in_when_the_gauge_reads_its_end(tmp_path: Path) -> None:
    """After the last step the job's pace is gone and the gauge reads `transition`, as for a stall: the final
    line keeps the gauge's word and says the phase of the windows up to the last step."""
    path = tmp_path / "windows.jsonl"
    lines = [window(100.0, 0.0, 0.5, "steady"), window(100.5, 0.0, 0.3, "steady"),
             window(101.0, 0.0, 0.0, "transition")]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    windows = WindowFile(path, "demo")
    windows.read()
    assert (windows.phase_at(100.9), windows.phase_at(101.5), windows.phase_at(99.0)) == ("steady", "transition", None)
    demo = Demo(Settings(quiet=True, workdir=tmp_path))
    demo.epochs.append(EpochFigures(epoch=1, steps=2, started=100.0, ended=100.95, requests=2, hits=2,
                                    stall_seconds=0.0, compute_seconds=0.8, phases=("steady",)))
    gauge: Samples = {(c.WARMUP_PHASE.name, ((c.JOB_LABEL, "demo"), ("phase", phase))): float(phase == "transition")
                      for phase in ("cold", "transition", "steady")}
    assert demo._after_the_end(gauge, windows) == " (the job ended steady: no step since its last)"
    still_steady = {key: float(dict(key[1])["phase"] == "steady") for key in gauge}
    assert demo._after_the_end(still_steady, windows) == ""


def test_the_epoch_line_gives_its_own_ratios() -> None:
    figures = EpochFigures(epoch=3, steps=80, started=100.0, ended=112.5, requests=160, hits=40, stall_seconds=3.0,
                           compute_seconds=9.0, phases=("cold", "transition"))
    assert epoch_line(figures) == ("  epoch  3   80 steps in  12.5 s  hit  25%  input-bound  25%  "
                                   "phase cold > transition")
    nothing = EpochFigures(1, 2, 0.0, 1.0, 0, 0, 0.0, 0.0, ())
    assert epoch_line(nothing).endswith("hit   -   input-bound   -   phase -")


def test_the_spokes_requests_and_hits_come_from_the_scrape() -> None:
    def requests(result: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return c.SPOKE_REQUESTS.name, (("result", result), ("spoke", "demo-spoke"))

    assert spoke_requests({requests("hit"): 30.0, requests("miss"): 10.0, requests("expired"): 2.0}) == (42.0, 30.0)


def test_the_help_states_the_default_cache_and_the_hubs_bandwidth_per_connection(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    default, outage = Settings(shards=10, shard_mib=1), Settings(shards=10, shard_mib=1, outage=True)
    factor, outage_share = default.cache_bytes / default.dataset_bytes, outage.cache_bytes / outage.dataset_bytes
    assert f"default: {factor:g} times the dataset's size, {outage_share:.0%} of it with --outage" in shown
    assert "bandwidth from the hub, per connection" in shown


def test_the_demo_says_where_its_files_stay_and_how_big(tmp_path: Path) -> None:
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "shard").write_bytes(b"x" * 3_000_000)
    (tmp_path / "report.html").write_bytes(b"y" * 1_000_000)
    assert files_left(tmp_path).startswith(f"files left in {tmp_path}: 4 MB (")
    assert files_left(tmp_path).endswith(f"rm -r {tmp_path} removes them")


def test_a_fetch_whose_client_left_during_an_outage_ends_without_a_traceback(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The spoke gives up on a fetch the outage holds (nginx at its read timeout) and closes it; when the hub
    answers, its write fails, and the demo's terminal must not get the server's traceback for it."""
    (tmp_path / "shard").write_bytes(os.urandom(4 << 20))
    hub = Hub(tmp_path, rtt_seconds=0.0, bandwidth_bytes_per_second=1e9).start()
    try:
        hub.cut_for(0.5)
        address = urlsplit(hub.url)
        with socket.create_connection((address.hostname, address.port)) as client:
            client.sendall(b"GET /shard HTTP/1.1\r\nHost: hub\r\n\r\n")
        hub.wait_out_outage()
        deadline = time.monotonic() + 5.0
        while hub.requests == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the handler's writes meet the closed connection
        assert hub.requests == 1
    finally:
        hub.close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_hub_cut_to_refuse_closes_each_request_unanswered_after_a_round_trip(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`--outage-refuses`: a GET (and the probe's HEAD) while the hub refuses ends, a round trip after it was sent,
    with the connection closed and no reply (nginx answers its client 502), quietly; once the cut ends, it is
    answered again."""
    (tmp_path / "shard").write_bytes(b"x" * 1024)
    hub = Hub(tmp_path, rtt_seconds=0.05, bandwidth_bytes_per_second=1e9).start()
    address = urlsplit(hub.url)

    def ask(method: str) -> tuple[bytes, float]:
        with socket.create_connection((address.hostname, address.port), timeout=5) as client:
            sent = time.monotonic()
            client.sendall(f"{method} /shard HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\r\n".encode())
            reply = b""
            while chunk := client.recv(65536):
                reply += chunk
            return reply, time.monotonic() - sent

    try:
        hub.cut_for(2.0, refuse=True)
        for method in ("GET", "HEAD"):
            reply, took = ask(method)
            assert reply == b"" and 0.05 <= took < 1.0, (method, reply, took)
        while hub.in_outage():
            time.sleep(0.05)
        reply, _ = ask("GET")
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"x" * 1024)
    finally:
        hub.close()
    assert "Traceback" not in capfd.readouterr().err
