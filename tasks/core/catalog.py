"""The instance catalog: every EC2 GPU type with its hardware, prices and interruption band per
region, built from the public data under profiles/sources/ by `spotfill catalog build`.

Bandwidths are in MB/s (the profile's unit): "Up to 10 Gigabit" counts as its ceiling,
10 Gbit/s = 1250 MB/s; the vague labels "Moderate" and "High" get no number.
"""
from __future__ import annotations

import csv
import re
import statistics
from collections import defaultdict
from pathlib import Path

from tasks.core.errors import UserInputError, shown
from tasks.core.inputs import read_json, read_text
from tasks.core.limits import strict_float
from tasks.core.profile import TYPE_NAME

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "profiles" / "sources"
CATALOG = REPO / "profiles" / "instance-catalog.json"


def network_mbps(label: str) -> float | None:
    """'Up to 25 Gigabit' -> 3125.0 MB/s; '4x 100 Gigabit' -> 50000.0; 'High' -> None."""
    m = re.fullmatch(r"(?:Up to )?(?:(\d+)x )?([\d.]+) Gigabit", label.strip())
    if not m:
        return None
    links = int(m.group(1) or 1)
    return links * float(m.group(2)) * 1000.0 / 8.0


MAX_PRICE_USD_PER_H = 1e6  # the dearest EC2 type costs about $100/h; more is a corrupt source


def _price(value) -> float | None:
    """A positive price of at most MAX_PRICE_USD_PER_H, else None (no price): a JSON number, or
    text read by core's strict parser. `true` is no price of $1.00, nor `1_0` one of $10."""
    if isinstance(value, str):
        try:
            v = strict_float(value)
        except UserInputError:
            return None
    elif type(value) in (int, float):
        v = float(value)
    else:
        return None
    return v if 0 < v <= MAX_PRICE_USD_PER_H else None


def _listed_price(value, where: str) -> float | None:
    """A source's price: absent (null) is no price; anything else must be a positive number."""
    if value is None:
        return None
    price = _price(value)
    if price is None:
        raise UserInputError(f"{where} is {shown(repr(value))}, not a price (0 < USD/h <= {MAX_PRICE_USD_PER_H:g}; null: none)")
    return price


MAX_GPUS = 1024  # per instance: the largest EC2 type has 16; more is a corrupt source


