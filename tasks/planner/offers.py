"""Offers, not types: what the market sells is an (instance type, region) pair, each with its own
price and interruption band, so a plan is over offers named `TYPE@REGION`.

- Which types: the profile's measured ones, and every catalog type with the same GPU model as a
  measured one. Such a type is *estimated*: each of its GPUs computes like the measured type's
  (the one of that GPU model with the nearest GPU count), so it keeps that type's batch per GPU
  and per-iteration compute time, and its batch, hence its throughput, scales with its GPU count.
- Which price: the catalog's average spot price in the region; for types the current snapshot
  no longer prices (retired g3, p2), the mean of the region's zones in the spot price history.
- Which quota: the type's (an estimated type takes its measured type's), or an override by type
  name (every region) or by offer name.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

from tasks.core.catalog import load_catalog
from tasks.core.errors import UserInputError
from tasks.core.profile import InstanceProfile, Profile

ALL_REGIONS = "all"
SEPARATOR = "@"


@dataclass(frozen=True)
class Offer:
    name: str  # TYPE@REGION
    type: str
    region: str
    spot_usd_per_h: float
    price_source: str  # "spot_avg" (catalog) or "history" (spot price history, zones' mean)
    estimated_from: str | None  # the measured type whose speed it borrows; None: measured
    interruption_band: int | None

    def to_json(self) -> dict:
        return {"type": self.type, "region": self.region, "spot_usd_per_h": self.spot_usd_per_h,
                "price_source": self.price_source, "estimated": self.estimated_from is not None,
                "estimated_from": self.estimated_from, "interruption_band": self.interruption_band}


def offer_name(type_name: str, region: str) -> str:
    return f"{type_name}{SEPARATOR}{region}"


def az_prefix(region: str) -> str | None:
    """The spot price archive's zone-id prefix of a region: us-east-1 -> use1, ap-northeast-2 ->
    apne2 (None for local zones such as us-east-1-atl-1, which the archive does not name so)."""
    parts = region.split("-")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    compass = {"northeast": "ne", "southeast": "se", "northwest": "nw", "southwest": "sw"}
    return parts[0] + compass.get(parts[1], parts[1][:1]) + parts[2]


def spot_price(entry: dict, region: str) -> tuple[float, str] | None:
    """(USD per hour, source) of a catalog type in a region, or None when neither the catalog
    nor the price history prices it there."""
    priced = (entry["regions"].get(region) or {}).get("spot_avg_usd_per_h")
    if priced:
        return float(priced), "spot_avg"
    prefix = az_prefix(region)
    zones = [z["mean"] for az, z in entry.get("spot_history_2022_05_31", {}).items()
             if prefix and az.startswith(prefix + "-")]
    return (statistics.fmean(zones), "history") if zones else None


@functools.lru_cache(maxsize=1)
def _shipped_catalog() -> dict:
    return load_catalog()


def catalog_regions(catalog: dict) -> list[str]:
    return sorted({r for t in catalog["types"] for r in t["regions"]})


def parse_regions(text: str) -> tuple[str, ...]:
    """'us-east-1,us-west-2' or 'all' -> a tuple (validated against the catalog later)."""
    regions = tuple(r.strip() for r in text.split(","))
    if not any(regions):
        raise UserInputError("--regions names no region (expected R1,R2 or all)")
    if not all(regions):
        raise UserInputError(f"--regions has an empty item in {text[:80]!r} (expected R1,R2 or all)")
    return regions


def market_profile(profile: Profile, regions: tuple[str, ...], quota: dict[str, int],
                   catalog: dict | None = None, require_prices: bool = True) -> tuple[Profile, dict[str, Offer]]:
    """The profile with one instance entry per offer (quota overrides applied) and the offers by
    name. Named regions must be known and (require_prices) price every measured type that may be
    used; `all` takes every region and skips what it does not price."""
    catalog = catalog or _shipped_catalog()
    entries = {t["type"]: t for t in catalog["types"]}
    known = catalog_regions(catalog)
    want_all = regions == (ALL_REGIONS,)
    if not want_all:
        for r in regions:
            if r not in known:
                raise UserInputError(f"unknown region {r!r} (the catalog has {len(known)} regions, e.g. "
                                     f"{', '.join(known[:3])}; or pass all)")
        if len(set(regions)) != len(regions):
            raise UserInputError(f"a region is named twice in {','.join(regions)}")
    candidates = _candidates(profile, entries)
    for name in quota:
        if SEPARATOR not in name and name not in {inst.type for inst, _ in candidates}:
            profile.instance(name)  # names the measured types in its message
    offers: dict[str, Offer] = {}
    instances: list[InstanceProfile] = []
    for region in (known if want_all else regions):
        for inst, ref in candidates:
            name = offer_name(inst.type, region)
            type_quota = quota.get(name, quota.get(inst.type, inst.quota))
            priced = spot_price(entries[inst.type], region) if inst.type in entries else None
            if priced is None:
                if require_prices and not want_all and ref is None and type_quota > 0:
                    raise UserInputError(
                        f"no spot price for {inst.type} in {region} (neither the catalog nor the price "
                        f"history has one): leave the region out or pass --quota {inst.type}=0")
                continue
            usd_per_h, source = priced
            region_entry = entries[inst.type]["regions"].get(region) or {}
            on_demand = region_entry.get("on_demand_usd_per_h") or inst.on_demand_price
            instances.append(inst.model_copy(update={
                "type": name, "spot_price": usd_per_h, "on_demand_price": on_demand, "quota": type_quota}))
            offers[name] = Offer(name, inst.type, region, usd_per_h, source, ref,
                                 region_entry.get("interruption_band"))
    if not instances:
        raise UserInputError(f"no offer of the profile's GPU models is priced in {','.join(regions)}")
    for name in quota:
        if SEPARATOR in name and name not in offers:
            raise UserInputError(f"unknown offer {name!r} in the quota (no such type priced in that region)")
    return profile.model_copy(update={"instances": instances}), offers


def _candidates(profile: Profile, entries: dict[str, dict]) -> list[tuple[InstanceProfile, str | None]]:
    """The measured types, then every catalog type sharing a GPU model with one, estimated from
    the measured type of that model with the nearest GPU count (ties: the smaller name)."""
    out: list[tuple[InstanceProfile, str | None]] = [(inst, None) for inst in profile.instances]
    by_model: dict[str, list[InstanceProfile]] = {}
    for inst in profile.instances:
        model = (entries.get(inst.type) or {}).get("gpu_model")
        if model:
            by_model.setdefault(model, []).append(inst)
    for name, entry in sorted(entries.items()):
        measured = by_model.get(entry.get("gpu_model") or "")
        if not measured or name in profile.type_names or not entry.get("gpus"):
            continue
        ref = min(measured, key=lambda i: (abs(i.gpus - entry["gpus"]), i.type))
        out.append((ref.model_copy(update={"type": name, "gpus": int(entry["gpus"])}), ref.type))
    return out
