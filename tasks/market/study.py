"""Many replays of every policy on the same market draws, summarised per policy.

Replay i draws one market (trace windows, zone prices, thinning randomness) from seed (seed, i)
and every policy runs on that same draw, so policies differ by what they do, not by luck.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from tasks.core.capacity import CapacityTrace
from tasks.core.errors import InfeasibleError, UserInputError
from tasks.core.model import Model
from tasks.core.profile import Profile
from tasks.core.progress import ProgressBar
from tasks.core.traces import Trace
from tasks.market.hazards import catalog_bands, type_hazards
from tasks.market.offline import OfflineBound
from tasks.market.policies import Policy, standard_policies
from tasks.market.prices import zone_prices_usd_per_h
from tasks.market.replay import ClusterClock, Market, Outcome, ReplayConfig, initial_situation, replay, summed_capacity
from tasks.planner import PlanRequest, solve
from tasks.planner.on_demand import on_demand_quotas, with_on_demand


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
    # on-demand workers the policies that mix them in may use, per type; None: the profile's
    # on_demand_quota where it gives any, else as many as the type's spot quota
    on_demand_quota: dict[str, int] | None = None
    capacity: dict[str, list[CapacityTrace]] = field(default_factory=dict)  # spot capacity records per type
    drought_s: tuple[float, float] | None = None  # no spot capacity of any type over [start, end) of training


def study_on_demand_quota(profile: Profile, given: dict[str, int] | None) -> dict[str, int]:
    """The on-demand quota per type a study allows (Study.on_demand_quota)."""
    if given is not None:
        return on_demand_quotas(profile, given)
    from_profile = on_demand_quotas(profile, {})
    return from_profile if any(from_profile.values()) else {i.type: i.quota for i in profile.instances}


def capacity_records(study: Study, profile: Profile) -> dict[str, list]:
    """Per spot type, what limits its capacity: its zones' records, or the drought's steps."""
    for records in study.capacity.values():
        for r in records:
            r.check_region(study.region)
    if study.drought_s is None:
        return {t: list(rs) for t, rs in study.capacity.items()}
    start_s, end_s = study.drought_s
    steps = (np.array([0.0, start_s, end_s]), np.array([np.inf, 0.0, np.inf]))
    return {i.type: [steps] for i in profile.instances}


def replacement_waits_s(capacity: dict[str, list], horizon_s: float) -> dict[str, float]:
    """Per type, how much longer a revoked instance stays out on average because the market has
    no capacity for its replacement: a moment picked at random falls in a stretch without capacity
    with probability sum(L) / horizon and then waits on average L / 2 for it to end, so
    sum(L^2 / 2) / horizon over the stretches L of the records (zones summed, from their start)."""
    waits = {}
    for name, records in capacity.items():
        longest = max([horizon_s, *(getattr(r, "duration_s", 0.0) for r in records)])
        times, counts = summed_capacity(records, longest)
        lengths = np.diff(np.r_[times, longest])[counts <= 0]
        waits[name] = float((lengths ** 2).sum() / 2.0 / longest)
    return waits


def offline_stretches(market: Market, spot: list[int], quota: np.ndarray, deadline_s: float) -> list[tuple[float, np.ndarray]]:
    """[0, deadline] cut where the spot capacity of any type changes: (length, capacity per type)."""
    cuts = [0.0, *market.capacity_changes_s[market.capacity_changes_s < deadline_s].tolist(), deadline_s]
    return [(b - a, np.minimum(quota, [market.capacity_at(m, a) for m in spot])) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


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
    od_quota = study_on_demand_quota(profile, study.on_demand_quota)
    model = Model.from_profile(with_on_demand(profile, od_quota))  # spot types and their on-demand twins
    capacity = capacity_records(study, profile)
    waits = replacement_waits_s(capacity, study.deadline_s)
    policies = standard_policies(profile, study.loss_target, study.deadline_s, study.level,
                                 {n: h.hazard_per_h for n, h in hazards.items() if h.hazard_per_h > 0}, od_quota, waits)
    cfg = ReplayConfig(study.loss_target, study.deadline_s, study.overhead_s)
    zone_prices = zone_prices_usd_per_h(study.region)
    first_plans = {p.name: p.plan(profile, study.loss_target, initial_situation(cfg)) for p in policies}
    clock = ClusterClock(model, study.loss_target)
    outcomes: dict[str, list[Outcome]] = {p.name: [] for p in policies}
    policy_wall_s = {p.name: 0.0 for p in policies}
    spot = [model.types.names.index(t) for t in profile.type_names]
    quota = np.array([i.quota for i in profile.instances])
    offline = OfflineBound(Model.from_profile(profile), study.loss_target, quota,
                           np.array([od_quota[t] for t in profile.type_names]), model.types.on_demand_usd_per_h[spot])
    bounds: list[float] = []
    offline_wall_s = offline_cpu_s = 0.0
    started, started_cpu = time.perf_counter(), time.process_time()
    with ProgressBar(study.replays * len(policies), "simulate") as bar:
        for i in range(study.replays):
            market = Market.draw(model.types.names, replayed, model.types.spot_usd_per_h, zone_prices,
                                 cfg.deadline_s * cfg.give_up_factor, seed=study.seed * 1_000_003 + i, capacity=capacity)
            for policy in policies:
                t0 = time.perf_counter()
                outcome = replay(profile, model, policy, cfg, market.fork(), first_plans[policy.name], clock)
                outcomes[policy.name].append(outcome)
                policy_wall_s[policy.name] += time.perf_counter() - t0
                bar.advance(note=policy.name)
            if offline.usable:  # timed apart: the bound is no replay
                t0, c0 = time.perf_counter(), time.process_time()
                bounds.append(offline.cost_usd(market.prices_usd_per_h[spot],
                                               offline_stretches(market, spot, quota, cfg.deadline_s), cfg.deadline_s))
                offline_wall_s += time.perf_counter() - t0
                offline_cpu_s += time.process_time() - c0
    wall_s = time.perf_counter() - started - offline_wall_s
    cpu_s = time.process_time() - started_cpu - offline_cpu_s
    simulated_h = sum(o.time_s for runs in outcomes.values() for o in runs) / 3600.0
    on_demand = float(np.mean([o.cost_usd for o in outcomes["on-demand"]]))
    summaries = {p.name: summarise(outcomes[p.name], on_demand, policy_wall_s[p.name])
                 | {"replans_solved": p.memo.solves, "replans_remembered": p.memo.hits} for p in policies}
    offline_summary = None
    if bounds and np.all(np.isfinite(bounds)):
        mean_bound = float(np.mean(bounds))
        offline_summary = {"mean_cost_usd": mean_bound, "p95_cost_usd": float(np.percentile(bounds, 95)),
                           "savings_vs_on_demand_pct": 100.0 * (1.0 - mean_bound / on_demand), "wall_s": offline_wall_s}
        for summary in summaries.values():
            summary["gap_to_offline_pct"] = 100.0 * (summary["mean_cost_usd"] / mean_bound - 1.0)
    return {
        "workload": profile.workload,
        "loss_target": study.loss_target,
        "deadline_s": study.deadline_s,
        "target_level": study.level,
        "replays": study.replays,
        "overhead_s": study.overhead_s,
        "policies": summaries,
        "offline_optimum": offline_summary,
        "on_demand_quota": od_quota,
        "capacity": {t: [getattr(r, "name", "drought") for r in rs] for t, rs in capacity.items()},
        "drought_s": list(study.drought_s) if study.drought_s else None,
        "replacement_wait_s": waits,
        "initial_plans": first_plans,
        "risk_estimate": risk_estimate(profile, study, next(p for p in policies if p.solver == "risk"), cfg),
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

