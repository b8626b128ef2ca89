"""The `spoke_varnish` collector: a Varnish spoke, from `varnishstat -j` counters.

Read on each scrape (`varnishstat -j` answers in milliseconds from shared memory):
- MAIN.cache_hit, MAIN.cache_miss -> requests by result hit / miss (a hit-for-miss lookup,
  MAIN.cache_hitmiss, goes on to Varnish's miss step, where it is counted as a miss: not added again);
- MAIN.backend_fail -> hub errors; MAIN.n_lru_nuked -> evictions;
- storage gauges (SMA.* for malloc, SMF.* for file, Transient excluded: it holds uncacheable
  objects) -> cache size (g_bytes) and capacity (g_bytes + g_space).
Varnish's counters have no per-request timing or bytes by source; per-request events would need
varnishncsa, which this collector does not read.
Both JSON layouts are accepted: Varnish 6.5+ nests counters under "counters", older ones do not.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import Metric

from stallwatch import catalogue
from stallwatch.exporters.collector import CollectorContext, SourceUnavailableError, register_collector
from stallwatch.exporters.spokes import collector_errors

log = logging.getLogger(__name__)

RunStat = Callable[[Sequence[str], float], str]


def run_varnishstat(command: Sequence[str], timeout: float) -> str:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, check=True).stdout


def counter_values(text: str) -> dict[str, float]:
    """`varnishstat -j` output -> {"MAIN.cache_hit": 12, ...}; ValueError when it is not that."""
    document = json.loads(text)
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    counters: Mapping[str, Any] = document.get("counters", document)
    if not isinstance(counters, dict):
        raise ValueError("'counters' is not a JSON object")
    values = {name: float(entry["value"]) for name, entry in counters.items()
              if isinstance(entry, dict) and "value" in entry}
    if "MAIN.cache_hit" not in values:
        raise ValueError("no MAIN.cache_hit counter")
    return values


def _is_cache_storage(name: str) -> bool:
    kind, _, rest = name.partition(".")
    return kind in ("SMA", "SMF") and not rest.startswith("Transient.")


class VarnishSpokeCollector:
    def __init__(self, spoke: str = "varnish", instance: str | None = None, *, timeout: float = 5.0,
                 varnishstat: str = "varnishstat", run: RunStat = run_varnishstat) -> None:
        self._spoke, self._timeout, self._run = spoke, timeout, run
        self._command = [varnishstat, "-j", *(["-n", instance] if instance else [])]
        self._errors: Counter[str] = Counter()

    def collect(self) -> Iterator[Metric]:
        values = self._values()
        if values is not None:
            yield from self._families(values)
        yield collector_errors(self._spoke, self._errors)
        if values is None:
            raise SourceUnavailableError(self._spoke)

    def _values(self) -> Mapping[str, float] | None:
        """varnishstat's counters; None, counted, when it failed or answered what cannot be read."""
        try:
            return counter_values(self._run(self._command, self._timeout))
        except (OSError, subprocess.SubprocessError) as error:
            self._count("varnishstat_failed", error)
        except (ValueError, TypeError, KeyError) as error:
            self._count("parse_error", error)
        return None

    def close(self) -> None:
        pass

    def _families(self, values: Mapping[str, float]) -> Iterator[Metric]:
        c, spoke = catalogue, self._spoke
        requests = c.SPOKE_REQUESTS.family()
        requests.add_metric([spoke, "hit"], values["MAIN.cache_hit"])
        requests.add_metric([spoke, "miss"], values.get("MAIN.cache_miss", 0.0))
        hub_errors, evictions = c.SPOKE_HUB_ERRORS.family(), c.SPOKE_EVICTIONS.family()
        hub_errors.add_metric([spoke], values.get("MAIN.backend_fail", 0.0))
        evictions.add_metric([spoke], values.get("MAIN.n_lru_nuked", 0.0))
        used = sum(v for k, v in values.items() if _is_cache_storage(k) and k.endswith(".g_bytes"))
        free = sum(v for k, v in values.items() if _is_cache_storage(k) and k.endswith(".g_space"))
        size, capacity = c.SPOKE_CACHE_SIZE.family(), c.SPOKE_CACHE_CAPACITY.family()
        size.add_metric([spoke], used)
        capacity.add_metric([spoke], used + free)
        yield from (requests, hub_errors, evictions, size, capacity)

    def _count(self, reason: str, error: Exception) -> None:
        if not self._errors[reason]:
            log.warning("spoke %s: %s: %s (counted from now on)", self._spoke, " ".join(self._command), error)
        self._errors[reason] += 1


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--spoke_varnish.instance", dest="spoke_varnish_instance", metavar="NAME|DIR",
                       help="varnishd's -n working directory (default: varnishstat's default)")
    group.add_argument("--spoke_varnish.name", dest="spoke_varnish_name", default="varnish", metavar="NAME",
                       help="the spoke label of its metrics (default: %(default)s)")
    group.add_argument("--spoke_varnish.varnishstat", dest="spoke_varnish_varnishstat", default="varnishstat",
                       metavar="PATH", help="the varnishstat program (default: %(default)s)")


def _from_context(context: CollectorContext) -> VarnishSpokeCollector:
    options = context.options
    return VarnishSpokeCollector(options.spoke_varnish_name, options.spoke_varnish_instance,
                                 varnishstat=options.spoke_varnish_varnishstat)


register_collector("spoke_varnish", False, "Varnish spoke, from varnishstat -j counters", _from_context,
                   _add_arguments)
