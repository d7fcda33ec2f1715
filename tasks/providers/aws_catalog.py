"""What EC2 offers in a region: GPU instance types, their spot price statistics, interruption bands.

The live sources are DescribeInstanceTypeOfferings + DescribeInstanceTypes (hardware),
DescribeSpotPriceHistory (prices per type and availability zone), and Service Quotas (vCPU limits
per instance family). Two things the EC2 API does not give come from files shipped under
profiles/: on-demand prices (ec2instances.info snapshot) and interruption bands (the Spot Instance
Advisor feed, same format as AWS publishes it, so a fresh download can replace it).
Both default to the project's copies: profiles/instance-catalog.json (tasks.core.catalog) and
profiles/sources/spot-advisor-data.json.

A spot price archive (the TSV of DescribeSpotPriceHistory rows keyed by AZ id, as in the public
archive) can stand in for the live price API: offline planning, replays, and moto, whose spot
prices are a constant placeholder.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterable

from tasks.core.catalog import CATALOG, SOURCES, load_catalog, network_mbps
from tasks.core.errors import UserInputError, shown
from tasks.core.inputs import read_json, read_text
from tasks.core.limits import positive_float
from tasks.providers.base import InstanceType

LINUX_PRODUCTS = ("Linux/UNIX", "Linux/UNIX (Amazon VPC)")
DEFAULT_SPOT_ADVISOR_PATH = SOURCES / "spot-advisor-data.json"
DEFAULT_INSTANCE_CATALOG_PATH = CATALOG

# Service Quotas codes (service "ec2"), in vCPUs, by instance family group and market.
SPOT_QUOTA_CODES = {"standard": "L-34B43A08", "g": "L-3819A6DF", "p": "L-7212CCBC"}
ON_DEMAND_QUOTA_CODES = {"standard": "L-1216C47A", "g": "L-DB2E81BA", "p": "L-417A185B"}


@dataclass(frozen=True)
class TypeFacts:
    """Hardware of one instance type, from DescribeInstanceTypes."""

    name: str
    vcpus: int
    architectures: tuple[str, ...]
    gpus: int
    gpu_model: str
    gpu_memory_gb: float
    network_mbytes_per_s: float  # megabytes/s, the project's bandwidth unit (baseline, not burst)


@dataclass(frozen=True)
class PriceRecord:
    """One DescribeSpotPriceHistory row: the price from `at` until the next change."""

    instance_type: str
    zone: str  # AZ name (live API) or AZ id (archive), see zone_is_id
    price_usd_per_h: float
    at: datetime


@dataclass(frozen=True)
class PriceStats:
    """Spot price of one type in one AZ over a window; time-weighted, so a brief spike weighs
    what it lasted."""

    instance_type: str
    zone: str
    current_usd_per_h: float
    mean_usd_per_h: float
    std_usd_per_h: float
    min_usd_per_h: float
    max_usd_per_h: float
    changes: int


def quota_group(instance_type: str) -> str:
    """The Service Quotas family group a type's vCPUs count against ('g', 'p' or 'standard')."""
    family = instance_type.split(".", 1)[0]
    if family.startswith(("g", "vt")):
        return "g"
    if family.startswith("p"):
        return "p"
    return "standard"


def type_facts(described: dict[str, Any]) -> TypeFacts:
    """TypeFacts from one DescribeInstanceTypes entry (gpus=0 for a CPU type, e.g. a PS)."""
    gpu_info = described.get("GpuInfo") or {}
    gpus = gpu_info.get("Gpus") or [{}]
    network = described.get("NetworkInfo") or {}
    cards = network.get("NetworkCards") or []
    baseline_gbps = sum(float(c.get("BaselineBandwidthInGbps") or 0.0) for c in cards)
    if baseline_gbps > 0:
        mbytes_per_s = baseline_gbps * 1000.0 / 8.0
    else:  # no card gives a baseline: the label says it ('4x 100 Gigabit'; 'High' gives none)
        mbytes_per_s = network_mbps(network.get("NetworkPerformance", "")) or 0.0
    return TypeFacts(
        name=described["InstanceType"],
        vcpus=int(described["VCpuInfo"]["DefaultVCpus"]),
        architectures=tuple(described.get("ProcessorInfo", {}).get("SupportedArchitectures", [])),
        gpus=sum(int(g.get("Count", 0)) for g in gpus),
        gpu_model=" ".join(filter(None, [gpus[0].get("Manufacturer"), gpus[0].get("Name")])) or "none",
        gpu_memory_gb=float(gpu_info.get("TotalGpuMemoryInMiB", 0)) / 1024.0,
        network_mbytes_per_s=mbytes_per_s,
    )


