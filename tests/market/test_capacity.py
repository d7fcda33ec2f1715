"""Spot capacity in the replay and the policies that mix in on-demand workers: a launch above
capacity is refused and re-planned around, a drop revokes the excess, a rise lets the policy
launch again, on-demand workers are never revoked or refused, and the published baselines
(Greedy, Uniform Progress) follow their rules."""
import math
from dataclasses import dataclass

import numpy as np
import pytest

from tasks.core.model import Model
from tasks.core.profile import load_profile
from tasks.market.offline import OfflineBound
from tasks.market.policies import (DeadlineSafePolicy, GreedyPolicy, Policy, Situation, UniformProgressPolicy,
                                   standard_policies)
from tasks.market.replay import Market, ReplayConfig, replay
from tasks.market.study import offline_stretches
from tasks.planner import PlanRequest, solve
from tasks.planner.on_demand import is_on_demand, with_on_demand
from tests.helpers import RecordingPolicy, SHIPPED_PROFILE

PROFILE = load_profile(SHIPPED_PROFILE)
OD_QUOTA = {i.type: i.quota for i in PROFILE.instances}
MODEL = Model.from_profile(with_on_demand(PROFILE, OD_QUOTA))  # spot types and their twins
NAMES = MODEL.types.names
SPOT = [NAMES.index(t) for t in PROFILE.type_names]
NEVER = [None] * len(NAMES)


def market(capacity: dict[str, tuple[list[float], list[float]]]) -> Market:
    """No revocation by hazard or trace; spot capacity by type as steps (times, counts)."""
    steps = [None] * len(NAMES)
    for name, (times, counts) in capacity.items():
        steps[NAMES.index(name)] = (np.array(times, dtype=float), np.array(counts, dtype=float))
    return Market(MODEL.types.spot_usd_per_h, np.zeros(len(NAMES)), NEVER, seed=0, capacity=steps)


def drought(start_s: float, end_s: float) -> Market:
    return market({t: ([0.0, start_s, end_s], [math.inf, 0.0, math.inf]) for t in PROFILE.type_names})


def test_a_launch_above_capacity_is_refused_and_the_policy_replans_knowing_what_it_got():
    cfg = ReplayConfig(0.8, 3000.0)
    wanted = solve(PlanRequest(PROFILE, 0.8, 3000.0)).plan
    assert wanted.get("p3.2xlarge", 0) == 2
    policy = RecordingPolicy("exact")
    out = replay(PROFILE, MODEL, policy, cfg, market({"p3.2xlarge": ([0.0], [1.0])}))
    assert policy.seen[0].spot_caps == {} and policy.seen[1].spot_caps == {"p3.2xlarge": 1}
    assert policy.seen[1].existing.get("p3.2xlarge") == 1  # what it got runs; the re-plan builds on it
    assert out.finished and out.revocations == 0


def test_capacity_falling_below_what_runs_revokes_the_excess_and_a_rise_lets_the_policy_launch_again():
    cfg = ReplayConfig(0.8, 6000.0, overhead_s=120.0)
    running = solve(PlanRequest(PROFILE, 0.8, 6000.0)).plan["p3.2xlarge"]
    policy = RecordingPolicy("exact")
    out = replay(PROFILE, MODEL, policy, cfg, market({"p3.2xlarge": ([0.0, 500.0, 1500.0], [2.0, 0.0, 2.0])}))
    assert out.revocations == running  # every p3.2xlarge taken at 500 s
    at_drop = [s for s in policy.seen if s.elapsed_s == 500.0]
    assert at_drop and "p3.2xlarge" not in at_drop[0].existing
    at_rise = [s for s in policy.seen if s.elapsed_s == 1500.0]
    assert at_rise and at_rise[0].spot_caps == {}  # the refusal is forgotten: capacity came back


def test_on_demand_workers_are_never_refused_or_revoked():
    cfg = ReplayConfig(0.8, 3000.0, overhead_s=120.0)
    none_at_all = market({t: ([0.0], [0.0]) for t in PROFILE.type_names})
    out = replay(PROFILE, MODEL, DeadlineSafePolicy("deadline-safe", on_demand_quota=OD_QUOTA), cfg, none_at_all)
    assert out.met_deadline and out.revocations == 0
    on_demand = solve(PlanRequest(PROFILE, 0.8, 3000.0, on_demand=True))
    assert out.cost_usd == pytest.approx(on_demand.predicted_cost_usd, rel=0.05)  # all of it on-demand
    spot_only = replay(PROFILE, MODEL, Policy("exact"), cfg, none_at_all)
    assert not spot_only.finished  # nothing can be had: it waits to the end


def test_deadline_safe_lives_through_a_drought_and_goes_back_to_spot_when_capacity_returns():
    cfg = ReplayConfig(0.8, 4000.0, overhead_s=120.0)
    seen = []

    @dataclass(frozen=True)
    class Watched(DeadlineSafePolicy):
        def plan(self, profile, loss_target, s):
            answer = super().plan(profile, loss_target, s)
            seen.append((s.elapsed_s, answer))
            return answer

    out = replay(PROFILE, MODEL, Watched("deadline-safe", on_demand_quota=OD_QUOTA), cfg, drought(1333.0, 2667.0))
    assert out.met_deadline
    during = [plan for t, plan in seen if 1333.0 <= t < 2667.0]
    after = [plan for t, plan in seen if t >= 2667.0]
    assert any(is_on_demand(n) for plan in during for n in plan)
    assert after and not any(is_on_demand(n) and c for n, c in after[-1].items())  # back to spot
    exact = replay(PROFILE, MODEL, Policy("exact"), cfg, drought(1333.0, 2667.0))
    on_demand = replay(PROFILE, MODEL, Policy("on-demand", on_demand=True), cfg, drought(1333.0, 2667.0))
    assert out.cost_usd < min(exact.cost_usd, on_demand.cost_usd)


