"""How long after an event its window's results are scrapeable: a probe beside a real agent's load.

A probe rank (job `probe`) sends one step every `STEP_EVERY_S` through the real client, each with
exactly `COMPUTE_NS` of compute, and a scraper reads the agent's /metrics every `SCRAPE_EVERY_S`.
The correlator's `stallwatch_compute_seconds_total{job="probe"}` divided by `COMPUTE_NS` is how many probe steps
its published windows hold; windows close in event-time order, so those are the earliest steps, and
a step's delay is the time of the first scrape that counts it minus its event time (its compute end,
the time the correlator windows it by). Both clocks are this node's monotonic clock. The scrape
period bounds the resolution: delays are measured up to `SCRAPE_EVERY_S` long.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
import urllib.request

from stallwatch.catalogue import COMPUTE_SECONDS, JOB_LABEL

STEP_EVERY_S = 0.02
COMPUTE_NS = 1_000_000
SCRAPE_EVERY_S = 0.2  # a fast Prometheus scrape; scraping faster would load the agent it measures
# Correlator series carry their window's wall-clock timestamp after the value.
PROBE_SERIES = re.compile(rf'^{COMPUTE_SECONDS.name}\{{rank="0",{JOB_LABEL}="probe"\}} (\S+)(?: \S+)?$', re.MULTILINE)


class ResultDelayProbe:
    """Start it beside the load, `stop()` it before the agent stops, then read `delays_s()`."""

    def __init__(self, url: str, socket_path: str) -> None:
        from stallwatch.client import transport, wire

        self._url = url
        self._channel = transport.configure(socket_path).channel(wire.Source("probe", 0))
        self._event_times: list[int] = []
        self._seen: list[tuple[int, int]] = []  # (scrape time, probe steps published)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, daemon=True),
                         threading.Thread(target=self._scrape, daemon=True)]
        for thread in self._threads:
            thread.start()

    def _send(self) -> None:
        batch = 0
        while not self._stop.wait(STEP_EVERY_S):
            end = time.monotonic_ns()
            self._channel.step((batch, end - 2 * COMPUTE_NS, end - COMPUTE_NS, end, -1))  # ready unknown
            self._event_times.append(end)
            batch += 1

    def _scrape(self) -> None:
        while not self._stop.wait(SCRAPE_EVERY_S):
            try:
                with urllib.request.urlopen(self._url, timeout=10) as reply:
                    text = reply.read().decode()
            except OSError:
                continue
            found = PROBE_SERIES.search(text)
            if found:
                self._seen.append((time.monotonic_ns(), round(float(found.group(1)) * 1e9 / COMPUTE_NS)))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=15)

    def delays_s(self) -> list[float]:
        """Per probe step that a scrape counted, seconds from its event time to that scrape."""
        delays, counted = [], 0
        for scraped_ns, published in self._seen:
            for event_ns in self._event_times[counted:min(published, len(self._event_times))]:
                delays.append((scraped_ns - event_ns) / 1e9)
            counted = max(counted, min(published, len(self._event_times)))
        return delays


def summary(delays: list[float]) -> dict[str, float]:
    if len(delays) < 2:
        return {"steps": len(delays)}
    cuts = statistics.quantiles(delays, n=100)
    return {"steps": len(delays), "p50_s": round(statistics.median(delays), 3), "p90_s": round(cuts[89], 3),
            "p99_s": round(cuts[98], 3), "max_s": round(max(delays), 3)}
