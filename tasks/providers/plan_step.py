"""Launch one plan step on any provider: all of it, or an account of what the market refused.

A type the market refuses (capacity, the account's quota, price) comes back in the result's
`refused`, with whatever did start; the caller re-plans with that type capped at what runs. Any
other failure, or Ctrl-C, terminates what this step started and re-raises, so a broken step never
leaves instances running.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

from tasks.providers.base import Instance, LaunchResult, Market, Provider, Role, Startup

log = logging.getLogger(__name__)


def worker_counts(instances: list[Instance]) -> dict[str, int]:
    """Workers by type among these instances."""
    return dict(Counter(i.type for i in instances if i.role == "worker"))


def takeover_counts(plan: dict[str, int], alive: list[Instance]) -> dict[str, int]:
    """What a plan needs started on top of the instances still alive (the plan counts them)."""
    have = Counter(i.type for i in alive)
    return {t: n - have[t] for t, n in sorted(plan.items()) if n > have[t]}


def launch_step(
    provider: Provider,
    run_id: str,
    plan_id: str,
    counts: dict[str, int],
    *,
    role: Role = "worker",
    startup: Startup | Mapping[str, Startup] | None = None,
    market: Market = "spot",
) -> LaunchResult:
    """Start counts[type] new instances of each type on `market` for this step (idempotent per
    step); `startup` is one for every type, or one per type."""
    provider.check_step(run_id, plan_id, counts, role=role, market=market)  # a step over quota starts nothing
    result = LaunchResult([])
    try:
        for instance_type, count in sorted(counts.items()):
            if count <= 0:
                continue
            step_startup = startup.get(instance_type) if isinstance(startup, Mapping) else startup
            result.merge(provider.launch(run_id, plan_id, instance_type, count, role=role, market=market,
                                         startup=step_startup))
    except BaseException:
        _roll_back(provider, run_id, plan_id, role, result.instances)
        raise
    return result


def _roll_back(provider: Provider, run_id: str, plan_id: str, role: Role, started: list[Instance]) -> None:
    """Terminate the step's instances: those it got back, and those the cloud started although
    the reply was lost (found by the step's tags). A rollback that fails itself is logged; the
    original error is what the caller sees (and `spotfill cleanup` remains)."""
    ids = {i.instance_id for i in started}
    try:
        ids |= {i.instance_id for i in provider.describe(run_id) if i.plan_id == plan_id and i.role == role}
    except Exception as err:  # noqa: BLE001 - still terminate what we know of
        log.warning("rollback could not list step %s of run %s (%s)", plan_id, run_id, type(err).__name__)
    try:
        if ids:
            provider.terminate(sorted(ids))
    except Exception as err:  # noqa: BLE001 - the original error matters more
        log.error("rollback failed (%s): run `spotfill cleanup --run-id %s`", type(err).__name__, run_id)
