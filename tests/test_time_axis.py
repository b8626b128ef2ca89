"""One time axis: a long stall is booked in the windows it spans, a job's window is published once the job's
timeline is complete there, and published series carry their windows' wall-clock times."""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from stallwatch.catalogue import CAUSES
from stallwatch.client import wire
from stallwatch.correlator.hold import Publication, WindowHold
from stallwatch.correlator.live import LiveCorrelator
from stallwatch.correlator.pipeline import CorrelatorPipeline, Watermark
from stallwatch.correlator.results import WindowResult
from stallwatch.correlator.settings import CorrelatorSettings
from stallwatch.correlator.wallclock import wall_offset_ns
from stallwatch.correlator.windowfile import WindowFileWriter
from stallwatch.demo.stack import query, start_prometheus
from stallwatch.eventbatch import SCHEMAS, EventBatch, Verdict
from stallwatch.exporters.collector import ScrapeCollector
from stallwatch.exporters.web import MetricsServer
from stallwatch.harness import free_port, wait_for
from stallwatch.report.render import render_html
from stallwatch.report.windows import run_from_windows
from stallwatch.scraper import SCRAPER
from tests.conftest import ROOT, require_binary
from tests.scenarios.generator import BASE_NS

S = 10**9
REMOTE, PREPROCESS = (CAUSES.index(cause) for cause in ("remote_fetch", "preprocess"))
# The windows these cases are drawn on (the defaults are shorter: the cases read more easily on 5 s).
FIVE_S = CorrelatorSettings(window_s=5.0, lateness_s=5.0)


def ns(seconds: float) -> int:
    return BASE_NS + round(seconds * S)


def steps(job: int, rank: int, rows: list[tuple[float, float, float]], first_batch: int = 0) -> EventBatch:
    """Steps of one rank: (wait start, wait end, compute end) in seconds."""
    n = len(rows)
    column = [np.array([ns(row[i]) for row in rows], dtype=np.int64) for i in range(3)]
    return EventBatch("step", {"job": np.full(n, job, np.int32), "rank": np.full(n, rank, np.int32),
                               "gpu": np.full(n, rank, np.int16),
                               "batch": np.arange(first_batch, first_batch + n, dtype=np.int64),
                               "wait_start_ns": column[0], "wait_end_ns": column[1], "compute_end_ns": column[2],
                               "ready_ns": np.full(n, -1, np.int64)})


def regular(job: int, rank: int, start_s: float, end_s: float, first_batch: int = 0) -> EventBatch:
    """Steps every 0.1 s with a 0.5 ms wait (below the 1 ms stall threshold): no stall."""
    starts = np.arange(start_s, end_s - 1e-9, 0.1)
    return steps(job, rank, [(t, t + 0.0005, t + 0.1) for t in starts], first_batch)


def reads(batches: list[int], starts_s: list[float], ends_s: list[float], verdict: int = Verdict.MISS,
          nbytes: int = 4096, job: int = 0, rank: int = 0) -> EventBatch:
    """A read by worker 0 of each batch, from its start to its end, of `nbytes` (0: a fetch that failed)."""
    n = len(batches)
    return EventBatch("read", {"job": np.full(n, job, np.int32), "rank": np.full(n, rank, np.int32),
                               "worker": np.zeros(n, np.int16), "batch": np.array(batches, np.int64),
                               "key": np.array(batches, np.uint64), "bytes": np.full(n, nbytes, np.int64),
                               "start_ns": np.array([ns(t) for t in starts_s], np.int64),
                               "end_ns": np.array([ns(t) for t in ends_s], np.int64),
                               "verdict": np.full(n, verdict, np.int8)})


def miss(job: int, rank: int, batch: int, start_s: float, end_s: float) -> EventBatch:
    return reads([batch], [start_s], [end_s], job=job, rank=rank)


