"""The provisioning policies a replay compares, each a small rule for what to run now.

Every policy answers one question, `decide(situation) -> Decision`: what should run (a plan over
spot types and `TYPE:on-demand` offers), given the instances still alive, the loss reached, the
time left and the spot capacity it learned from refused launches, and when to be asked again
even if nothing happens (a policy that watches its progress against a line). The replay asks at
the start, after every revocation, refused launch and change of spot capacity. Planner-driven
policies answer with the live session's re-plan policy (replan.py): the cheapest plan meeting
the deadline, or the fastest plan when none can; `deadline-safe` with replan.deadline_safe, the
fallback the live session runs when on-demand workers are allowed. `greedy` and
`uniform-progress` are the baselines of Can't Be Late (Wu et al., NSDI'24), generalised from one
instance to a cluster (docs/market.md, "Policies with on-demand workers").
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tasks.core.errors import InfeasibleError, UserInputError
from tasks.core.model import Model
from tasks.core.profile import Profile
from tasks.market.replan import ReplanMemo, can_provision
from tasks.planner import PlanRequest, solve
from tasks.planner.on_demand import is_on_demand, on_demand_name
from tasks.planner.problem import RISK_LEVEL


@dataclass(frozen=True)
class Situation:
    """What a policy knows when it plans."""

    existing: dict[str, int]  # live instances (running or still joining), on-demand ones by twin name
    time_left_s: float  # until the deadline
    current_loss: float | None  # None before training starts
    overhead_s: float  # start and join time of any instance launched now
    elapsed_s: float = 0.0  # since training started
    # spot types whose last launch the market refused since their capacity last rose: the most
    # of each that can be had now (what runs of it)
    spot_caps: dict[str, int] = field(default_factory=dict)
    # seconds the given cluster still needs to reach the target from here (the replay's clock)
    time_on: Callable[[dict[str, int]], float] | None = None
    memory: dict = field(default_factory=dict)  # a policy's own notes, one dict per replay


@dataclass(frozen=True)
class Decision:
    plan: dict[str, int]
    wake_at_s: float = math.inf  # elapsed time at which to be asked again


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
    on_demand_quota: dict[str, int] = field(default_factory=dict)  # on-demand offers it may use
    replacement_wait_s: dict[str, float] = field(default_factory=dict)  # risk-aware: waits for capacity
    memo: ReplanMemo = field(default_factory=ReplanMemo, compare=False, repr=False)

    def request(self, profile: Profile, loss_target: float, deadline_s: float, s: Situation) -> PlanRequest:
        quota = {} if self.types is None else {i.type: 0 for i in profile.instances if i.type not in self.types}
        for name, cap in s.spot_caps.items():
            quota[name] = min(cap, quota.get(name, profile.instance(name).quota))
        return PlanRequest(profile, loss_target, deadline_s, existing=s.existing, quota=quota,
                           overhead_s=s.overhead_s if s.current_loss is not None else 0.0,
                           current_loss=s.current_loss, solver=self.solver, on_demand=self.on_demand,
                           target_probability=self.target_probability, hazards_per_h=self.hazards_per_h,
                           recovery_s=s.overhead_s, on_demand_quota=self.on_demand_quota,
                           replacement_wait_s=self.replacement_wait_s)

    def plan(self, profile: Profile, loss_target: float, s: Situation) -> dict[str, int]:
        """The shared re-plan policy (replan.py), through this policy's memo; nothing to run when
        the market has no capacity for any type it may use."""
        request = self.request(profile, loss_target, s.time_left_s, s)
        if not can_provision(request):
            return dict(request.existing)
        return self.memo.plan(request)

    def decide(self, profile: Profile, loss_target: float, s: Situation) -> Decision:
        return Decision(self.plan(profile, loss_target, s))


@dataclass(frozen=True)
class DeadlineSafePolicy(Policy):
    """spotfill's fallback (replan.deadline_safe): spot while a spot-only plan meets the deadline
    with one re-plan's overhead to spare, else the cheapest spot and on-demand mix; back to spot
    when capacity returns and the slack allows (the replay asks again at every capacity rise)."""

    def plan(self, profile: Profile, loss_target: float, s: Situation) -> dict[str, int]:
        request = self.request(profile, loss_target, s.time_left_s, s)
        if not can_provision(request):
            return dict(request.existing)
        return self.memo.deadline_safe(request, reserve_s=s.overhead_s)


@dataclass(frozen=True)
class ProgressLinePolicy(Policy):
    """The single-instance policies of Can't Be Late on a cluster. The job's work is measured on
    a reference cluster, the exact spot optimum for the whole deadline: C0 is its time from the
    start and C(t) its time left from the loss reached (Situation.time_on). On spot, the policy
    runs the exact spot plan around the survivors within the capacity it knows; on on-demand, the
    reference cluster's composition as on-demand offers (the same speed as the spot plan it
    stands in for, as one instance on either market is in the paper); idle, nothing."""

    def reference(self, profile: Profile, loss_target: float, s: Situation) -> dict[str, int]:
        if "reference" not in s.memory:
            start = Situation({}, s.time_left_s + s.elapsed_s, None, s.overhead_s)
            s.memory["reference"] = Policy("reference").plan(profile, loss_target, start)
            s.memory["c0_s"] = s.time_on(s.memory["reference"])  # asked first at the start
        return s.memory["reference"]

    def spot_plan(self, profile: Profile, loss_target: float, s: Situation) -> dict[str, int]:
        survivors = dataclasses.replace(s, existing={t: n for t, n in s.existing.items() if not is_on_demand(t)})
        return Policy(self.name, memo=self.memo).plan(profile, loss_target, survivors)


def _work_left_s(s: Situation) -> float:
    """C(t): the reference cluster's time left from the loss reached."""
    return s.time_on(s.memory["reference"])


