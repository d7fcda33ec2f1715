"""On-demand workers in a live run, as the planner names them: a running on-demand instance of
TYPE counts as the offer `TYPE:on-demand` (tasks/planner/on_demand.py), so plans, survivors and
prices speak of one thing. What a plan starts on each market, which on-demand workers it
releases, and when those have been replaced."""
from __future__ import annotations

from collections import Counter

from tasks.planner.on_demand import base_type, on_demand_name, split_counts
from tasks.providers.base import Instance
from tasks.runtime.telemetry import ClusterProgress


def offer_name(instance: Instance) -> str:
    return on_demand_name(instance.type) if instance.market == "on-demand" else instance.type


def offer_counts(instances: list[Instance]) -> dict[str, int]:
    """Workers by offer (`TYPE` for spot, `TYPE:on-demand`) among these instances."""
    return dict(Counter(offer_name(i) for i in instances if i.role == "worker"))


def hardware_counts(counts: dict[str, int]) -> dict[str, int]:
    """Counts by instance type, whichever market: what the model predicts speed from."""
    out: dict[str, int] = {}
    for name, n in counts.items():
        out[base_type(name)] = out.get(base_type(name), 0) + n
    return out


def takeover_by_market(plan: dict[str, int], alive: list[Instance]) -> dict[str, dict[str, int]]:
    """What a plan needs started on top of the workers alive, by market and instance type."""
    have = offer_counts(alive)
    return split_counts({name: n - have.get(name, 0) for name, n in plan.items() if n > have.get(name, 0)})


def to_release(plan: dict[str, int], alive: list[Instance]) -> list[Instance]:
    """The on-demand workers beyond what the plan keeps of each type (the newest first go)."""
    out = []
    for name in sorted({offer_name(i) for i in alive if i.market == "on-demand" and i.role == "worker"}):
        mine = sorted((i for i in alive if offer_name(i) == name and i.role == "worker"),
                      key=lambda i: (i.launched_at_s, i.instance_id))
        out += mine[plan.get(name, 0):]
    return out


def all_joined(progress: ClusterProgress, workers_alive: int) -> bool:
    """Every worker alive has pushed an update (so the replacements of released on-demand workers
    train): the PS sees at least as many active workers that updated as instances run."""
    return sum(1 for w in progress.workers.values() if w.left is None and w.updates > 0) >= workers_alive