def gpu_idle_while(start_s: float, end_s: float, until_s: float) -> EventBatch:
    """GPU 0 sampled every 0.5 s: idle (0 %) within [start_s, end_s], busy otherwise."""
    ts = np.arange(0.5, until_s + 1e-9, 0.5)
    util = np.where((ts > start_s) & (ts <= end_s), 0.0, 1.0).astype(np.float32)
    return EventBatch("gpu_util", {"ts_ns": np.array([ns(t) for t in ts], np.int64),
                                   "period_ns": np.full(ts.size, S // 2, np.int64),
                                   "gpu": np.zeros(ts.size, np.int16), "util": util})


def in_time_order(batches: list[EventBatch]) -> list[EventBatch]:
    """The batches cut into 1 s slices by event time, as they would arrive."""
    sliced = []
    for batch in batches:
        times = batch.columns[SCHEMAS[batch.kind].event_time]
        for second in np.unique((times - BASE_NS) // S):
            keep = (times - BASE_NS) // S == second
            sliced.append((int(second), EventBatch(batch.kind, {k: c[keep] for k, c in batch.columns.items()})))
    return [batch for _, batch in sorted(sliced, key=lambda item: item[0])]


def in_flight(job: int, rank: int, since_s: float, until_s: float, state: int, batch: int = -1,
              worker: int = -1) -> EventBatch:
    """What a source reports open at its flushes every 0.2 s from `since_s` until `until_s`."""
    as_of = np.arange(since_s + 0.1, until_s, 0.2)
    n = as_of.size
    return EventBatch("open", {"job": np.full(n, job, np.int32), "rank": np.full(n, rank, np.int32),
                               "gpu": np.full(n, rank, np.int16), "worker": np.full(n, worker, np.int16),
                               "state": np.full(n, state, np.int8), "batch": np.full(n, batch, np.int64),
                               "key": np.full(n, max(batch, 0), np.uint64), "since_ns": np.full(n, ns(since_s)),
                               "as_of_ns": np.array([ns(t) for t in as_of], np.int64)})


def outage_run(reported_open: bool = False) -> tuple[list[WindowResult], list[Publication]]:
    """One rank stepping every 0.1 s, but waiting 30 s (2 s to 32 s) for one batch whose read missed
    until 31.5 s; its GPU idles through the wait. 5 s windows. With `reported_open`, the trainer and its
    worker report the wait, the batch and the read open at their flushes, as the client does."""
    results: list[WindowResult] = []
    published: list[Publication] = []
    hold = WindowHold(60.0, [published.append], wall_offset=lambda: 0)
    correlator = CorrelatorPipeline(FIVE_S, listeners=[results.append, hold.add])
    reports = [in_flight(0, 0, 2.0, 32.0, wire.OPEN_WAIT), in_flight(0, 0, 2.0, 31.5, wire.OPEN_READ, 20, 0),
               in_flight(0, 0, 2.0, 32.0, wire.OPEN_BATCH, 20, 0)] if reported_open else []
    correlator.run(in_time_order([gpu_idle_while(2.0, 32.0, 45.0), regular(0, 0, 0.0, 2.0), miss(0, 0, 20, 2.0, 31.5),
                                  steps(0, 0, [(2.0, 32.0, 32.1)], first_batch=20),
                                  regular(0, 0, 32.1, 45.0, first_batch=21), *reports]))
    hold.flush()
    return results, published


def by_window(parts: list[WindowResult]) -> dict[float, np.ndarray]:
    """Stall seconds by cause per window start (seconds), over the given results and pieces."""
    totals: dict[float, np.ndarray] = defaultdict(lambda: np.zeros(len(CAUSES)))
    for part in parts:
        for row in part.ranks:
            totals[round((part.start_ns - BASE_NS) / S, 3)] += row.stall_s
    return dict(totals)


def test_a_30_s_stall_is_booked_in_the_windows_it_spans_and_each_piece_sums_to_itself() -> None:
    results, published = outage_run()
    # The step arrives at 32.1 s, before [25, 30) closes, but its batch was handed over at 32 s, past that
    # close's watermark (30 s): its read might still be on its way, so [30, 35), the step's own window, books
    # the wait, its pieces in the earlier windows alongside.
    booked_in = next(r for r in results if r.earlier)
    assert (booked_in.start_ns - BASE_NS) / S == 30.0
    assert [(p.start_ns - BASE_NS) / S for p in booked_in.earlier] == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0]
    assert sum(r.steps for p in booked_in.earlier for r in p.ranks) == 0  # the step counts in its own window
    pieces = by_window([p for r in results for p in (r, *r.earlier)])
    want = {0.0: 3.0, 5.0: 5.0, 10.0: 5.0, 15.0: 5.0, 20.0: 5.0, 25.0: 5.0, 30.0: 2.0}
    for start, seconds in want.items():
        assert pieces[start].sum() == pytest.approx(seconds, abs=1e-6), start
    # Each piece by its own reads: the miss covers every piece but the last half second of the wait, in which
    # the worker, its read done, is still busy with the batch.
    assert pieces[25.0][REMOTE] == pytest.approx(5.0) and pieces[30.0][REMOTE] == pytest.approx(1.5)
    assert pieces[30.0][PREPROCESS] == pytest.approx(0.5)
    # What is published agrees: every window once, the pieces in their own windows, stall <= wait there.
    starts = [(p.result.start_ns - BASE_NS) / S for p in published]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    out = by_window([p.result for p in published])
    for start, seconds in want.items():
        assert out[start].sum() == pytest.approx(seconds, abs=1e-6), start
    for p in published:
        (row,) = p.result.ranks
        assert sum(row.stall_s) <= row.wait_s + 1e-9
        assert row.wait_s <= (p.result.end_ns - p.result.start_ns) / S + 1e-9
    # The GPU idles in each window for the part of the stall there, and the job stalled as long.
    for start, seconds in want.items():
        assert sum(sum(g.idle_s) for p in published for g in p.result.gpus
                   if (p.result.start_ns - BASE_NS) / S == start) == pytest.approx(seconds, abs=0.01), start
        (job,) = next(p.result.jobs for p in published if (p.result.start_ns - BASE_NS) / S == start)
        assert job.stalled_s == pytest.approx(seconds, abs=1e-6)


def test_a_stall_reported_open_is_booked_and_published_as_each_of_its_windows_closes() -> None:
    results, published = outage_run(reported_open=True)
    # Every window of the wait books its own part when it closes (no piece is left for the step's window to
    # book in earlier ones), from what is in flight: the read of the awaited batch open for seconds, a miss.
    assert not any(r.earlier for r in results)
    pieces = by_window(results)
    want = {0.0: 3.0, 5.0: 5.0, 10.0: 5.0, 15.0: 5.0, 20.0: 5.0, 25.0: 5.0, 30.0: 2.0}
    for start, seconds in want.items():
        assert pieces[start].sum() == pytest.approx(seconds, abs=1e-6), start
    for start in (5.0, 10.0, 15.0, 20.0, 25.0):
        assert pieces[start][REMOTE] == pytest.approx(5.0), start
    # The same totals as booking the stall once its step arrived (the outage_run test above).
    after, _ = outage_run()
    for start, split in by_window([p for r in after for p in (r, *r.earlier)]).items():
        assert split == pytest.approx(pieces[start], abs=1e-6), start
    # Each window goes out at its own close: the hold does not wait for a rank whose wait is booked.
    closes = [(r.start_ns - BASE_NS) / S for r in results]
    starts = [(p.result.start_ns - BASE_NS) / S for p in published]
    assert starts == closes
    assert sum(sum(g.idle_s) for p in published for g in p.result.gpus) == pytest.approx(30.0, abs=0.01)


def test_a_wait_open_longer_than_the_ranks_are_remembered_keeps_its_batch_and_its_cause() -> None:
    """A rank waits 150 s (2 s to 152 s), past twice the retention, after which a rank that took no step is
    forgotten as gone. Its worker 0 reads the awaited batch 20 throughout; worker 1, which handed batch 19 over
    before the wait and reports so at every flush, reads batch 21. The rank is waiting, not gone: every window
    of the wait books it to the open read of batch 20 (remote_fetch), never to batch 19's handover (delivery)."""
    results: list[WindowResult] = []
    correlator = CorrelatorPipeline(FIVE_S, listeners=[results.append])
    reports = [in_flight(0, 0, 2.0, 152.0, wire.OPEN_WAIT), in_flight(0, 0, 2.0, 151.5, wire.OPEN_READ, 20, 0),
               in_flight(0, 0, 2.0, 152.0, wire.OPEN_BATCH, 20, 0),
               in_flight(0, 0, 1.9, 152.0, wire.OPEN_HANDED, 19, 1), in_flight(0, 0, 2.0, 152.0, wire.OPEN_READ, 21, 1)]
    correlator.run(in_time_order([gpu_idle_while(2.0, 152.0, 165.0), regular(0, 0, 0.0, 2.0),
                                  miss(0, 0, 20, 2.0, 151.5), steps(0, 0, [(2.0, 152.0, 152.1)], first_batch=20),
                                  regular(0, 0, 152.1, 165.0, first_batch=21), *reports]))
    pieces = by_window(results)
    assert sum(split.sum() for split in pieces.values()) == pytest.approx(150.0, abs=1e-6)
    for start in np.arange(5.0, 150.0, 5.0):
        assert pieces[start][REMOTE] == pytest.approx(5.0), (start, pieces[start])


@pytest.mark.parametrize("outage_s", [30.0, 60.0, 600.0])
def test_the_window_file_draws_an_open_stall_where_the_gpu_idles(outage_s: float, tmp_path: Path) -> None:
    """Default windows (0.5 s); a hub outage of 30 s, 60 s or 10 min reported open as it lasts: the report's
    stall (one rank: at most one stall-second a second) lies on the windows where the GPU idles, all of it
    `remote_fetch`."""
    cut, back = 2.0, 2.0 + outage_s
    end = back + 5.0
    writer = WindowFileWriter(tmp_path / "windows.jsonl")
    hold = WindowHold(60.0, [writer.write], wall_offset=lambda: 0)
    retired: list[float] = []  # when the job was taken for gone (its series would go, its counters restart)
    correlator = CorrelatorPipeline(CorrelatorSettings(), listeners=[hold.add, lambda r: retired.extend(
        [(r.end_ns - BASE_NS) / S] * len(r.retired_jobs))])
    correlator.run(in_time_order([
        gpu_idle_while(cut, back, end), regular(0, 0, 0.0, cut), miss(0, 0, 20, cut, back - 0.5),
        steps(0, 0, [(cut, back, back + 0.1)], first_batch=20), regular(0, 0, back + 0.1, end, first_batch=21),
        in_flight(0, 0, cut, back, wire.OPEN_WAIT), in_flight(0, 0, cut, back - 0.5, wire.OPEN_READ, 20, 0),
        in_flight(0, 0, cut, back, wire.OPEN_BATCH, 20, 0)]))
    hold.flush()
    writer.close()
    assert not retired  # a rank seen waiting is alive, however long it waits (jobs expire after 120 s without)
    run = run_from_windows(tmp_path / "windows.jsonl")
    remote = run.stall_by_cause["remote_fetch"]
    t = remote.t - (BASE_NS / S)  # the window file's times are the events' (wall offset 0)
    during = (t > cut + 0.25) & (t < back - 0.75)  # whole windows in the wait before the read's end
    assert remote.v[during] == pytest.approx(1.0)
    assert not remote.v[(t < cut) | (t > back + 0.25)].any()
    assert max(series.v.max() for series in run.stall_by_cause.values()) <= 1.0 + 1e-9
    # The GPU idled through the whole wait: its idle seconds are the stall's, split as the stall is.
    assert sum(run.gpu_stall_idle_seconds.values()) == pytest.approx(outage_s, abs=0.1)
    assert run.gpu_stall_idle_seconds["remote_fetch"] == pytest.approx(outage_s - 0.5, abs=0.1)
    total = sum(float(np.sum(series.v)) * 0.5 for series in run.stall_by_cause.values())
    assert total == pytest.approx(outage_s, abs=1e-6)


def test_fetches_that_fail_through_an_outage_do_not_make_a_warm_cache_cold() -> None:
    """A job steady on hits (0 to 20 s) waits 20 s for the hub (20 to 40 s), its worker's fetch failing every 2 s
    (the spoke's miss ends with an error, no bytes), then hits again. A failed fetch says the hub is out, not
    that the cache is cold: no window of the outage calls the job cold."""
    results: list[WindowResult] = []
    correlator = CorrelatorPipeline(CorrelatorSettings(), listeners=[results.append])

    def fetches(first: int, ends_s: list[float], verdict: int, nbytes: int = 4096) -> EventBatch:
        return reads(list(range(first, first + len(ends_s))), [t - 0.05 for t in ends_s], ends_s, verdict, nbytes)

    hits_before = [t + 0.09 for t in np.arange(0.0, 20.0, 0.1)]
    retries = list(np.arange(22.0, 40.0, 2.0))
    hits_after = [t + 0.09 for t in np.arange(40.1, 50.0, 0.1)]
    correlator.run(in_time_order([
        regular(0, 0, 0.0, 20.0), fetches(0, hits_before, Verdict.HIT), fetches(200, retries, Verdict.MISS, 0),
        steps(0, 0, [(20.0, 40.0, 40.1)], first_batch=200), regular(0, 0, 40.1, 50.0, first_batch=201),
        fetches(201, hits_after, Verdict.HIT)]))
    phases = {(r.start_ns - BASE_NS) / S: job.phase for r in results for job in r.jobs}
    assert phases[19.5] == "steady"
    assert not [start for start, phase in phases.items() if start > 10.0 and phase == "cold"], phases


def backoff_run(next_key: int) -> tuple[list[WindowResult], list[Publication]]:
    """One rank waiting 30 s (2 s to 32 s) for batch 20, reported open as the client does. Its worker's fetch of
    key 20 fails fast every second (5 ms, no bytes: a spoke answering for an unreachable hub, which latency alone
    calls a hit), sleeping 1 s between tries, until at 30.5 s it reads key `next_key` of the batch: a miss until
    31.5 s, then half a second of decoding."""
    results: list[WindowResult] = []
    published: list[Publication] = []
    hold = WindowHold(60.0, [published.append], wall_offset=lambda: 0)
    correlator = CorrelatorPipeline(FIVE_S, listeners=[results.append, hold.add])
    tries = [2.0 + k * 1.005 for k in range(29)]
    failed = reads([20] * len(tries), tries, [t + 0.005 for t in tries], Verdict.HIT, nbytes=0)
    last = reads([20], [30.5], [31.5])
    last.columns["key"][:] = next_key
    reports = [in_flight(0, 0, 2.0, 32.0, wire.OPEN_WAIT), in_flight(0, 0, 2.0, 32.0, wire.OPEN_BATCH, 20, 0)]
    correlator.run(in_time_order([regular(0, 0, 0.0, 2.0), failed, last, steps(0, 0, [(2.0, 32.0, 32.1)], 20),
                                  regular(0, 0, 32.1, 45.0, first_batch=21), *reports]))
    hold.flush()
    return results, published


def test_the_back_off_between_failed_fetches_is_booked_remote_fetch_while_it_lasts() -> None:
    """The worker sleeping between fetches that fail is waiting on the hub: `remote_fetch`, as the outage goes
    on and in total, not `preprocess` (the sleeps) or `cache_read` (the failures, fast)."""
    results, published = backoff_run(next_key=20)
    live = by_window([p.result for p in published if p.result.end_ns <= ns(30.0)])
    for start in (5.0, 10.0, 15.0, 20.0, 25.0):  # published before the stall ended, each window whole
        assert live[start][REMOTE] == pytest.approx(5.0, abs=1e-6), (start, live[start])
    total = np.sum(list(by_window(results).values()), axis=0)
    assert total[REMOTE] == pytest.approx(29.5, abs=1e-6)
    assert total[PREPROCESS] == pytest.approx(0.5, abs=1e-6)
    assert total.sum() == pytest.approx(30.0, abs=1e-6)


def test_both_the_window_file_and_its_report_count_the_failed_fetches(tmp_path: Path) -> None:
    """The correlator counts each job's reads that got no bytes in its rows, the window file keeps them, and the
    report says how many failed: what tells the outage from a cold cache."""
    results, published = backoff_run(next_key=20)
    assert sum(job.failed_reads for result in results for job in result.jobs) == 29
    writer = WindowFileWriter(tmp_path / "windows.jsonl")
    for publication in published:
        writer.write(publication)
    writer.close()
    run = run_from_windows(tmp_path / "windows.jsonl")
    assert run.failed_reads == 29
    assert "Failed reads: 29 reads got no bytes" in render_html(run)


def test_a_failed_fetch_given_up_for_another_read_is_only_its_own_time() -> None:
    """When the worker reads another key after the last failure (it skipped the sample), its time in between was its
    own work: the failures are misses, the gap after the last one `preprocess`."""
    _, published = backoff_run(next_key=21)
    closed = [p.result for p in published if p.result.start_ns >= ns(30.0)]
    total = np.sum(list(by_window([p.result for p in published]).values()), axis=0)
    assert by_window(closed)[30.0][PREPROCESS] == pytest.approx(0.5 + (30.5 - (2.0 + 28 * 1.005 + 0.005)), abs=1e-6)
    assert total.sum() == pytest.approx(30.0, abs=1e-6)


def test_a_rank_whose_loop_ended_is_not_waited_for() -> None:
    published: list[Publication] = []
    hold = WindowHold(60.0, [published.append], wall_offset=lambda: 0)
    correlator = CorrelatorPipeline(FIVE_S, listeners=[hold.add], event_time_watermark=False)
    ended = in_flight(0, 0, 7.3, 7.5, wire.OPEN_ENDED)
    for batch in (regular(0, 0, 0.0, 7.3), ended):
        correlator.emit(batch)
    correlator.emit(Watermark(ns(10.0)))
    assert _job_windows(published, 0) == [0.0, 5.0]  # the last window too, although the rank is silent since


def test_a_stall_within_its_window_is_booked_whole_there() -> None:
    results: list[WindowResult] = []
    correlator = CorrelatorPipeline(FIVE_S, listeners=[results.append])
    correlator.run([regular(0, 0, 0.0, 6.0), miss(0, 0, 99, 6.0, 6.3), steps(0, 0, [(6.0, 6.4, 6.5)], 99),
                    regular(0, 0, 6.5, 12.0, first_batch=100)])
    assert not any(r.earlier for r in results)
    pieces = by_window(results)
    assert pieces[5.0][REMOTE] == pytest.approx(0.3) and pieces[5.0][PREPROCESS] == pytest.approx(0.1)
    assert pieces[0.0].sum() == 0 and pieces[10.0].sum() == 0


def _job_windows(published: list[Publication], job: int) -> list[float]:
    return [(p.result.start_ns - BASE_NS) / S for p in published if job in p.result.job_ids()]


def test_a_jobs_window_waits_for_its_silent_rank_and_another_jobs_does_not() -> None:
    published: list[Publication] = []
    hold = WindowHold(60.0, [published.append], wall_offset=lambda: 0)
    correlator = CorrelatorPipeline(FIVE_S, listeners=[hold.add])
    # Job 0: rank 0 steps on; rank 1 waits from 10.5 s to 40 s for one batch. Job 1 steps on.
    batches = [regular(0, 0, 0.0, 60.0), regular(1, 0, 0.0, 60.0), regular(0, 1, 0.0, 10.5)]
    for batch in in_time_order([_until(batch, 30.0) for batch in batches]):
        correlator.emit(batch)  # events to just before 30 s: windows up to [15, 20) close
    assert _job_windows(published, 1) == [0.0, 5.0, 10.0, 15.0]
    assert _job_windows(published, 0) == [0.0, 5.0]  # rank 1 is known up to 10.5 s only
    assert hold.held(0) == [ns(t) for t in (10.0, 15.0)]
    correlator.run(in_time_order([steps(0, 1, [(10.5, 40.0, 40.1)], first_batch=100),
                                  regular(0, 1, 40.1, 60.0, first_batch=101),
                                  *(_from(batch, 30.0) for batch in batches)]))
    hold.flush()
    assert _job_windows(published, 0) == [5.0 * k for k in range(13)]  # each once, in order
    stalled = {(p.result.start_ns - BASE_NS) / S: sum(sum(r.stall_s) for r in p.result.ranks if r.rank == 1)
               for p in published if 0 in p.result.job_ids()}
    assert stalled[10.0] == pytest.approx(4.5)  # the pieces landed in the held windows
    assert all(stalled[t] == pytest.approx(5.0) for t in (15.0, 20.0, 25.0, 30.0, 35.0))
    assert sum(stalled.values()) == pytest.approx(29.5)


def test_the_hold_limit_releases_a_window_whose_rank_never_returns() -> None:
    released_at: dict[float, float] = {}  # window start -> the end of the window whose close released it (s)
    closing = [0]

    def note(publication: Publication) -> None:
        if 0 in publication.result.job_ids():
            released_at[(publication.result.start_ns - BASE_NS) / S] = (closing[0] - BASE_NS) / S

    hold = WindowHold(20.0, [note], wall_offset=lambda: 0)
    correlator = CorrelatorPipeline(FIVE_S, listeners=[lambda r: closing.__setitem__(0, r.end_ns),
                                                                     hold.add])
    correlator.emit(regular(0, 1, 0.0, 10.5))  # rank 1 stops at 10.5 s and never returns
    for start in range(0, 60):
        correlator.emit(regular(0, 0, start, start + 1.0, first_batch=10 * start))
    assert released_at[0.0] == 5.0 and released_at[5.0] == 10.0  # at once: both ranks known past their ends
    assert released_at[10.0] == 35.0 and released_at[15.0] == 35.0  # rank 1 waited for until 20 s of silence
    assert released_at[35.0] == 40.0  # then no longer


def _until(batch: EventBatch, seconds: float) -> EventBatch:
    keep = batch.columns["compute_end_ns"].astype(np.int64) < ns(seconds)
    return EventBatch(batch.kind, {name: column[keep] for name, column in batch.columns.items()})


def _from(batch: EventBatch, seconds: float) -> EventBatch:
    keep = batch.columns["compute_end_ns"].astype(np.int64) >= ns(seconds)
    return EventBatch(batch.kind, {name: column[keep] for name, column in batch.columns.items()})


Series = tuple[str, tuple[tuple[str, str], ...]]


def _scrape(registry: CollectorRegistry) -> dict[Series, list[tuple[float, float | None]]]:
    """Every sample of the scrape as (value, timestamp in unix seconds), by series, in order."""
    samples: dict[Series, list[tuple[float, float | None]]] = defaultdict(list)
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))].append((s.value, _seconds(s.timestamp)))
    return samples


