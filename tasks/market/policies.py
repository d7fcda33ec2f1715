"""The provisioning policies a replay compares, each a small rule for what to run now.

Every policy answers one question, `plan(situation) -> {type: count}`: what should run, given the
instances still alive, the loss reached and the time left. The replay calls it at the start and
after every revocation. The answer is the live session's re-plan policy (replan.py): the cheapest
plan meeting the deadline, or the fastest plan when none can.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tasks.core.errors import InfeasibleError, UserInputError
from tasks.core.model import Model
from tasks.core.profile import Profile
from tasks.market.replan import ReplanMemo
from tasks.planner import PlanRequest, solve
from tasks.planner.problem import RISK_LEVEL


@dataclass(frozen=True)
class Situation:
    """What a policy knows when it plans."""

    existing: dict[str, int]  # live instances (running or still joining)
    time_left_s: float  # until the deadline
    current_loss: float | None  # None before training starts
    overhead_s: float  # start and join time of any instance launched now


@dataclass(frozen=True)
class Policy:
    """A planner-driven policy: which solver, which types it may use, which prices it pays.

    `restart_on_preemption`: one revocation tears the whole cluster down and relaunches the same
    plan from the last checkpoint (SkyPilot's managed spot jobs), instead of re-planning around
    the survivors. `on_demand`: pays on-demand prices and is never revoked."""

    name: str
    solver: str = "exact"
    types: tuple[str, ...] | None = None  # None: every profile type
    on_demand: bool = False
    restart_on_preemption: bool = False
    target_probability: float = RISK_LEVEL
    hazards_per_h: dict[str, float] = field(default_factory=dict)
    memo: ReplanMemo = field(default_factory=ReplanMemo, compare=False, repr=False)

    def request(self, profile: Profile, loss_target: float, deadline_s: float, s: Situation) -> PlanRequest:
        quota = {} if self.types is None else {i.type: 0 for i in profile.instances if i.type not in self.types}
        return PlanRequest(profile, loss_target, deadline_s, existing=s.existing, quota=quota,
                           overhead_s=s.overhead_s if s.current_loss is not None else 0.0,
                           current_loss=s.current_loss, solver=self.solver, on_demand=self.on_demand,
                           target_probability=self.target_probability, hazards_per_h=self.hazards_per_h,
                           recovery_s=s.overhead_s)

    def plan(self, profile: Profile, loss_target: float, s: Situation) -> dict[str, int]:
        """The shared re-plan policy (replan.py), through this policy's memo."""
        return self.memo.plan(self.request(profile, loss_target, s.time_left_s, s))


def per_gpu_speed(profile: Profile) -> dict[str, float]:
    """Samples per second per GPU of one instance of each type working alone: what makes a GPU
    type "fast" or "slow" in the paper's homogeneous baselines."""
    model = Model.from_profile(profile)
    t = model.iteration_times_s(np.array(1.0))
    return {name: float(b / ti / g) for name, b, ti, g in zip(model.types.names, model.types.batch, t, model.types.gpus)}


def usable_types(profile: Profile) -> list[str]:
    """The types a homogeneous baseline may pick: a type with quota 0 can start no instance."""
    usable = [i.type for i in profile.instances if i.quota > 0]
    if not usable:
        raise UserInputError("every quota is 0: no instance can be provisioned")
    return usable


def cheapest_single_type(profile: Profile, loss_target: float, deadline_s: float) -> str:
    """The type whose homogeneous plan meets the deadline most cheaply (fastest type if none does)."""
    best: tuple[float, str] | None = None
    usable = usable_types(profile)
    for name in usable:
        only = Policy("probe", types=(name,))
        s = Situation({}, deadline_s, None, 0.0)
        try:
            cost = solve(only.request(profile, loss_target, deadline_s, s)).predicted_cost_usd
        except InfeasibleError:
            continue
        if best is None or cost < best[0]:
            best = (cost, name)
    if best is None:
        speed = {t: v for t, v in per_gpu_speed(profile).items() if t in usable}
        return max(speed, key=speed.get)
    return best[1]


def standard_policies(profile: Profile, loss_target: float, deadline_s: float, level: float,
                      hazards_per_h: dict[str, float]) -> list[Policy]:
    """The seven policies of the comparison, in report order."""
    usable = usable_types(profile)
    speed = {t: v for t, v in per_gpu_speed(profile).items() if t in usable}
    fast, slow = max(speed, key=speed.get), min(speed, key=speed.get)
    single = cheapest_single_type(profile, loss_target, deadline_s)
    return [
        Policy("heuristic", solver="heuristic"),
        Policy("exact"),
        Policy("homogeneous-fast", types=(fast,)),
        Policy("homogeneous-slow", types=(slow,)),
        Policy("on-demand", on_demand=True),
        Policy("restart-single", types=(single,), restart_on_preemption=True),
        Policy("risk-aware", solver="risk", target_probability=level, hazards_per_h=hazards_per_h),
    ]
