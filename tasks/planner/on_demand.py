"""On-demand workers as offers of their own: the same hardware as a spot type, sold at its
on-demand price, never revoked, within a quota of its own (the profile's `on_demand_quota`, 0 by
default, or an override by type name).

Each on-demand offer is a twin of its spot type named `TYPE:on-demand`: the same GPUs, batch and
compute time, another price. Twins are what the exact solver already groups into one class and
fills cheapest first (docs/planner.md), so a plan over spot and on-demand offers together is
solved, optimally, by the same search.
"""
from __future__ import annotations

from tasks.core.errors import UserInputError
from tasks.core.profile import Profile

ON_DEMAND_SUFFIX = ":on-demand"


def on_demand_name(type_name: str) -> str:
    return type_name + ON_DEMAND_SUFFIX


def is_on_demand(name: str) -> bool:
    return name.endswith(ON_DEMAND_SUFFIX)


def base_type(name: str) -> str:
    """The instance type an offer launches (`p3.2xlarge:on-demand` -> `p3.2xlarge`)."""
    return name[: -len(ON_DEMAND_SUFFIX)] if is_on_demand(name) else name


def market_of(name: str) -> str:
    """The market an offer is bought on: "on-demand" or "spot"."""
    return "on-demand" if is_on_demand(name) else "spot"


def require_allowed(profile: Profile, name: str) -> None:
    """A `TYPE:on-demand` name the profile has no twin for is refused in one line that says how to
    allow it (an unknown name is left to profile.instance's message)."""
    if is_on_demand(name) and name not in profile.type_names:
        profile.instance(base_type(name))
        raise UserInputError(f"{name!r} is an on-demand worker, and {base_type(name)} has no on-demand quota: "
                             f"give it one (--on-demand-quota {base_type(name)}=N, or on_demand_quota in the profile)")


def by_offer(overrides: dict[str, int], offers: dict) -> dict[str, int]:
    """On-demand quota overrides for a plan over offers (offers.py: name -> Offer): a type's
    applies to its offer in every region, as --quota's does; an offer's (TYPE@REGION) wins there."""
    out = {}
    for name, n in overrides.items():
        if name in offers:
            continue
        regional = [o.name for o in offers.values() if o.type == name]
        out.update(dict.fromkeys(regional, n) if regional else {name: n})
    return out | {name: n for name, n in overrides.items() if name in offers}


def on_demand_quotas(profile: Profile, overrides: dict[str, int]) -> dict[str, int]:
    """How many on-demand workers of each spot type a plan may use: the override by type name,
    else the profile's `on_demand_quota` (absent: 0)."""
    spot = [i.type for i in profile.instances if not is_on_demand(i.type)]
    for name in overrides:
        if name not in spot:
            profile.instance(base_type(name))  # names the known types in its message
            raise UserInputError(f"on-demand quota for {name!r}: name the spot type ({base_type(name)})")
    return {t: int(overrides.get(t, profile.instance(t).on_demand_quota)) for t in spot}


def with_on_demand(profile: Profile, overrides: dict[str, int] | None = None) -> Profile:
    """The profile with a `TYPE:on-demand` twin after each spot type whose on-demand quota is
    above 0 (none, and none overridden: the profile itself). Each spot type's `on_demand_quota`
    becomes the quota used, so expanding the result again (a request built once, then rebuilt)
    gives the same offers: twins are never doubled, nor an override lost."""
    quotas = on_demand_quotas(profile, overrides or {})
    if not any(quotas.values()) and not any(i.on_demand_quota or is_on_demand(i.type) for i in profile.instances):
        return profile
    instances = []
    for inst in profile.instances:
        if is_on_demand(inst.type):
            continue
        spot = inst.model_copy(update={"on_demand_quota": quotas[inst.type]})
        instances.append(spot)
        if quotas[inst.type] > 0:
            instances.append(spot.model_copy(update={"type": on_demand_name(inst.type), "spot_price": inst.on_demand_price,
                                                     "quota": quotas[inst.type], "on_demand_quota": 0}))
    return profile.model_copy(update={"instances": instances})


def split_counts(plan: dict[str, int]) -> dict[str, dict[str, int]]:
    """A plan's counts by market and instance type: {"spot": {...}, "on-demand": {...}}."""
    out: dict[str, dict[str, int]] = {"spot": {}, "on-demand": {}}
    for name, n in plan.items():
        if n:
            by_type = out[market_of(name)]
            by_type[base_type(name)] = by_type.get(base_type(name), 0) + int(n)
    return out
