"""Launch one plan step on any provider: all of it, or none of it that is not explained.

A type the cloud has no capacity for is reported back (the planner re-solves with that type
capped at what is alive); any other failure, or Ctrl-C, terminates what this step started and
re-raises, so a broken step never leaves instances running.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tasks.providers.base import CapacityError, Instance, Provider, Role, Startup

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    instances: list[Instance]
    unavailable: dict[str, str] = field(default_factory=dict)  # type -> why it could not start


def takeover_counts(plan: dict[str, int], alive: list[Instance]) -> dict[str, int]:
    """What a plan needs started on top of the instances still alive (the plan counts them)."""
    have: dict[str, int] = {}
    for instance in alive:
        have[instance.type] = have.get(instance.type, 0) + 1
    return {t: n - have.get(t, 0) for t, n in sorted(plan.items()) if n > have.get(t, 0)}


def launch_step(
    provider: Provider,
    run_id: str,
    plan_id: str,
    counts: dict[str, int],
    *,
    role: Role = "worker",
    startup: Startup | None = None,
) -> StepResult:
    """Start counts[type] new spot instances of each type for this step (idempotent per step)."""
    provider.check_step(run_id, plan_id, counts, role=role)  # a step over quota starts nothing
    started: list[Instance] = []
    unavailable: dict[str, str] = {}
    try:
        for instance_type, count in sorted(counts.items()):
            if count <= 0:
                continue
            try:
                result = provider.launch(run_id, plan_id, instance_type, count, role=role, startup=startup)
            except CapacityError as err:
                unavailable[err.instance_type] = str(err)
                continue
            started.extend(result.instances)
            if result.unavailable:
                unavailable[instance_type] = result.unavailable
    except BaseException:
        _roll_back(provider, run_id, plan_id, role, started)
        raise
    return StepResult(started, unavailable)


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
