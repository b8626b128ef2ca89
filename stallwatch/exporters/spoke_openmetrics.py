"""The `spoke_openmetrics` collector: a cache that already exposes Prometheus/OpenMetrics counters.

JuiceFS, Alluxio and Qumulo publish their own metrics; a small YAML mapping
(`stallwatch.exporters.openmetrics_mapping`) says which source sample becomes which of our catalogue's
spoke metrics. `--spoke_openmetrics.mapping` takes a built-in mapping's name (juicefs, alluxio, qumulo)
or a path to a file of the same shape; `spoke` is set from `--spoke_openmetrics.name`.

The endpoint is scraped on each of the agent's scrapes, with a timeout and a size limit; only the
families the mapping reads are parsed, at most 10,000 lines of them. A failed scrape yields no spoke
values that time (none of the body, not even its valid part) and counts the reason in
`stallwatch_spoke_collector_errors_total`: the fetch's (`openmetrics_scrape.http_get`) or the body's,
parse_error, too_many_series, duplicate_family (a family or series written twice), invalid_value (NaN,
infinite, a negative count) or invalid_histogram (a NaN or negative bound, no +Inf, decreasing counts).
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import Metric

from stallwatch.exporters.collector import CollectorContext, SourceUnavailableError, register_collector
from stallwatch.exporters.openmetrics_mapping import (
    BUILTIN_MAPPINGS,
    Rule,
    SourceMapping,
    load_mapping,
    mapping_text,
)
from stallwatch.exporters.openmetrics_scrape import HttpGet, ScrapeError, http_get
from stallwatch.exporters.spokes import collector_errors
from stallwatch.flags import positive_float

log = logging.getLogger(__name__)


class OpenMetricsSpokeCollector:
    def __init__(
        self,
        url: str,
        rules: Iterable[Rule],
        spoke: str,
        *,
        timeout: float = 2.0,
        headers: Mapping[str, str] | None = None,
        get: HttpGet = http_get,
    ) -> None:
        self._url, self._mapping, self._spoke = url, SourceMapping(rules), spoke
        self._timeout, self._headers, self._get = timeout, dict(headers or {}), get
        self._errors: Counter[str] = Counter()

    def collect(self) -> Iterator[Metric]:
        try:
            mapped = self._mapping.families(self._get(self._url, self._headers, self._timeout), self._spoke)
        except ScrapeError as error:
            if not self._errors[error.reason]:
                log.warning("spoke %s: %s (counted from now on)", self._spoke, error)
            self._errors[error.reason] += 1
            yield collector_errors(self._spoke, self._errors)
            raise SourceUnavailableError(self._spoke) from error
        yield from mapped
        yield collector_errors(self._spoke, self._errors)

    def close(self) -> None:
        pass


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--spoke_openmetrics.url", dest="spoke_openmetrics_url", metavar="URL",
                       default="http://127.0.0.1:9567/metrics",
                       help="the cache's metrics endpoint (default: %(default)s, JuiceFS's)")
    group.add_argument("--spoke_openmetrics.mapping", dest="spoke_openmetrics_mapping", default="juicefs",
                       metavar="NAME|PATH", help=f"built-in mapping ({', '.join(BUILTIN_MAPPINGS)}) or a YAML "
                       "file (default: %(default)s)")
    group.add_argument("--spoke_openmetrics.name", dest="spoke_openmetrics_name", default="openmetrics",
                       metavar="NAME", help="the spoke label of its metrics (default: %(default)s)")
    group.add_argument("--spoke_openmetrics.timeout", dest="spoke_openmetrics_timeout", type=positive_float,
                       default=2.0, metavar="SECONDS", help="scrape timeout (default: %(default)s)")


def _from_context(context: CollectorContext) -> OpenMetricsSpokeCollector:
    options = context.options
    text, origin = mapping_text(options.spoke_openmetrics_mapping)
    return OpenMetricsSpokeCollector(
        options.spoke_openmetrics_url, load_mapping(text, origin), options.spoke_openmetrics_name,
        timeout=options.spoke_openmetrics_timeout,
    )


register_collector("spoke_openmetrics", False, "caches with their own Prometheus endpoint (JuiceFS, Alluxio, "
                   "Qumulo), mapped onto spoke metrics", _from_context, _add_arguments)
