"""What idle GPU time and hub bytes cost: a dated table of public list prices, the flags that pick or override them.

No price is looked up on a network: the table below is what the sources said on the date it gives (docs/cost.md
has the table, its sources and the formulas). A platform with its own rates passes them as flags. The agent
(its correlator prices the series it publishes) and `stallwatch report` take the same flags from here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from stallwatch.flags import bounded_float

GB = 1e9  # providers price egress per GB (10^9 bytes); GCP's per GiB is within 7 % of it


@dataclass(frozen=True)
class ListPrice:
    dollars: float  # per GPU-hour, or per GB
    source: str
    read_on: str  # the date the source was read (UTC)


# On-demand $/GPU-hour, AWS us-east-1 (the instance's hourly price over its GPUs: CPUs, memory and disks come with it).
GPU_DOLLARS_PER_HOUR: dict[str, ListPrice] = {
    "H100": ListPrice(6.88, "AWS p5.48xlarge, 8 x H100 80GB: $55.04/h", "2026-11-09"),
    "A100-80GB": ListPrice(3.4309, "AWS p4de.24xlarge, 8 x A100 80GB: $27.447/h", "2026-11-09"),
    "A100-40GB": ListPrice(2.7447, "AWS p4d.24xlarge, 8 x A100 40GB: $21.958/h", "2026-11-09"),
    "L4": ListPrice(0.8048, "AWS g6.xlarge, 1 x L4: $0.8048/h", "2026-11-09"),
}
# $/GB from the hub to the spoke, by where the two are: first-tier list prices (AWS and GCP agree on these).
EGRESS_DOLLARS_PER_GB: dict[str, ListPrice] = {
    "same_region": ListPrice(0.01, "AWS and GCP: across zones of one region", "2026-12-05"),
    "same_continent": ListPrice(0.02, "AWS and GCP: between regions of one continent", "2026-12-05"),
    "inter_continent": ListPrice(0.08, "GCP: between continents (NA, EU, Asia), the dearest common pair", "2026-12-05"),
    "internet": ListPrice(0.09, "AWS: out to the internet, first 10 TB a month", "2026-12-05"),
}
DEFAULT_GPU_TYPE = "H100"
DEFAULT_REGION_PAIR = "same_continent"  # a hub one region away: the case the warm-up is about
SET_BY_FLAG = "set by flag"


@dataclass(frozen=True)
class Prices:
    """The prices that turn idle GPU-seconds and hub bytes into dollars, and where they came from."""

    gpu_type: str = DEFAULT_GPU_TYPE
    region_pair: str = DEFAULT_REGION_PAIR
    gpu_dollars_per_hour: float = GPU_DOLLARS_PER_HOUR[DEFAULT_GPU_TYPE].dollars
    egress_dollars_per_gb: float = EGRESS_DOLLARS_PER_GB[DEFAULT_REGION_PAIR].dollars
    gpu_read_on: str = GPU_DOLLARS_PER_HOUR[DEFAULT_GPU_TYPE].read_on  # or SET_BY_FLAG
    egress_read_on: str = EGRESS_DOLLARS_PER_GB[DEFAULT_REGION_PAIR].read_on

    def gpu_cost(self, gpu_seconds: float) -> float:
        return gpu_seconds * self.gpu_dollars_per_hour / 3600

    def egress_cost(self, hub_bytes: float) -> float:
        return hub_bytes / GB * self.egress_dollars_per_gb


def chosen(gpu_type: str = DEFAULT_GPU_TYPE, region_pair: str = DEFAULT_REGION_PAIR,
           gpu_dollars_per_hour: float | None = None, egress_dollars_per_gb: float | None = None) -> Prices:
    """The table's prices for the GPU type and region pair, each replaced by its own figure when one is given."""
    gpu, egress = GPU_DOLLARS_PER_HOUR[gpu_type], EGRESS_DOLLARS_PER_GB[region_pair]
    return Prices(
        gpu_type, region_pair,
        gpu.dollars if gpu_dollars_per_hour is None else gpu_dollars_per_hour,
        egress.dollars if egress_dollars_per_gb is None else egress_dollars_per_gb,
        gpu.read_on if gpu_dollars_per_hour is None else SET_BY_FLAG,
        egress.read_on if egress_dollars_per_gb is None else SET_BY_FLAG,
    )


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """`--prices.*`, the same in the agent and `stallwatch report`."""
    dollars = bounded_float(0, 1e6)
    group.add_argument("--prices.gpu-type", dest="prices_gpu_type", choices=sorted(GPU_DOLLARS_PER_HOUR),
                       default=DEFAULT_GPU_TYPE, help="GPU whose list price an idle GPU-second costs (default: "
                       "%(default)s; table and dates in docs/cost.md)")
    group.add_argument("--prices.gpu-dollars-per-hour", dest="prices_gpu_dollars_per_hour", type=dollars,
                       default=None, metavar="DOLLARS", help="your own price of a GPU-hour, instead of the table's")
    group.add_argument("--prices.region-pair", dest="prices_region_pair", choices=sorted(EGRESS_DOLLARS_PER_GB),
                       default=DEFAULT_REGION_PAIR,
                       help="where the hub is from the spoke, for the egress list price (default: %(default)s)")
    group.add_argument("--prices.egress-dollars-per-gb", dest="prices_egress_dollars_per_gb", type=dollars,
                       default=None, metavar="DOLLARS",
                       help="your own price of a GB (10^9 bytes) from the hub, instead of the table's")


def from_options(options: argparse.Namespace) -> Prices:
    return chosen(options.prices_gpu_type, options.prices_region_pair, options.prices_gpu_dollars_per_hour,
                  options.prices_egress_dollars_per_gb)
