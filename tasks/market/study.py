"""Many replays of every policy on the same market draws, summarised per policy.

Replay i draws one market (trace windows, zone prices, thinning randomness) from seed (seed, i)
and every policy runs on that same draw, so policies differ by what they do, not by luck.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from tasks.core.errors import InfeasibleError, UserInputError
from tasks.core.model import Model
from tasks.core.profile import Profile
from tasks.core.progress import ProgressBar
from tasks.core.traces import Trace
from tasks.market.hazards import catalog_bands, type_hazards
from tasks.market.policies import Policy, standard_policies
from tasks.market.prices import zone_prices_usd_per_h
from tasks.market.replay import ClusterClock, Market, Outcome, ReplayConfig, initial_situation, replay
from tasks.planner import PlanRequest, solve


@dataclass(frozen=True)
class Study:
    profile: Profile
    loss_target: float
    deadline_s: float
    replays: int
    level: float
    traces: list[Trace]
    bands: dict[str, int] = field(default_factory=dict)  # override / fill in the catalog's bands
    band_stress: float | None = None
    quota: dict[str, int] = field(default_factory=dict)
    overhead_s: float = 120.0
    region: str = "us-east-1"
    seed: int = 0
    synthetic: bool = False  # revoke every type by a Poisson process at its hazard, no trace windows


def with_quota(profile: Profile, quota: dict[str, int]) -> Profile:
    for name in quota:
        profile.instance(name)
    return profile.model_copy(update={"instances": [
        i.model_copy(update={"quota": quota.get(i.type, i.quota)}) for i in profile.instances]})


def summarise(outcomes: list[Outcome], on_demand_cost_usd: float | None, wall_s: float) -> dict:
    times = np.array([o.time_s for o in outcomes])
    costs = np.array([o.cost_usd for o in outcomes])
    out = {
        "slo_attainment": float(np.mean([o.met_deadline for o in outcomes])),
        "mean_cost_usd": float(costs.mean()),
        "p95_cost_usd": float(np.percentile(costs, 95)),
        "mean_time_s": float(times.mean()),
        "p95_time_s": float(np.percentile(times, 95)),
        "mean_revocations": float(np.mean([o.revocations for o in outcomes])),
        "mean_replans": float(np.mean([o.replans for o in outcomes])),
        "unfinished": int(sum(not o.finished for o in outcomes)),
        "simulated_hours_per_wall_s": float(times.sum() / 3600.0 / wall_s),
    }
    if on_demand_cost_usd:
        out["savings_vs_on_demand_pct"] = 100.0 * (1.0 - out["mean_cost_usd"] / on_demand_cost_usd)
    return out


def risk_estimate(profile: Profile, study: Study, policy: Policy, cfg: ReplayConfig) -> dict | None:
    """What the risk-aware planner expects of its initial plan (None when no plan meets the
    deadline at all)."""
    try:
        r = solve(policy.request(profile, study.loss_target, study.deadline_s, initial_situation(cfg)))
    except InfeasibleError:
        return None
    return {"plan": r.plan, "meet_probability": r.meet_probability, "message": r.message}


def run_study(study: Study) -> dict:
    profile = with_quota(study.profile, study.quota)
    # The target and deadline, with the planner's own messages: a deadline no plan meets even
    # without revocations would make every policy's replays miss, a comparison of nothing.
    solve(PlanRequest(profile, study.loss_target, study.deadline_s))
    bands = catalog_bands(study.region)
    for name, band in study.bands.items():
        profile.instance(name)
        if band > 4:
            raise UserInputError(f"interruption band for {name} must be 0..4, got {band}")
    bands.update(study.bands)
    hazards, stress = type_hazards(profile, study.traces, bands, study.band_stress)
    replayed = {n: dataclasses.replace(h, traces=()) for n, h in hazards.items()} if study.synthetic else hazards
    model = Model.from_profile(profile)
    policies = standard_policies(profile, study.loss_target, study.deadline_s, study.level,
                                 {n: h.hazard_per_h for n, h in hazards.items() if h.hazard_per_h > 0})
    cfg = ReplayConfig(study.loss_target, study.deadline_s, study.overhead_s)
    zone_prices = zone_prices_usd_per_h(study.region)
    first_plans = {p.name: p.plan(profile, study.loss_target, initial_situation(cfg)) for p in policies}
    clock = ClusterClock(model, study.loss_target)
    outcomes: dict[str, list[Outcome]] = {p.name: [] for p in policies}
    policy_wall_s = {p.name: 0.0 for p in policies}
    started, started_cpu = time.perf_counter(), time.process_time()
    with ProgressBar(study.replays * len(policies), "simulate") as bar:
        for i in range(study.replays):
            market = Market.draw(model.types.names, replayed, model.types.spot_usd_per_h, zone_prices,
                            cfg.deadline_s * cfg.give_up_factor, seed=study.seed * 1_000_003 + i)
            for policy in policies:
                t0 = time.perf_counter()
                outcome = replay(profile, model, policy, cfg, market.fork(), first_plans[policy.name], clock)
                outcomes[policy.name].append(outcome)
                policy_wall_s[policy.name] += time.perf_counter() - t0
                bar.advance(note=policy.name)
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    simulated_h = sum(o.time_s for runs in outcomes.values() for o in runs) / 3600.0
    on_demand = float(np.mean([o.cost_usd for o in outcomes["on-demand"]]))
    return {
        "workload": profile.workload,
        "loss_target": study.loss_target,
        "deadline_s": study.deadline_s,
        "target_level": study.level,
        "replays": study.replays,
        "overhead_s": study.overhead_s,
        "policies": {p.name: summarise(outcomes[p.name], on_demand, policy_wall_s[p.name])
                     | {"replans_solved": p.memo.solves, "replans_remembered": p.memo.hits} for p in policies},
        "initial_plans": first_plans,
        "risk_estimate": risk_estimate(profile, study, policies[-1], cfg),
        "hazards_per_h": {n: {"rate": h.hazard_per_h, "source": h.source, "traces": [t.name for t in h.traces]}
                          for n, h in hazards.items()},
        "band_stress_factor": stress,
        "synthetic": study.synthetic,
        "simulated_hours": simulated_h,
        "wall_s": wall_s,
        "simulated_hours_per_wall_s": simulated_h / wall_s,
        "cpu_s": cpu_s,
        "simulated_hours_per_cpu_s": simulated_h / cpu_s,
    }