def _seconds(stamp: Any) -> float | None:
    """A parsed sample's timestamp as unix seconds (the text format's are floats already)."""
    return None if stamp is None else float(stamp)


def test_published_series_carry_their_windows_wall_clock_times_rising_and_held_windows_reach_one_scrape() -> None:
    clock = [ns(0.0)]
    service = LiveCorrelator(CorrelatorSettings(window_s=1.0, lateness_s=0.5), clock_ns=lambda: clock[0],
                             start=False)
    registry = CollectorRegistry()
    registry.register(service)
    stall = ("stallwatch_stall_seconds_total", (("cause", "other"), ("rank", "0"), ("training_job", "0")))
    seen: list[tuple[float, float]] = []
    per_scrape: list[int] = []
    # Steps every 0.1 s to 3 s, then a 3 s wait (3 s to 6 s, no reads: "other"), then steps to 10 s.
    timeline = [regular(0, 0, 0.0, 3.0), steps(0, 0, [(3.0, 6.0, 6.1)], 30), regular(0, 0, 6.1, 10.0, 31)]
    for second in range(1, 10):
        for batch in timeline:  # what the ranks sent by now
            part = _from(_until(batch, second + 0.6), second - 0.4)
            if len(part):
                service.submit(part)
        clock[0] = ns(second + 0.6)  # windows ending at or before `second` close
        service.drain()
        offset = wall_offset_ns()
        samples = _scrape(registry)
        per_scrape.append(len(samples.get(stall, [])))
        for value, stamp in samples.get(stall, []):
            assert stamp is not None
            seen.append((stamp - offset / S, value))
        windows = samples[("stallwatch_correlator_windows_total", ())]
        assert [stamp for _, stamp in windows] == [None]  # operational: stamped by Prometheus at the scrape
    # Each window's sample at its end on the wall clock, the held windows of the stall too; times never go
    # back, and a time sent again (nothing new published) has the same value: Prometheus drops it.
    times = [round((t - BASE_NS / S), 2) for t, _ in seen]
    assert times == sorted(times)
    booked: dict[float, float] = {}
    for at, (_, value) in zip(times, seen, strict=True):
        assert booked.setdefault(at, value) == value
    assert set(booked) >= {1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0}
    assert max(per_scrape) >= 3  # [3, 4) to [5, 6), held for the stall, went out in one scrape
    for end in (4.0, 5.0, 6.0):
        assert booked[end] == pytest.approx(end - 3.0, abs=1e-3)  # the stall's seconds up to each window end
    assert booked[8.0] == pytest.approx(3.0, abs=1e-3)