def price_stats(records: Iterable[PriceRecord], window_end: datetime) -> list[PriceStats]:
    """Per (type, zone): the current price and the time-weighted mean, std and range over the
    records' span up to window_end. The first record holds the price in effect at the window's
    start (that is how DescribeSpotPriceHistory answers a StartTime)."""
    by_key: dict[tuple[str, str], list[PriceRecord]] = defaultdict(list)
    for rec in records:
        by_key[(rec.instance_type, rec.zone)].append(rec)
    stats = []
    for (itype, zone), recs in sorted(by_key.items()):
        recs.sort(key=lambda r: r.at)
        prices = [r.price_usd_per_h for r in recs]
        ends = [r.at for r in recs[1:]] + [max(window_end, recs[-1].at)]
        weights = [(end - r.at).total_seconds() for r, end in zip(recs, ends)]
        total = sum(weights)
        if total <= 0:  # every change at the same instant: plain mean
            weights, total = [1.0] * len(recs), float(len(recs))
        mean = sum(w * p for w, p in zip(weights, prices)) / total
        var = sum(w * (p - mean) ** 2 for w, p in zip(weights, prices)) / total
        stats.append(
            PriceStats(
                instance_type=itype,
                zone=zone,
                current_usd_per_h=prices[-1],
                mean_usd_per_h=mean,
                std_usd_per_h=math.sqrt(var),
                min_usd_per_h=min(prices),
                max_usd_per_h=max(prices),
                changes=len(recs),
            )
        )
    return stats


def fetch_price_history(
    ec2: Any, types: list[str], window_s: float, now: datetime
) -> list[PriceRecord]:
    """Linux spot price changes for `types` over the last window_s seconds (paged)."""
    records = []
    pages = ec2.get_paginator("describe_spot_price_history").paginate(
        InstanceTypes=types,
        ProductDescriptions=["Linux/UNIX"],
        StartTime=now - timedelta(seconds=window_s),
        EndTime=now,
    )
    for page in pages:
        for row in page["SpotPriceHistory"]:
            if row["ProductDescription"] not in LINUX_PRODUCTS or row["InstanceType"] not in types:
                continue
            records.append(
                PriceRecord(row["InstanceType"], row["AvailabilityZone"], float(row["SpotPrice"]), row["Timestamp"])
            )
    return records


