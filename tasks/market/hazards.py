"""Per-type revocation hazards: from real traces where a trace of the type's family exists, from
the Spot Advisor's interruption band otherwise.

Bands are MONTHLY interruption frequencies (<5%, 5-10%, 10-15%, 15-20%, >20% of instances
interrupted per month). Each band is taken at its midpoint (the open >20% band at 25%) and turned
into a constant per-hour hazard h with the same monthly probability: 1 - exp(-h * 730 h) = f, so
h = -ln(1 - f) / 730 (730 h = one month; for small f this is f / 730).

A band hazard is a month-long average; the real traces come from stressed days and revoke about
600x as often. So that band-only types and trace-mapped types are compared on the same footing,
band hazards are multiplied by a stress factor calibrated on the traces themselves (their
revocations per instance-hour over the band hazard of the type they stand for), unless the user
gives one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.core.catalog import load_catalog
from tasks.core.errors import UserInputError
from tasks.core.profile import Profile
from tasks.core.traces import Trace, family_of

HOURS_PER_MONTH = 730.0
BAND_MONTHLY_FRACTION = (0.025, 0.075, 0.125, 0.175, 0.25)  # midpoints; >20% taken as 25%


def band_hazard_per_h(band: int) -> float:
    """Per-hour hazard of a Spot Advisor band 0..4 (see the module docstring)."""
    if band not in range(len(BAND_MONTHLY_FRACTION)):
        raise UserInputError(f"interruption band must be 0..4, got {band}")
    return -math.log1p(-BAND_MONTHLY_FRACTION[band]) / HOURS_PER_MONTH


@dataclass(frozen=True)
class TypeHazard:
    """How one profile type gets revoked in a replay: by its family's traces, or by a Poisson
    process at `hazard_per_h` (band-based, stressed)."""

    type: str
    hazard_per_h: float  # what the risk-aware planner assumes
    source: str  # "trace" (rate measured on `traces`), "band" or "unused" (quota 0)
    traces: tuple[Trace, ...] = ()  # empty: replayed as a Poisson process at hazard_per_h
    band: int | None = None


def catalog_bands(region: str) -> dict[str, int]:
    """{type: interruption band} in one region of the instance catalog."""
    out = {}
    for t in load_catalog()["types"]:
        band = t["regions"].get(region, {}).get("interruption_band")
        if band is not None:
            out[t["type"]] = int(band)
    return out


def stress_factor(traces_by_type: dict[str, list[Trace]], bands: dict[str, int]) -> float:
    """Revocations per instance-hour seen in the traces over what the bands of the types they
    stand for predict (1 when no trace-mapped type has a band)."""
    revocations = expected = 0.0
    for name, traces in traces_by_type.items():
        if name in bands:
            for tr in traces:
                revocations += tr.revocations
                expected += tr.instance_hours * band_hazard_per_h(bands[name])
    return revocations / expected if expected > 0 else 1.0


def type_hazards(profile: Profile, traces: list[Trace], bands: dict[str, int],
                 stress: float | None = None) -> tuple[dict[str, TypeHazard], float]:
    """Map every profile type to its traces (same family, e.g. a p3 trace for p3.2xlarge) or to
    its band; returns the table and the stress factor used. A type that may be used (quota > 0)
    with neither is an error; a type with quota 0 is never launched and gets no hazard."""
    traces_by_type = {i.type: [t for t in traces if t.family == family_of(i.type)] for i in profile.instances}
    traces_by_type = {k: v for k, v in traces_by_type.items() if v}
    if stress is None:
        stress = stress_factor(traces_by_type, bands)
        if stress <= 0:
            raise UserInputError("the traces loaded show no revocation, so they calibrate no stress for the bands' "
                                 "hazards: give --band-stress X (1 takes the bands as published)")
    if not math.isfinite(stress) or stress <= 0:
        raise UserInputError(f"band stress factor must be a positive number, got {stress}")
    table = {}
    for inst in profile.instances:
        name = inst.type
        if inst.quota == 0:
            table[name] = TypeHazard(name, 0.0, "unused")
        elif name in traces_by_type:
            mapped = traces_by_type[name]
            rate = sum(t.revocations for t in mapped) / sum(t.instance_hours for t in mapped)
            table[name] = TypeHazard(name, rate, "trace", tuple(mapped), bands.get(name))
        elif name in bands:
            table[name] = TypeHazard(name, band_hazard_per_h(bands[name]) * stress, "band", (), bands[name])
        else:
            raise UserInputError(
                f"type {name} has no trace of its family ({family_of(name)}) and no interruption band: "
                f"pass --band {name}=B (0..4) or a trace of that family")
    return table, stress