def _step_now(rank_batch: int, wait_start_ns: int, wait_end_ns: int, compute_end_ns: int) -> EventBatch:
    column = {name: np.array([value], np.int64) for name, value in
              (("wait_start_ns", wait_start_ns), ("wait_end_ns", wait_end_ns), ("compute_end_ns", compute_end_ns))}
    return EventBatch("step", {"job": np.zeros(1, np.int32), "rank": np.zeros(1, np.int32),
                               "gpu": np.zeros(1, np.int16), "batch": np.array([rank_batch], np.int64), **column,
                               "ready_ns": np.full(1, -1, np.int64)})


def test_a_stalls_seconds_land_in_a_real_prometheus_at_their_event_time(tmp_path: Path) -> None:
    """A live correlator (1 s windows) on a real HTTP endpoint, scraped every second by a real Prometheus; a
    rank steps every 50 ms, then waits 3 s. Stored at their windows' times, the stall's seconds rise through
    the wait (each sample counts the stall up to its time), not after it: within 1 s of the event time."""
    prometheus_bin = require_binary("prometheus", "prometheus")
    service = LiveCorrelator(CorrelatorSettings(window_s=1.0, lateness_s=0.5), tick_s=0.05)
    registry = CollectorRegistry()
    registry.register(service)
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    prom = start_prometheus(prometheus_bin, tmp_path / "prometheus", [f"127.0.0.1:{port}"], [])
    try:
        batch = 0

        def step_for(seconds: float) -> None:
            nonlocal batch
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                now = time.monotonic_ns()
                service.submit(_step_now(batch, now - 50_000_000, now - 49_900_000, now))  # 0.1 ms wait
                batch += 1
                time.sleep(0.05)

        step_for(4.0)
        stall_start = time.monotonic_ns()
        time.sleep(3.0)
        stall_end = time.monotonic_ns()
        service.submit(_step_now(batch, stall_start, stall_end, stall_end + 10_000_000))
        batch += 1
        step_for(5.0)
        series = 'stallwatch_stall_seconds_total{cause="other",training_job="0",rank="0"}'
        wait_for("the stall in Prometheus", lambda: _samples(prom.url, series)[-1][1] >= 2.99, 30)
        samples = _samples(prom.url, series)
        counters = requests.get(f"{prom.url}/metrics", timeout=10).text
    finally:
        prom.close()
        server.shutdown()
        service.close()
    stall_s = (stall_end - stall_start) / S
    start_wall = (stall_start + wall_offset_ns()) / S  # both clocks as they run now: the offset barely moves
    for at, value in samples:  # each sample counts the stall up to its own time (its window's end)
        assert value == pytest.approx(min(max(at - start_wall, 0.0), stall_s), abs=0.02), (at - start_wall, value)
    during = [at - start_wall for at, value in samples if 0.0 < value < stall_s - 0.02]
    assert len(during) >= 2 and min(during) <= 1.0  # first booked within 1 s of the stall's start
    reached = next(at - start_wall for at, value in samples if value >= stall_s - 0.02)
    # All of it booked within 1 s of its end. `reached` is the first sample within 20 ms of the whole stall, and a
    # sample counts the stall up to its own time: one up to 20 ms before the stall's end qualifies (a CI run's did,
    # 4.6 ms before), so that is its earliest.
    assert stall_s - 0.02 <= reached <= stall_s + 1.0
    # Every sample was taken: nothing out of order, no timestamp sent again with another value.
    for rejected in ("prometheus_target_scrapes_sample_out_of_order_total",
                     "prometheus_target_scrapes_sample_duplicate_timestamp_total"):
        assert re.search(rf"^{rejected} 0$", counters, re.MULTILINE), rejected


