"""Registers the `correlator` collector: its agent-only flags, and a factory building the live correlator.

Only the registration lives here, next to the other collectors, so the agent's flags and
`--collector.correlator` come from the same table; the correlator itself is `stallwatch.correlator`,
and the flags it shares with `stallwatch correlate` are `stallwatch.correlator.settings`.
An event consumer: the agent builds it first and hands its `submit` to every other collector as their sink.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from stallwatch import prices
from stallwatch.correlator import settings
from stallwatch.correlator.live import DEFAULT_BACKLOG_EVENTS, LiveCorrelator
from stallwatch.exporters.collector import CollectorContext, register_event_consumer
from stallwatch.flags import positive_int

log = logging.getLogger("stallwatch.agent")


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    settings.add_arguments(group, "correlator.")
    group.add_argument("--correlator.backlog-limit", dest="correlator_backlog_limit", type=positive_int,
                       default=DEFAULT_BACKLOG_EVENTS, metavar="EVENTS",
                       help="events queued for the correlator; past it whole batches are dropped and counted "
                       "(default: %(default)s)")
    group.add_argument("--correlator.record-events", dest="correlator_record_events", default=None, metavar="PATH",
                       help="also write every incoming batch to PATH, for `stallwatch correlate PATH`")
    prices.add_arguments(group)


def _from_context(context: CollectorContext) -> LiveCorrelator:
    """The receiver's label caps and expiry (`--events.rank-limit`, `--events.expire-after`) hold for the
    correlator's series too, and a job retires from the warm-up tracker after the same idle time. Reads cross
    a spoke only on a node with a spoke collector on."""
    options = context.options
    shared = settings.from_options(options)
    warmup = dataclasses.replace(shared.warmup, expiry_s=options.events_expire_after)
    spoke = any(value for name, value in vars(options).items() if name.startswith("collector_spoke_"))
    if not spoke:
        log.info("no spoke collector is on: reads without a verdict of their own are booked direct_read")
    return LiveCorrelator(
        dataclasses.replace(shared, warmup=warmup, spoke=spoke),
        job_names=context.jobs.name,
        spokes=context.spokes,
        windows_path=options.correlator_record_windows,
        events_path=options.correlator_record_events,
        max_backlog_events=options.correlator_backlog_limit,
        rank_limit=options.events_rank_limit,
        expire_after_s=options.events_expire_after,
        prices=prices.from_options(options),
        gpu_names=context.gpus.name_of,
    )


register_event_consumer("correlator", True,
                        "stall attribution, GPU idle, warm-up and cache what-if from the event stream",
                        _from_context, _add_arguments)