def read_price_archive(path: Path, zone_names_by_id: dict[str, str]) -> list[PriceRecord]:
    """Linux rows of a spot price archive TSV (az_id, type, product, price, timestamp; '#' lines
    are comments), keeping the AZs this account has in the region, keyed by AZ name."""
    records = []
    for number, line in enumerate(read_text(path, "spot price archive").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        az_id, itype, product, price, stamp = line.split("\t")
        if product not in LINUX_PRODUCTS or az_id not in zone_names_by_id:
            continue
        try:
            usd_per_h = positive_float(price)
        except UserInputError as err:
            raise UserInputError(f"{shown(path)}:{number}: price {err}") from None
        records.append(PriceRecord(itype, zone_names_by_id[az_id], usd_per_h, datetime.fromisoformat(stamp)))
    return records


def load_interruption_bands(path: Path, region: str) -> dict[str, int]:
    """Spot Advisor interruption band (0: <5% .. 4: >20% of instances a month) per Linux type."""
    feed = read_json(path, "spot advisor feed")
    linux = feed.get("spot_advisor", {}).get(region, {}).get("Linux", {})
    bands = {itype: entry["r"] for itype, entry in linux.items()}
    for itype, band in bands.items():
        if type(band) is not int or not 0 <= band <= 4:  # `true` is no band 1, nor 2.7 band 2
            raise UserInputError(f"{shown(path)}: {shown(itype)} in {region} has interruption band {shown(repr(band))}, "
                                 "not one of 0..4")
    return bands


def load_on_demand_prices(path: Path, region: str) -> dict[str, float]:
    """Linux on-demand USD per instance-hour per type in the region, from the instance catalog."""
    prices = {}
    for entry in load_catalog(path)["types"]:
        price = (entry["regions"].get(region) or {}).get("on_demand_usd_per_h")
        if price:
            prices[entry["type"]] = float(price)
    return prices


@dataclass(frozen=True)
class Catalog:
    """One refresh of a region's GPU offer: what list_types returns, plus what launch needs."""

    region: str
    types: list[InstanceType]
    facts: dict[str, TypeFacts]
    prices: list[PriceStats]
    cheapest_zone: dict[str, str]  # the AZ whose current spot price is the lowest, per type
    refreshed_at: datetime

    def get(self, name: str) -> InstanceType | None:
        return next((t for t in self.types if t.name == name), None)


def offered_types(ec2: Any, wanted: list[str] | None) -> list[str]:
    """Instance types offered in the client's region (all of them, or those of `wanted`)."""
    offered: set[str] = set()
    kwargs: dict[str, Any] = {"LocationType": "region"}
    if wanted:
        kwargs["Filters"] = [{"Name": "instance-type", "Values": list(wanted)}]
    for page in ec2.get_paginator("describe_instance_type_offerings").paginate(**kwargs):
        offered.update(o["InstanceType"] for o in page["InstanceTypeOfferings"])
    return sorted(offered)


def describe_types(ec2: Any, names: list[str]) -> dict[str, TypeFacts]:
    """TypeFacts for offered type names (the API takes at most 100 names a call)."""
    facts: dict[str, TypeFacts] = {}
    for start in range(0, len(names), 100):
        reply = ec2.describe_instance_types(InstanceTypes=names[start : start + 100])
        for described in reply["InstanceTypes"]:
            f = type_facts(described)
            facts[f.name] = f
    return facts


def build_catalog(
    region: str,
    facts: dict[str, TypeFacts],
    records: list[PriceRecord],
    on_demand: dict[str, float],
    bands: dict[str, int],
    now: datetime,
    zone: str | None = None,
) -> Catalog:
    """Join hardware, spot prices, on-demand prices and bands into InstanceTypes. A type lacking
    a spot price (in `zone` if given) or an on-demand price is left out: the planner cannot
    price it."""
    gpu_facts = {name: f for name, f in facts.items() if f.gpus > 0}
    stats = [s for s in price_stats(records, now) if s.instance_type in gpu_facts and (zone is None or s.zone == zone)]
    cheapest: dict[str, PriceStats] = {}
    for s in stats:
        if s.instance_type not in cheapest or s.current_usd_per_h < cheapest[s.instance_type].current_usd_per_h:
            cheapest[s.instance_type] = s
    types = [
        InstanceType(
            name=name,
            gpus=f.gpus,
            gpu_model=f.gpu_model,
            gpu_memory_gb=f.gpu_memory_gb,
            network_mbytes_per_s=f.network_mbytes_per_s,
            on_demand_usd_per_h=on_demand[name],
            spot_usd_per_h=cheapest[name].current_usd_per_h,
            interruption_band=bands.get(name),
        )
        for name, f in sorted(gpu_facts.items())
        if name in cheapest and name in on_demand
    ]
    return Catalog(
        region=region,
        types=types,
        facts=facts,
        prices=stats,
        cheapest_zone={name: s.zone for name, s in cheapest.items()},
        refreshed_at=now,
    )


def zone_names_by_id(ec2: Any) -> dict[str, str]:
    """AZ id (use1-az1, the same everywhere) -> this account's AZ name (us-east-1b)."""
    zones = ec2.describe_availability_zones()["AvailabilityZones"]
    return {z["ZoneId"]: z["ZoneName"] for z in zones}


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def fetch_vcpu_quotas(service_quotas: Any, market: str) -> dict[str, float]:
    """vCPU quotas per family group from Service Quotas; groups it does not answer for are left
    out (the caller falls back to its configured quotas)."""
    from botocore.exceptions import ClientError

    codes = SPOT_QUOTA_CODES if market == "spot" else ON_DEMAND_QUOTA_CODES
    quotas = {}
    for group, code in codes.items():
        try:
            reply = service_quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)
        except ClientError as err:
            if err.response["Error"]["Code"] in ("NoSuchResourceException", "AccessDeniedException"):
                continue
            raise
        quotas[group] = float(reply["Quota"]["Value"])
    return quotas


def merge_live(shipped: dict, live: Catalog) -> dict:
    """The shipped instance catalog (tasks/core/catalog.py's format) with a live refresh of one region
    laid over it: hardware from DescribeInstanceTypes, and each GPU type's spot prices in the
    region from DescribeSpotPriceHistory (current, and the window's min/mean/max over its zones).
    On-demand prices: EC2 does not publish them; the shipped ones stay. Types the API knows and
    the catalog does not are added."""
    merged = {**shipped, "types": [dict(t) for t in shipped["types"]]}
    by_name = {t["type"]: t for t in merged["types"]}
    for name, f in sorted(live.facts.items()):
        if f.gpus == 0:
            continue
        entry = by_name.setdefault(name, {"type": name, "regions": {}})
        if entry not in merged["types"]:
            merged["types"].append(entry)
        entry.update({"gpus": f.gpus, "gpu_model": f.gpu_model, "gpu_memory_gb": f.gpu_memory_gb, "vcpus": f.vcpus,
                      "network_mbps": f.network_mbytes_per_s})
        stats = [s for s in live.prices if s.instance_type == name]
        if not stats:
            continue
        region = dict(entry["regions"].get(live.region) or {"on_demand_usd_per_h": None, "interruption_band": None,
                                                          "interruption_label": None})
        region.update({"spot_current_usd_per_h": min(s.current_usd_per_h for s in stats),
                       "spot_min_usd_per_h": min(s.min_usd_per_h for s in stats),
                       "spot_avg_usd_per_h": sum(s.mean_usd_per_h for s in stats) / len(stats),
                       "spot_max_usd_per_h": max(s.max_usd_per_h for s in stats)})
        entry["regions"] = {**entry["regions"], live.region: region}
    merged["types"].sort(key=lambda t: t["type"])
    merged["refreshed"] = {"region": live.region, "at": live.refreshed_at.isoformat(), "from": "the EC2 API"}
    return merged
