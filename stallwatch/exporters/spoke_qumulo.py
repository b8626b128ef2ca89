"""The `spoke_qumulo` collector: a Qumulo portal spoke, through its REST API's OpenMetrics endpoint.

`GET /v2/metrics/endpoints/default/data` with `Authorization: Bearer <token>` returns the cluster's
metrics; the built-in `qumulo` mapping turns them into spoke metrics (cached bytes of the spoke).
Qumulo keeps no hit/miss counter, so pair this with `spoke_nfs` on the clients' mounts.

The token (a long-lived access token from `/v1/auth/access-tokens/`) comes from a file or an
environment variable, is read again on every attempt so a rotated token is picked up, and is never
logged nor put in a metric. TLS is verified (system CAs, or `--spoke_qumulo.ca-file`). A failed
scrape backs off exponentially (up to `--spoke_qumulo.max-backoff`) so an unreachable or refusing
cluster is not hammered at every Prometheus scrape.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client.core import Metric

from stallwatch.exporters.collector import CollectorContext, SourceUnavailableError, register_collector
from stallwatch.exporters.config import ConfigError
from stallwatch.exporters.openmetrics_mapping import Rule, SourceMapping, load_mapping, mapping_text
from stallwatch.exporters.openmetrics_scrape import HttpGet, ScrapeError, http_get
from stallwatch.exporters.spokes import collector_errors
from stallwatch.flags import positive_float

log = logging.getLogger(__name__)

METRICS_PATH = "/v2/metrics/endpoints/default/data"


def token_source(path: str | None, env: str | None) -> Callable[[], str]:
    """A function returning the current token; a missing token is a ScrapeError, not a crash."""

    def read() -> str:
        if path:
            try:
                token = Path(path).read_text().strip()
            except OSError as error:
                raise ScrapeError("no_token", f"cannot read token file {path}: {error.strerror}") from error
        else:
            token = os.environ.get(env or "", "").strip()
        if not token:
            raise ScrapeError("no_token", f"empty token ({'file ' + path if path else 'environment ' + str(env)})")
        return token

    return read


class QumuloSpokeCollector:
    def __init__(
        self,
        base_url: str,
        token: Callable[[], str],
        spoke: str,
        rules: Iterable[Rule],
        *,
        timeout: float = 5.0,
        max_backoff: float = 300.0,
        get: HttpGet = http_get,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = base_url.rstrip("/") + METRICS_PATH
        self._token, self._spoke, self._mapping = token, spoke, SourceMapping(rules)
        self._timeout, self._max_backoff, self._get, self._clock = timeout, max_backoff, get, clock
        self._errors: Counter[str] = Counter()
        self._failures = 0
        self._next_attempt = 0.0

    def collect(self) -> Iterator[Metric]:
        if self._clock() >= self._next_attempt:
            try:
                headers = {"Authorization": f"Bearer {self._token()}", "Accept": "text/plain"}
                mapped = self._mapping.families(self._get(self._url, headers, self._timeout), self._spoke)
            except ScrapeError as error:
                self._failed(error)
            else:
                self._failures, self._next_attempt = 0, 0.0
                yield from mapped
        yield collector_errors(self._spoke, self._errors)
        if self._failures:  # the last attempt failed, now or before a backoff that has not run out
            raise SourceUnavailableError(self._spoke)

    def close(self) -> None:
        pass

    def _failed(self, error: ScrapeError) -> None:
        reason = "unauthorized" if str(error).startswith(("HTTP 401", "HTTP 403")) else error.reason
        self._errors[reason] += 1
        self._failures += 1
        delay = min(self._max_backoff, 2.0 ** (self._failures - 1))
        self._next_attempt = self._clock() + delay
        # The message names the URL and the reason, never the request's headers.
        log.warning("spoke %s: %s; next attempt in %.0f s", self._spoke, error, delay)


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--spoke_qumulo.url", dest="spoke_qumulo_url", metavar="URL", default=None,
                       help="the cluster's REST API, e.g. https://qumulo:8000 (required with the collector)")
    group.add_argument("--spoke_qumulo.token-file", dest="spoke_qumulo_token_file", metavar="PATH",
                       help="file holding an access token (preferred over the environment)")
    group.add_argument("--spoke_qumulo.token-env", dest="spoke_qumulo_token_env", default="QUMULO_TOKEN",
                       metavar="NAME", help="environment variable holding the token (default: %(default)s)")
    group.add_argument("--spoke_qumulo.ca-file", dest="spoke_qumulo_ca_file", metavar="PATH",
                       help="CA bundle to verify the cluster's certificate (default: the system's)")
    group.add_argument("--spoke_qumulo.name", dest="spoke_qumulo_name", default="qumulo", metavar="NAME",
                       help="the spoke label of its metrics (default: %(default)s)")
    group.add_argument("--spoke_qumulo.timeout", dest="spoke_qumulo_timeout", type=positive_float, default=5.0,
                       metavar="SECONDS", help="request timeout (default: %(default)s)")
    group.add_argument("--spoke_qumulo.max-backoff", dest="spoke_qumulo_max_backoff", type=positive_float,
                       default=300.0, metavar="SECONDS",
                       help="longest wait between attempts after failures (default: %(default)s)")


def _from_context(context: CollectorContext) -> QumuloSpokeCollector:
    options = context.options
    if not options.spoke_qumulo_url:
        raise ConfigError("--spoke_qumulo.url is required: the cluster's address, e.g. https://qumulo:8000")
    tls = ssl.create_default_context(cafile=options.spoke_qumulo_ca_file)
    return QumuloSpokeCollector(
        options.spoke_qumulo_url,
        token_source(options.spoke_qumulo_token_file, options.spoke_qumulo_token_env),
        options.spoke_qumulo_name,
        load_mapping(*mapping_text("qumulo")),
        timeout=options.spoke_qumulo_timeout,
        max_backoff=options.spoke_qumulo_max_backoff,
        get=functools.partial(http_get, context=tls),
    )


register_collector("spoke_qumulo", False, "Qumulo portal spoke through its REST API's metrics endpoint",
                   _from_context, _add_arguments)