@dataclass(frozen=True)
class GreedyPolicy(ProgressLinePolicy):
    """Greedy (Can't Be Late): spot whenever it can be had, idle when not, until the time left is
    just the reference cluster's time left plus one overhead; then on-demand to the end."""

    def decide(self, profile: Profile, loss_target: float, s: Situation) -> Decision:
        reference = self.reference(profile, loss_target, s)
        work_left_s = _work_left_s(s)
        slack_s = s.time_left_s - work_left_s - s.overhead_s
        if s.memory.get("on_demand") or slack_s <= 1e-9 * s.time_left_s:
            s.memory["on_demand"] = True
            return Decision(_on_demand(profile, reference, self.on_demand_quota))
        return Decision(self.spot_plan(profile, loss_target, s),
                        wake_at_s=s.elapsed_s + slack_s)


@dataclass(frozen=True)
class UniformProgressPolicy(ProgressLinePolicy):
    """Uniform Progress as published (Can't Be Late, NSDI'24), with d the overhead, ep(t) = t C0 / D
    the expected progress and cp(t) = C0 - C(t) the progress made:
    1. idle and cp(t) < ep(t): on-demand, to catch up;
    2. spot whenever it can be had, even when behind, until revoked;
    3. hysteresis: on on-demand, stay until cp(t) >= ep(t + 2d);
    4. safety net: idle and time left < C(t) + 2d: on-demand to the end."""

    def decide(self, profile: Profile, loss_target: float, s: Situation) -> Decision:
        reference = self.reference(profile, loss_target, s)
        deadline_s, d, t = s.elapsed_s + s.time_left_s, s.overhead_s, s.elapsed_s
        c0 = s.memory["c0_s"]
        work_left_s = _work_left_s(s)
        progress_s = c0 - work_left_s
        k = c0 / deadline_s  # the line's slope: expected progress per second
        on_demand = _on_demand(profile, reference, self.on_demand_quota)
        # on-demand runs at the reference's speed: one second of work per second, so it meets
        # the line shifted by 2d at t' = (t - cp + 2 d k) / (1 - k)
        catch_up = Decision(on_demand, wake_at_s=max((t - progress_s + 2 * d * k) / (1 - k) if k < 1 else math.inf,
                                                     t + d / 10))
        if s.memory.get("safety_net"):
            return Decision(on_demand)
        if s.memory.get("mode") == "on-demand" and progress_s < k * (t + 2 * d):
            return catch_up
        spot = self.spot_plan(profile, loss_target, s)
        if any(spot.values()):
            s.memory["mode"] = "spot"
            return Decision(spot)
        if s.time_left_s < work_left_s + 2 * d:
            s.memory["safety_net"] = True
            return Decision(on_demand)
        if progress_s < k * t:
            s.memory["mode"] = "on-demand"
            return catch_up
        s.memory["mode"] = "idle"
        behind_at_s = progress_s / k if k > 0 else math.inf
        safety_at_s = deadline_s - work_left_s - 2 * d
        return Decision({}, wake_at_s=max(min(behind_at_s, safety_at_s), t + d / 10))


def _on_demand(profile: Profile, reference: dict[str, int], on_demand_quota: dict[str, int]) -> dict[str, int]:
    """The reference cluster as on-demand offers, as far as the on-demand quotas allow."""
    plan = {}
    for t, n in reference.items():
        quota = on_demand_quota.get(t, profile.instance(t).on_demand_quota)
        if n and quota:
            plan[on_demand_name(t)] = min(n, quota)
    return plan


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
                      hazards_per_h: dict[str, float], on_demand_quota: dict[str, int] | None = None,
                      replacement_wait_s: dict[str, float] | None = None) -> list[Policy]:
    """The seven policies of the comparison, in report order; with on-demand quotas, also the
    three that mix in on-demand workers: greedy, uniform-progress and spotfill's deadline-safe.
    `replacement_wait_s`: what the risk-aware planner expects a refused replacement to wait."""
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
        Policy("risk-aware", solver="risk", target_probability=level, hazards_per_h=hazards_per_h,
               replacement_wait_s=replacement_wait_s or {}),
    ] + ([] if not any((on_demand_quota or {}).values()) else [
        GreedyPolicy("greedy", on_demand_quota=on_demand_quota),
        UniformProgressPolicy("uniform-progress", on_demand_quota=on_demand_quota),
        DeadlineSafePolicy("deadline-safe", on_demand_quota=on_demand_quota),
    ])
