"""The correlator's settings: the dataclass, its flags with their validation, and `from_options`.

The agent (`--correlator.window`, ...) and `stallwatch correlate` (`--window`, ...) take the same
flags from here, so the two commands cannot drift apart and neither reaches into the other.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from stallwatch.correlator.warmup import WarmupSettings
from stallwatch.flags import bounded_float, byte_size, non_negative_float, positive_float, positive_int


@dataclass(frozen=True)
class CorrelatorSettings:
    window_s: float = 0.5
    lateness_s: float = 1.0
    stall_threshold_s: float = 0.001
    lookback_s: float = 2.0  # how far before a stall a batch's reads are looked for (> any preprocess time)
    retention_s: float = 60.0  # the longest stall whose reads and GPU samples are still at hand
    # How long past the watermark a window waits for a GPU's next utilization sample (drivers skip a
    # second of samples at times; the agent polls every 0.5 s).
    gpu_gap_s: float = 2.0
    # Per kind. Bounds the window store's memory (a read is 51 bytes, about half once merged) and with it
    # each close's working memory: 6 s of events at the nominal 50k events/s, four times the window and
    # lateness, with the lookback; older context is kept while there is room. Past it, a flood's batches
    # are shed and counted.
    max_buffered_events: int = 300_000
    spoke_join_tolerance_s: float = 1.0
    # Whether the node has a spoke for reads to cross (the agent: a spoke collector is on). Without one, a read
    # with no verdict of its own is `direct_read`: a slow local read is not a remote fetch.
    spoke: bool = True
    cache_capacity_bytes: int | None = None
    dataset_bytes: int | None = None  # the size of the dataset the node's jobs read, for the warm-up forecast
    whatif_sample_rate: float = 1.0  # the initial rate: every key until the cap, then it lowers itself
    whatif_max_keys: int = 8192
    warmup: WarmupSettings = field(default_factory=WarmupSettings)


def seconds_to_ns(seconds: float) -> int:
    return round(seconds * 1e9)


def add_arguments(group: argparse._ArgumentGroup, prefix: str) -> None:
    """The flags both commands share; `prefix` is `correlator.` for the agent, empty for `stallwatch correlate`."""
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
    group.add_argument(f"--{prefix}gpu-gap", dest="correlator_gpu_gap", type=non_negative_float,
                       default=defaults.gpu_gap_s, metavar="SECONDS",
                       help="how long past the lateness a window waits for each GPU's next utilization sample "
                       "(default: %(default)s)")
    group.add_argument(f"--{prefix}max-buffered-events", dest="correlator_max_buffered_events", type=positive_int,
                       default=defaults.max_buffered_events, metavar="EVENTS",
                       help="events of each kind the windows hold; past it the oldest used context goes, then "
                       "incoming batches are dropped and counted (default: %(default)s)")
    group.add_argument(f"--{prefix}cache-capacity", dest="correlator_cache_capacity", type=byte_size, default=None,
                       metavar="BYTES", help="the spoke's capacity, for the cache what-if (default: none, no what-if)")
    group.add_argument(f"--{prefix}dataset-size", dest="correlator_dataset_size", type=byte_size, default=None,
                       metavar="BYTES", help="the size of the dataset the jobs read, for the warm-up forecast "
                       "(default: none, the forecast learns the working set from the reuse it sees)")
    group.add_argument(f"--{prefix}whatif-sample-rate", dest="correlator_whatif_sample_rate",
                       type=bounded_float(0, 1, above=True),
                       default=defaults.whatif_sample_rate, metavar="RATIO",
                       help="initial share of keys the what-if samples; it lowers itself once it tracks its cap "
                       "of keys, to bound memory "
                       "(default: %(default)s)")
    group.add_argument(f"--{prefix}warmup-span", dest="correlator_warmup_span", type=positive_float,
                       default=defaults.warmup.span_s, metavar="SECONDS",
                       help="event time the warm-up phases are judged over, in whole windows (default: %(default)s)")
    group.add_argument(f"--{prefix}record-windows", dest="correlator_record_windows", default=None, metavar="PATH",
                       help="append every closed window to PATH as a JSON line")


def from_options(options: argparse.Namespace) -> CorrelatorSettings:
    return CorrelatorSettings(
        window_s=options.correlator_window,
        lateness_s=options.correlator_lateness,
        stall_threshold_s=options.correlator_stall_threshold,
        retention_s=options.correlator_retention,
        gpu_gap_s=options.correlator_gpu_gap,
        max_buffered_events=options.correlator_max_buffered_events,
        cache_capacity_bytes=options.correlator_cache_capacity,
        dataset_bytes=options.correlator_dataset_size,
        whatif_sample_rate=options.correlator_whatif_sample_rate,
        warmup=WarmupSettings(span_s=options.correlator_warmup_span),
    )
