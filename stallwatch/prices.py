"""What idle GPU time and hub bytes cost: a dated table of public list prices, the flags that pick or override them.

No price is looked up on a network: the table below is what the sources said on the date it gives (docs/cost.md
has the table, its sources and the formulas). A platform with its own rates passes them as flags. The agent
(its correlator prices the series it publishes) and `stallwatch report` take the same flags from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
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
# `--prices.gpu-type auto`: each GPU at the list price of its type as NVML names it (the agent), DEFAULT_GPU_TYPE
# for a GPU the table has no type for, or where no name is known (a window file).
AUTO = "auto"
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
    by_gpu_name: bool = False  # `auto`: `for_gpu` prices each GPU at its own type's list price

    def for_gpu(self, nvml_name: str) -> Prices:
        """These prices for a GPU NVML names so: under `auto` its type's list price (these, still `auto`, for a
        name the table has no type for), else these."""
        gpu_type = gpu_type_of(nvml_name) if self.by_gpu_name else None
        if gpu_type is None:
            return self
        listed = GPU_DOLLARS_PER_HOUR[gpu_type]
        return dataclasses.replace(self, gpu_type=gpu_type, gpu_dollars_per_hour=listed.dollars,
                                   gpu_read_on=listed.read_on, by_gpu_name=False)

    def gpu_cost(self, gpu_seconds: float) -> float:
        return gpu_seconds * self.gpu_dollars_per_hour / 3600

    def egress_cost(self, hub_bytes: float) -> float:
        return hub_bytes / GB * self.egress_dollars_per_gb


def gpu_type_of(nvml_name: str) -> str | None:
    """The table's type for a GPU as NVML names it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA
    L4"); None for one the table has no price for (an L40S is not an L4)."""
    name = nvml_name.upper()
    if "H100" in name:
        return "H100"
    if "A100" in name:
        return "A100-80GB" if "80G" in name else "A100-40GB"
    return "L4" if re.search(r"\bL4\b", name) else None


def chosen(gpu_type: str = AUTO, region_pair: str = DEFAULT_REGION_PAIR,
           gpu_dollars_per_hour: float | None = None, egress_dollars_per_gb: float | None = None) -> Prices:
    """The table's prices for the GPU type and region pair, each replaced by its own figure when one is given.
    `auto` starts from DEFAULT_GPU_TYPE and prices each GPU by its name (`Prices.for_gpu`) unless a price is given."""
    listed = DEFAULT_GPU_TYPE if gpu_type == AUTO else gpu_type
    gpu, egress = GPU_DOLLARS_PER_HOUR[listed], EGRESS_DOLLARS_PER_GB[region_pair]
    return Prices(
        listed, region_pair,
        gpu.dollars if gpu_dollars_per_hour is None else gpu_dollars_per_hour,
        egress.dollars if egress_dollars_per_gb is None else egress_dollars_per_gb,
        gpu.read_on if gpu_dollars_per_hour is None else SET_BY_FLAG,
        egress.read_on if egress_dollars_per_gb is None else SET_BY_FLAG,
        by_gpu_name=gpu_type == AUTO and gpu_dollars_per_hour is None,
    )


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """`--prices.*`, the same in the agent and `stallwatch report`."""
    dollars = bounded_float(0, 1e6)
    group.add_argument("--prices.gpu-type", dest="prices_gpu_type", choices=[AUTO, *sorted(GPU_DOLLARS_PER_HOUR)],
                       default=AUTO, help="GPU whose list price an idle GPU-second costs (default: %(default)s, each "
                       f"GPU's own type as NVML names it, {DEFAULT_GPU_TYPE} for a type the table lacks or where no "
                       "name is known; table and dates in docs/cost.md)")
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