def _samples(prometheus: str, series: str) -> list[tuple[float, float]]:
    """The series' raw samples of the last 5 minutes as Prometheus stored them: (unix time, value)."""
    reply = query(prometheus, f"{series}[5m]")["data"]["result"]
    return [(float(at), float(value)) for at, value in reply[0]["values"]] if reply else [(0.0, 0.0)]


def step_handed_over_at(job: int, rank: int, batch: int, wait: tuple[float, float, float],
                        ready_s: float) -> EventBatch:
    one = steps(job, rank, [wait], batch)
    return EventBatch("step", {**one.columns, "ready_ns": np.array([ns(ready_s)], np.int64)})


@pytest.mark.parametrize("wait_end", [5.4, 6.4])
def test_a_buffered_step_stalled_across_the_closing_edge_is_booked_at_once_once_its_batch_was_handed_over(
        wait_end: float) -> None:
    """Rank 0 waits from 4.6 s for batch 46, whose first read ended at 4.5 s and whose second misses from 4.7 s
    until 0.05 s before the batch is handed over, 0.05 s before the wait ends; the step is at hand when [0, 5)
    closes (5 s windows, 1 s lateness). Handed over at 5.35 s, by that close's watermark (5.9 s), every read of
    the batch is in: the wait up to 5 s is booked at once and [0, 5) goes out at its own close. Handed over at
    6.35 s, past the watermark (5.5 s), the second read may still be on its way (here it arrives after the
    close): the first read alone would call the wait preprocessing, so [0, 5) waits for [5, 10) to close.
    Either way the stall is booked once, split at 5 s, the miss as remote fetch on both sides."""
    released_by: dict[float, float] = {}
    closing = [0]
    results: list[WindowResult] = []

    def note(publication: Publication) -> None:
        released_by[(publication.result.start_ns - BASE_NS) / S] = (closing[0] - BASE_NS) / S

    hold = WindowHold(60.0, [note], wall_offset=lambda: 0)
    correlator = CorrelatorPipeline(CorrelatorSettings(window_s=5.0, lateness_s=1.0),
                                    listeners=[lambda r: closing.__setitem__(0, r.end_ns), results.append, hold.add])
    handed_over = wait_end - 0.05
    batches = [regular(0, 0, 0.0, 4.6), step_handed_over_at(0, 0, 46, (4.6, wait_end, wait_end + 0.1), handed_over),
               regular(0, 0, wait_end + 0.1, 12.0, 47), miss(0, 0, 45, 4.0, 4.1), miss(0, 0, 46, 4.2, 4.5),
               miss(0, 0, 46, 4.7, handed_over - 0.05)]
    correlator.run(in_time_order(batches))
    hold.flush()
    assert released_by[0.0] == (5.0 if wait_end < 6.0 else 10.0)
    pieces = by_window([p for r in results for p in (r, *r.earlier)])
    assert pieces[0.0].sum() == pytest.approx(0.4) and pieces[5.0].sum() == pytest.approx(wait_end - 5.0)
    assert pieces[0.0][REMOTE] == pytest.approx(0.3)
    assert pieces[5.0][REMOTE] == pytest.approx(wait_end - 5.0 - 0.1)
    steps_by_window = {(r.start_ns - BASE_NS) / S: sum(row.steps for row in r.ranks) for r in results}
    assert steps_by_window[0.0] == 46  # the stalled step counts once, in its own window
    assert sum(steps_by_window.values()) == sum(len(b) for b in batches if b.kind == "step")