def spot_history_stats(tsv_path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """{type: {region-ish AZ prefix: {current, mean, min, max, samples}}} for Linux/UNIX rows."""
    by_type_az: dict[tuple[str, str], list[tuple[str, float]]] = defaultdict(list)
    text = read_text(tsv_path, "catalog source")
    if text and not text.endswith("\n"):
        raise UserInputError(f"{tsv_path} is truncated (its last line has no end)")
    for line, row in enumerate(csv.reader(text.splitlines(), delimiter="\t"), start=1):
        if len(row) != 5 or row[2] != "Linux/UNIX":
            continue
        az_id, itype, _, price, ts = row
        value = _price(price)
        if value is None:
            raise UserInputError(f"{shown(tsv_path)}:{line}: price '{shown(price)}' is not a price (0 < USD/h <= {MAX_PRICE_USD_PER_H:g})")
        by_type_az[(itype, az_id)].append((ts, value))
    if not by_type_az:
        raise UserInputError(f"{tsv_path} has no Linux/UNIX price row of 5 tab-separated columns "
                             "(zone, type, product, price, time)")
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for (itype, az_id), rows in sorted(by_type_az.items()):
        rows.sort()
        prices = [p for _, p in rows]
        out[itype][az_id] = {"current": prices[-1], "mean": statistics.fmean(prices),
                             "min": min(prices), "max": max(prices), "samples": len(prices)}
    return dict(out)


def build_catalog(sources: Path = SOURCES) -> dict:
    """The catalog from the three source files; a missing or malformed one is a UserInputError."""
    try:
        return _build_catalog(sources)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        if isinstance(err, UserInputError):
            raise
        raise UserInputError(f"catalog sources in {sources} are malformed or truncated "
                             f"({type(err).__name__}: {str(err)[:120]})") from None


def _build_catalog(sources: Path) -> dict:
    instances = read_json(sources / "ec2-gpu-instances.json", "catalog source")
    advisor = read_json(sources / "spot-advisor-data.json", "catalog source")
    bands = {str(r["index"]): r["label"] for r in advisor["ranges"]}
    history = spot_history_stats(sources / "spot-prices-gpu-2022-05-31.tsv")
    if not isinstance(instances, list) or not instances:
        raise UserInputError(f"{sources / 'ec2-gpu-instances.json'} lists no instance type")
    types, seen = [], set()
    source = sources / "ec2-gpu-instances.json"
    for inst in sorted(instances, key=lambda i: i["instance_type"]):
        name = inst["instance_type"]
        if not isinstance(name, str) or not re.fullmatch(TYPE_NAME, name):
            raise UserInputError(f"{source}: instance type {name!r:.60} is not a type name")
        if name in seen:
            raise UserInputError(f"{source}: instance type {name} is listed twice")
        seen.add(name)
        gpus = inst.get("GPU") or 0
        if type(gpus) not in (int, float) or not 0 <= gpus <= MAX_GPUS:  # fractional GPUs exist (g6f: 0.25)
            raise UserInputError(f"{source}: {name}'s GPU count is {gpus!r}, not a number of GPUs (0..{MAX_GPUS})")
        if not isinstance(inst.get("GPU_model"), (str, type(None))):
            raise UserInputError(f"{source}: {name}'s GPU model is {inst['GPU_model']!r}, not a name")
        regions = {}
        for region, pricing in sorted(inst.get("pricing", {}).items()):
            linux = pricing.get("linux") or {}
            band = advisor["spot_advisor"].get(region, {}).get("Linux", {}).get(name, {}).get("r")
            if band is not None and (type(band) is not int or str(band) not in bands):
                raise UserInputError(f"{sources / 'spot-advisor-data.json'}: {name} in {region} has interruption band "
                                     f"{band!r}, not one of its ranges ({', '.join(sorted(bands))})")
            where = f"{source}: {name} in {region}:"
            regions[region] = {
                "on_demand_usd_per_h": _listed_price(linux.get("ondemand"), f"{where} ondemand"),
                "spot_min_usd_per_h": _listed_price(linux.get("spot_min"), f"{where} spot_min"),
                "spot_avg_usd_per_h": _listed_price(linux.get("spot_avg"), f"{where} spot_avg"),
                "spot_max_usd_per_h": _listed_price(linux.get("spot_max"), f"{where} spot_max"),
                "interruption_band": band,
                "interruption_label": bands.get(str(band)) if band is not None else linux.get("pct_interrupt"),
            }
        types.append({
            "type": name,
            "gpus": gpus,
            "gpu_model": inst.get("GPU_model"),
            "gpu_memory_gb": inst.get("GPU_memory"),
            "vcpus": inst.get("vCPU"),
            "memory_gb": inst.get("memory"),
            "network_performance": inst.get("network_performance"),
            "network_mbps": network_mbps(inst.get("network_performance") or ""),
            "regions": regions,
            "spot_history_2022_05_31": history.get(name, {}),
        })
    return {
        "description": "EC2 GPU instance types: hardware, on-demand and spot prices, interruption bands per region",
        "units": {"prices": "USD per instance-hour", "network_mbps": "MB/s", "gpu_memory_gb": "GiB per instance"},
        "sources": [
            {"file": "profiles/sources/ec2-gpu-instances.json", "origin": "ec2instances.info snapshot 2025-11-30 (MIT)"},
            {"file": "profiles/sources/spot-advisor-data.json", "origin": "AWS Spot Instance Advisor feed, mid-2025"},
            {"file": "profiles/sources/spot-prices-gpu-2022-05-31.tsv", "origin": "AWS DescribeSpotPriceHistory archive, 2022-05-31"},
        ],
        "interruption_bands": bands,
        "types": types,
    }


def load_catalog(path: Path = CATALOG) -> dict:
    catalog = read_json(path, "instance catalog")
    if not isinstance(catalog, dict) or not isinstance(catalog.get("types"), list):
        raise UserInputError(f"instance catalog {path} has no list of types: run `spotfill catalog build`")
    return catalog


def catalog_regions(path: Path = CATALOG) -> set[str]:
    """Every region some type of the catalog is priced in."""
    return {region for t in load_catalog(path)["types"] for region in t["regions"]}


def known_region(text: str) -> str:
    """A region the instance catalog knows (an unknown one would silently price nothing)."""
    known = catalog_regions()
    if text not in known:
        raise UserInputError(f"unknown region {text[:40]!r}; the catalog has {', '.join(sorted(known)[:8])}, ...")
    return text