def situation(elapsed_s: float, time_left_s: float, work_left_s: float, memory: dict, caps=None, existing=None):
    """A Situation whose clock says the reference cluster has work_left_s to go (C(t))."""
    return Situation(existing or {}, time_left_s, None if elapsed_s == 0 else 1.0, 120.0, elapsed_s,
                     caps or {}, lambda plan: work_left_s, memory)


NO_SPOT = {t: 0 for t in PROFILE.type_names}


def test_uniform_progress_follows_the_published_rules():
    up = UniformProgressPolicy("uniform-progress", on_demand_quota=OD_QUOTA)
    memory: dict = {}
    first = up.decide(PROFILE, 0.8, situation(0.0, 4000.0, 2000.0, memory))  # C0 = 2000 s, D = 4000 s: k = 0.5
    assert memory["c0_s"] == 2000.0 and first.plan == memory["reference"]  # rule 2: spot when it can be had
    # idle and ahead (cp 1000 s >= ep 0.5 * 1000 s): wait, and be asked again when the line catches up
    idle = up.decide(PROFILE, 0.8, situation(1000.0, 3000.0, 1000.0, memory, NO_SPOT))
    assert idle.plan == {} and idle.wake_at_s == pytest.approx(2000.0)
    # idle and behind (cp 1000 s < ep 1200 s): on-demand (rule 1), the reference's twins
    behind = up.decide(PROFILE, 0.8, situation(2400.0, 1600.0, 1000.0, memory, NO_SPOT))
    assert behind.plan == {f"{t}:on-demand": n for t, n in memory["reference"].items()}
    # rule 3: on on-demand, stay until cp >= ep(t + 2d), even with spot back
    still = up.decide(PROFILE, 0.8, situation(2500.0, 1500.0, 900.0, memory))
    assert still.plan == behind.plan and still.wake_at_s > 2500.0
    back = up.decide(PROFILE, 0.8, situation(3000.0, 1000.0, 300.0, memory))  # cp 1700 >= ep(t + 2d) = 1620
    assert back.plan and not any(is_on_demand(n) for n in back.plan)


def test_uniform_progress_safety_net_is_on_demand_to_the_end():
    up = UniformProgressPolicy("uniform-progress", on_demand_quota=OD_QUOTA)
    memory: dict = {}
    up.decide(PROFILE, 0.8, situation(0.0, 4000.0, 2000.0, memory))
    # idle, time left 1200 s < C 1000 s + 2d: on-demand, and it stays so with spot back
    net = up.decide(PROFILE, 0.8, situation(2800.0, 1200.0, 1000.0, memory, NO_SPOT))
    assert all(is_on_demand(n) for n in net.plan) and memory["safety_net"]
    assert up.decide(PROFILE, 0.8, situation(2900.0, 1100.0, 900.0, memory)).plan == net.plan


def test_greedy_takes_spot_until_the_slack_is_one_overhead_then_on_demand_to_the_end():
    greedy = GreedyPolicy("greedy", on_demand_quota=OD_QUOTA)
    memory: dict = {}
    first = greedy.decide(PROFILE, 0.8, situation(0.0, 4000.0, 2000.0, memory))
    assert first.plan == memory["reference"] and first.wake_at_s == pytest.approx(4000.0 - 2000.0 - 120.0)
    late = greedy.decide(PROFILE, 0.8, situation(3000.0, 1000.0, 900.0, memory))
    assert late.plan and all(is_on_demand(n) for n in late.plan)
    assert greedy.decide(PROFILE, 0.8, situation(3100.0, 900.0, 100.0, memory)).plan == late.plan


def test_the_offline_optimum_is_a_floor_under_every_run_that_meets_the_deadline():
    cfg = ReplayConfig(0.8, 4000.0, overhead_s=120.0)
    quota = np.array([i.quota for i in PROFILE.instances])
    bound = OfflineBound(Model.from_profile(PROFILE), 0.8, quota, quota, MODEL.types.on_demand_usd_per_h[SPOT])
    calm = market({})
    unlimited = bound.cost_usd(MODEL.types.spot_usd_per_h[SPOT], offline_stretches(calm, SPOT, quota, 4000.0), 4000.0)
    exact = solve(PlanRequest(PROFILE, 0.8, 4000.0))
    assert 0.8 * exact.predicted_cost_usd <= unlimited <= exact.predicted_cost_usd * (1 + 1e-9)
    dry = drought(1333.0, 2667.0)
    floor = bound.cost_usd(MODEL.types.spot_usd_per_h[SPOT], offline_stretches(dry, SPOT, quota, 4000.0), 4000.0)
    assert floor > unlimited  # the drought costs even a run that knows it is coming
    for policy in standard_policies(PROFILE, 0.8, 4000.0, 0.95, {}, OD_QUOTA):
        out = replay(PROFILE, MODEL, policy, cfg, drought(1333.0, 2667.0))
        if out.met_deadline:
            assert out.cost_usd >= floor, policy.name
