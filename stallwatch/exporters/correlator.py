"""Registers the `correlator` collector: its flags, and a factory building the correlator service.

Only the registration lives here, next to the other collectors, so the agent's flags and
`--collector.correlator` come from the same table; the correlator itself is `stallwatch.correlator`.
The agent builds this collector first and hands its `submit` to every other collector as their sink.
"""

from __future__ import annotations

import argparse

from stallwatch.correlator.correlate import CorrelatorSettings
from stallwatch.correlator.service import DEFAULT_BACKLOG_EVENTS, CorrelatorService
from stallwatch.exporters.collector import CollectorContext, register_collector
from stallwatch.exporters.config import non_negative_float, positive_float, positive_int


def _sample_rate(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _bytes(text: str) -> int:
    value = int(float(text))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {text}")
    return value


def add_settings_arguments(group: argparse._ArgumentGroup, prefix: str) -> None:
    """The pipeline's settings as flags; `prefix` is `correlator.` for the agent, empty offline."""
    defaults = CorrelatorSettings()
    group.add_argument(f"--{prefix}window", dest="correlator_window", type=positive_float,
                       default=defaults.window_s, metavar="SECONDS", help="event-time window (default: %(default)s)")
    group.add_argument(f"--{prefix}lateness", dest="correlator_lateness", type=non_negative_float,
                       default=defaults.lateness_s,
                       metavar="SECONDS", help="how late an event may arrive and still count (default: %(default)s)")
    group.add_argument(f"--{prefix}stall-threshold", dest="correlator_stall_threshold", type=non_negative_float,
                       default=defaults.stall_threshold_s, metavar="SECONDS",
                       help="a loader wait longer than this is a stall (default: %(default)s)")
    group.add_argument(f"--{prefix}retention", dest="correlator_retention", type=positive_float,
                       default=defaults.retention_s, metavar="SECONDS",
                       help="reads and GPU samples kept for long stalls; bounds memory (default: %(default)s)")
    group.add_argument(f"--{prefix}max-buffered-events", dest="correlator_max_buffered_events", type=positive_int,
                       default=defaults.max_buffered_events, metavar="EVENTS",
                       help="events of each kind the windows hold; past it the oldest used context goes, then "
                       "incoming batches are dropped and counted (default: %(default)s)")
    group.add_argument(f"--{prefix}cache-capacity", dest="correlator_cache_capacity", type=_bytes, default=None,
                       metavar="BYTES", help="the spoke's capacity, for the cache what-if (default: none, no what-if)")
    group.add_argument(f"--{prefix}whatif-sample-rate", dest="correlator_whatif_sample_rate", type=_sample_rate,
                       default=defaults.whatif_sample_rate, metavar="RATIO",
                       help="initial share of keys the what-if samples; it lowers itself once it tracks its cap "
                       "of keys, to bound memory "
                       "(default: %(default)s)")
    group.add_argument(f"--{prefix}record", dest="correlator_record", default=None, metavar="PATH",
                       help="append every closed window to PATH as a JSON line")


def settings_from(options: argparse.Namespace) -> CorrelatorSettings:
    return CorrelatorSettings(
        window_s=options.correlator_window,
        lateness_s=options.correlator_lateness,
        stall_threshold_s=options.correlator_stall_threshold,
        retention_s=options.correlator_retention,
        max_buffered_events=options.correlator_max_buffered_events,
        cache_capacity_bytes=options.correlator_cache_capacity,
        whatif_sample_rate=options.correlator_whatif_sample_rate,
    )


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    add_settings_arguments(group, "correlator.")
    group.add_argument("--correlator.spoke-name", dest="correlator_spoke_name", default="default", metavar="NAME",
                       help="spoke label of the what-if (default: %(default)s)")
    group.add_argument("--correlator.backlog-limit", dest="correlator_backlog_limit", type=positive_int,
                       default=DEFAULT_BACKLOG_EVENTS, metavar="EVENTS",
                       help="events queued for the correlator; past it whole batches are dropped and counted "
                       "(default: %(default)s)")
    group.add_argument("--correlator.record-events", dest="correlator_record_events", default=None, metavar="PATH",
                       help="also write every incoming batch to PATH, for `stallwatch correlate PATH`")


def _from_context(context: CollectorContext) -> CorrelatorService:
    options = context.options
    return CorrelatorService(
        settings_from(options),
        job_name=context.jobs.name,
        spoke_name=options.correlator_spoke_name,
        record_path=options.correlator_record,
        events_path=options.correlator_record_events,
        max_backlog_events=options.correlator_backlog_limit,
    )


register_collector("correlator", True, "stall attribution, GPU idle, warm-up and cache what-if from the event stream",
                   _from_context, _add_arguments)