def test_no_shipped_scrape_configuration_turns_honor_timestamps_off() -> None:
    """The correlator's series are stored at their timestamps only while Prometheus honours them (its default)."""
    shipped = [ROOT / "helm/stallwatch/templates/servicemonitor.yaml", ROOT / "helm/stallwatch/values.yaml",
               ROOT / "stallwatch/demo/stack.py", *ROOT.glob("deploy/**/*.y*ml")]
    for path in shipped:
        assert not re.search(r"honor_?timestamps\W+false", path.read_text(), re.IGNORECASE), path


def gpu_busy_except(start_s: float, end_s: float, stamps: list[float]) -> EventBatch:
    """GPU 0 sampled at `stamps`, each sample the busy share since the one before: idle within [start_s, end_s]."""
    begins = [0.0, *stamps[:-1]]
    util = [1.0 - max(0.0, min(ts, end_s) - max(begin, start_s)) / (ts - begin)
            for begin, ts in zip(begins, stamps, strict=True)]
    return EventBatch("gpu_util", {"ts_ns": np.array([ns(t) for t in stamps], np.int64),
                                   "period_ns": np.full(len(stamps), S // 4, np.int64),
                                   "gpu": np.zeros(len(stamps), np.int16), "util": np.array(util, np.float32)})


@pytest.mark.parametrize("gpu_gap_s", [2.0, 0.0])
def test_a_window_waits_for_the_gpu_sample_after_a_driver_gap(gpu_gap_s: float) -> None:
    """Rank 0 waits from 2.2 s to 2.9 s; GPU 0 is sampled every 0.25 s but the driver skips 2.75 s to 3.75 s, so
    the sample at 4 s covers 2.5 s to 4 s. 1 s windows, 0.5 s lateness: [2, 3) is due once events reach 3.5 s,
    before that sample arrives. Waiting for it, the GPU idles the whole 0.7 s of the stall; not waiting
    (`gpu_gap_s=0`), the 0.4 s the late sample covers are lost for good."""
    results: list[WindowResult] = []
    settings = CorrelatorSettings(window_s=1.0, lateness_s=0.5, gpu_gap_s=gpu_gap_s)
    correlator = CorrelatorPipeline(settings, listeners=[results.append])
    stamps = [0.25 * k for k in range(1, 25) if not 2.5 < 0.25 * k < 4.0]
    correlator.run(in_time_order([regular(0, 0, 0.0, 2.2), steps(0, 0, [(2.2, 2.9, 3.0)], 22),
                                  regular(0, 0, 3.0, 6.0, 23), miss(0, 0, 22, 2.2, 2.85),
                                  gpu_busy_except(2.2, 2.9, stamps)]))
    idle = sum(sum(g.idle_s) for r in results for part in (r, *r.earlier) for g in part.gpus)
    stalled = sum(sum(row.stall_s) for r in results for part in (r, *r.earlier) for row in part.ranks)
    assert stalled == pytest.approx(0.7)
    assert idle == pytest.approx(0.7 if gpu_gap_s else 0.3, abs=1e-3)


def _openmetrics_scrape(registry: CollectorRegistry, scraper: str) -> dict[Series, list[tuple[float, float | None]]]:
    """`_scrape` in the OpenMetrics format (whose parser insists each series' samples are together), as
    `scraper`."""
    samples: dict[Series, list[tuple[float, float | None]]] = defaultdict(list)
    token = SCRAPER.set(scraper)
    try:
        body = openmetrics_latest(registry).decode()
    finally:
        SCRAPER.reset(token)
    for family in openmetrics_families(body):
        for s in family.samples:
            stamp = None if s.timestamp is None else float(s.timestamp)
            samples[(s.name, tuple(sorted(s.labels.items())))].append((s.value, stamp))
    return samples


def test_every_scraper_gets_every_window_in_a_valid_openmetrics_exposition() -> None:
    """Two scrapers (an HA pair of Prometheus replicas) at different paces, one of them away for a while:
    each gets every window's sample of the stall counter once, in time order, and the exposition parses as
    OpenMetrics with several windows of one series in it."""
    clock = [ns(0.0)]
    service = LiveCorrelator(CorrelatorSettings(window_s=1.0, lateness_s=0.5), clock_ns=lambda: clock[0],
                             start=False)
    registry = CollectorRegistry()
    registry.register(service)
    stall = ("stallwatch_stall_seconds_total", (("cause", "other"), ("rank", "0"), ("training_job", "0")))
    stored: dict[str, list[float]] = {"a": [], "b": []}  # what each scraper's Prometheus keeps: rising times
    timeline = [regular(0, 0, 0.0, 3.0), steps(0, 0, [(3.0, 6.0, 6.1)], 30), regular(0, 0, 6.1, 12.0, 31)]
    for second in range(1, 12):
        for batch in timeline:
            part = _from(_until(batch, second + 0.6), second - 0.4)
            if len(part):
                service.submit(part)
        clock[0] = ns(second + 0.6)
        service.drain()
        scrapers = ["a"] + (["b"] if second % 3 == 0 or second == 11 else [])  # b every third second
        for scraper in scrapers:
            stamps = [stamp for _, stamp in _openmetrics_scrape(registry, scraper)[stall]]
            times = [stamp for stamp in stamps if stamp is not None]
            assert times == sorted(times) and len(times) == len(stamps)
            stored[scraper] += [t for t in times if not stored[scraper] or t > stored[scraper][-1]]
    offset = wall_offset_ns()
    for scraper, times in stored.items():
        window_ends = [round(t - offset / S - BASE_NS / S, 1) for t in times]
        assert window_ends == [float(end) for end in range(1, 12)], (scraper, window_ends)


def test_two_real_prometheus_replicas_each_store_every_window(tmp_path: Path) -> None:
    """The agent's web server scraped every second by two real Prometheus servers (an HA pair: one scrapes
    127.0.0.1, the other 127.0.0.2) and by a third scraper every 0.3 s: both Prometheus store a sample of
    every window the correlator published, the same ones, and none is refused as out of order."""
    prometheus_bin = require_binary("prometheus", "prometheus")
    service = LiveCorrelator(CorrelatorSettings(window_s=1.0, lateness_s=0.5), tick_s=0.05)
    registry = CollectorRegistry()
    registry.register(service)
    server = MetricsServer(registry, "", free_port())
    server.start()
    port = server.url.rsplit(":", 1)[1].split("/")[0]
    replicas = [start_prometheus(prometheus_bin, tmp_path / f"prometheus-{n}", [f"127.0.0.{n}:{port}"], [])
                for n in (1, 2)]
    try:
        batch, until = 0, time.monotonic() + 10.0
        while time.monotonic() < until:
            now = time.monotonic_ns()
            service.submit(_step_now(batch, now - 50_000_000, now - 40_000_000, now))  # a 10 ms stall each
            batch += 1
            requests.get(server.url, headers={"User-Agent": "another-scraper"}, timeout=5)
            time.sleep(0.3)
        series = 'stallwatch_stall_seconds_total{cause="other",training_job="0",rank="0"}'
        # The last windows closed, and both replicas scraped them.
        wait_for("both replicas at the last window", lambda: len({_samples(p.url, series)[-1][1]
                                                                   for p in replicas} | {_last(registry, series)}) == 1,
                 30)
        stored = [_samples(p.url, series) for p in replicas]
        counters = [requests.get(f"{p.url}/metrics", timeout=10).text for p in replicas]
    finally:
        for replica in replicas:
            replica.close()
        server.close()
        service.close()
    windows = [round(at) for at, _ in stored[0]]
    assert windows == sorted(set(windows)) and len(windows) >= 9, stored[0]  # a sample at each window's end
    assert stored[0] == stored[1], "the replicas stored different samples"
    for text in counters:
        for rejected in ("prometheus_target_scrapes_sample_out_of_order_total",
                         "prometheus_target_scrapes_sample_duplicate_timestamp_total"):
            assert re.search(rf"^{rejected} 0$", text, re.MULTILINE), rejected


def _last(registry: CollectorRegistry, series: str) -> float:
    """The series' value as the agent serves it now (to an anonymous scraper)."""
    name, labels = series.split("{")
    pairs = (pair.split("=") for pair in labels.rstrip("}").replace('"', "").split(","))
    return _scrape(registry)[(name, tuple(sorted((key, value) for key, value in pairs)))][-1][0]


def test_collectors_run_in_the_context_of_the_scrape_that_started_them() -> None:
    """The agent's collectors run on threads of their own: each still knows which scraper it serves."""

    class WhoAsks:
        def collect(self) -> Iterator[Metric]:
            family = GaugeMetricFamily("who_asks", "The scraper this collect served.", labels=["scraper"])
            family.add_metric([SCRAPER.get()], 1.0)
            yield family

        def close(self) -> None:
            pass

    scrape = ScrapeCollector({"who": WhoAsks()})
    for scraper in ("10.0.0.1 10.0.0.9 Prometheus/2.42", "10.0.0.2 10.0.0.9 Prometheus/2.42"):
        token = SCRAPER.set(scraper)
        try:
            families = {family.name: family for family in scrape.collect()}
        finally:
            SCRAPER.reset(token)
        assert [s.labels["scraper"] for s in families["who_asks"].samples] == [scraper]


def test_overlapping_scrapes_of_two_scrapers_each_get_their_own_view() -> None:
    """A collector that serves each scraper its own view (`per_scraper`, as the correlator does) is called
    for each scraper even when their scrapes overlap; one that does not shares the running call."""
    release = threading.Event()

    class WhoAsks:
        def __init__(self, per_scraper: bool) -> None:
            self.per_scraper = per_scraper

        def collect(self) -> Iterator[Metric]:
            release.wait(5)  # both scrapes are under way before either call ends
            family = GaugeMetricFamily("who_asks", "The scraper this collect served.", labels=["scraper"])
            family.add_metric([SCRAPER.get()], 1.0)
            yield family

        def close(self) -> None:
            pass

    def served(per_scraper: bool) -> dict[str, list[str]]:
        scrape = ScrapeCollector({"who": WhoAsks(per_scraper)})
        seen: dict[str, list[str]] = {}

        def scrape_as(scraper: str) -> None:
            SCRAPER.set(scraper)  # this thread's own context
            seen[scraper] = [sample.labels["scraper"] for family in scrape.collect() if family.name == "who_asks"
                             for sample in family.samples]

        release.clear()
        threads = [threading.Thread(target=scrape_as, args=(f"10.0.0.{n} 10.0.0.9 Prometheus/2.42",)) for n in (1, 2)]
        for thread in threads:
            thread.start()
            time.sleep(0.2)  # the first one's call is running when the second scrape starts
        release.set()
        for thread in threads:
            thread.join(10)
        return seen

    assert served(per_scraper=True) == {scraper: [scraper] for scraper in ("10.0.0.1 10.0.0.9 Prometheus/2.42",
                                                                            "10.0.0.2 10.0.0.9 Prometheus/2.42")}
    shared = served(per_scraper=False)
    assert shared["10.0.0.2 10.0.0.9 Prometheus/2.42"] == ["10.0.0.1 10.0.0.9 Prometheus/2.42"]
