"""The one re-plan policy: what the live session (tasks/pipeline/session.py) and the market replay
(replay.py, through policies.py) both run when instances are revoked or drift: the cheapest plan
that meets the deadline around the survivors, or, when none can, the fastest plan (finishing
late beats never finishing).

`ReplanMemo` puts a cache in front of it for the replay, which asks the same question thousands
of times. Two facts make answers reusable without changing any of them:
- Mid-training, every cluster's remaining iterations are its own curve's factor times the same
  remaining progress du = 1/(L - gamma5) - 1/(L0 - gamma5) (model.md, re-planning), so every
  time and cost scales by du and the answer depends on the budget (deadline minus overhead)
  only through budget / du.
- For a fixed set of survivors, a plan that is optimal at budgets B1 < B2 is optimal at every
  budget between (the allowed set grows with the budget and holds the plan from its own time
  on), so each plan owns an interval of (scaled) budgets, from its time to the largest budget it
  was found optimal at; below the fastest plan's time the answer is the fastest plan.
Solvers that plan against revocation hazards (solvers.py, `uses_hazards`: the risk-aware one) do
not have both, as hazards act in absolute time: their requests are solved every time.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

from tasks.core.errors import InfeasibleError, UserInputError
from tasks.planner import PlanRequest, PlanResult, build_problem, fastest_plan, solve
from tasks.planner.on_demand import is_on_demand
from tasks.planner.problem import COST_TIE_REL, make_result
from tasks.planner.solvers import get_solver


@dataclass(frozen=True)
class Replanned:
    result: PlanResult
    at_risk: str | None = None  # why no plan meets the deadline (result is then the fastest plan)


def cheapest_or_fastest(request: PlanRequest) -> Replanned:
    """The cheapest plan meeting the deadline; if none can (or the deadline lies within the start
    overhead), the fastest plan the quotas and survivors allow, with the reason."""
    if request.deadline_s > request.overhead_s:
        try:
            return Replanned(solve(request))
        except InfeasibleError as err:
            why = str(err)
    else:
        why = f"the deadline ({request.deadline_s:g} s) lies within the start overhead ({request.overhead_s:g} s)"
    return Replanned(fastest_result(request, why), why)


def deadline_safe(request: PlanRequest, reserve_s: float) -> Replanned:
    """Spot while the deadline is safe; the missing throughput on on-demand workers when not.

    `request` allows on-demand offers (its profile's or its own on_demand_quota, TYPE:on-demand
    twins) and names every running worker in `existing`, on-demand ones under their twin names;
    its spot quotas are what the market has now. Safe means a spot-only plan around the spot
    survivors still meets the deadline with `reserve_s` to spare (one more re-plan's overhead, so
    that the next revocation can still be answered); the model's interval is the request's
    `confidence`. When none does, the cheapest mix of spot and on-demand workers that meets the
    deadline (with the reserve if it can, else without), else the fastest mix. Running on-demand
    workers are not held: a plan with fewer of them releases the rest, which is how a run goes
    back to spot once capacity returns and the slack allows."""
    spot_survivors = {t: n for t, n in request.existing.items() if not is_on_demand(t)}
    mixed = dataclasses.replace(request, existing=spot_survivors)
    spot_types = [i.type for i in request.profile.instances if not is_on_demand(i.type)]
    spot_only = dataclasses.replace(mixed, on_demand_quota={t: 0 for t in spot_types})
    for candidate in (spot_only, mixed):
        deadline_s = request.deadline_s - reserve_s
        if deadline_s > candidate.overhead_s:
            try:
                return Replanned(solve(dataclasses.replace(candidate, deadline_s=deadline_s)))
            except UserInputError:  # infeasible, or a floor (min_workers) spot alone cannot reach;
                pass  # bad input the mixed request shares is raised by the last call below
    return cheapest_or_fastest(mixed)


def fastest_result(request: PlanRequest, message: str = "") -> PlanResult:
    """The quickest plan the request's quotas and existing instances allow (no deadline)."""
    problem = build_problem(dataclasses.replace(request, deadline_s=1e12, overhead_s=0.0))
    best, stats = fastest_plan(problem)
    return make_result(problem, best.counts, "fastest", "feasible", 0.0, stats.evaluated, message=message)


@dataclass
class _Answers:
    """The answers known for one set of survivors, in scaled budgets (budget / du)."""

    fastest: tuple[float, dict[str, int]] | None = None  # scaled time of the fastest plan, the plan
    starts: list[float] = field(default_factory=list)  # sorted: each plan's scaled time
    ends: list[float] = field(default_factory=list)  # the largest scaled budget it was optimal at
    plans: list[dict[str, int]] = field(default_factory=list)

    def lookup(self, budget: float) -> dict[str, int] | None:
        if self.fastest is not None and budget < self.fastest[0] * (1 - COST_TIE_REL):
            return self.fastest[1]
        i = bisect.bisect_right(self.starts, budget * (1 + COST_TIE_REL)) - 1  # plans' intervals are disjoint
        return self.plans[i] if i >= 0 and self.ends[i] * (1 + COST_TIE_REL) >= budget else None

    def learn(self, budget: float, time_scaled: float, plan: dict[str, int]) -> None:
        for i, known in enumerate(self.plans):
            if known == plan:
                self.ends[i] = max(self.ends[i], budget)
                self.starts[i] = min(self.starts[i], time_scaled)
                return
        i = bisect.bisect_left(self.starts, time_scaled)
        self.starts.insert(i, time_scaled)
        self.ends.insert(i, budget)
        self.plans.insert(i, plan)


@dataclass
class ReplanMemo:
    """cheapest_or_fastest(request).result.plan, remembered across re-plans (see the module
    docstring for why a remembered answer is the answer). `hits` and `solves` count lookups."""

    answers: dict[tuple, _Answers] = field(default_factory=dict)
    profiles: dict[int, object] = field(default_factory=dict)  # keeps the profiles keyed by id alive
    hits: int = 0
    solves: int = 0

    def plan(self, request: PlanRequest) -> dict[str, int]:
        key, du = self._key(request)
        self.profiles[id(request.profile)] = request.profile
        budget = (request.deadline_s - request.overhead_s) / du if key is not None else None
        if key is not None and budget > 0:
            known = self.answers.setdefault(key, _Answers()).lookup(budget)
            if known is not None:
                self.hits += 1
                return known
        self.solves += 1
        replanned = cheapest_or_fastest(request)
        plan = replanned.result.plan
        if key is not None and budget > 0:
            answers = self.answers[key]
            time_scaled = replanned.result.predicted_time_s / du
            if replanned.at_risk is None:
                answers.learn(budget, time_scaled, plan)
            else:
                answers.fastest = (time_scaled, plan)
        return plan

    @staticmethod
    def _key(request: PlanRequest) -> tuple[tuple | None, float]:
        """The request less its budget and remaining progress, and du; (None, nan) when its
        answer does not scale (before training, or a solver that uses hazards)."""
        if request.current_loss is None or get_solver(request.solver).uses_hazards:
            return None, float("nan")
        g5 = request.profile.loss.gamma5
        du = 1.0 / (request.loss_target - g5) - 1.0 / (request.current_loss - g5)
        key = (id(request.profile), request.loss_target, request.solver, request.on_demand, request.bandwidth_margin,
               tuple(sorted(request.existing.items())), tuple(sorted(request.quota.items())), tuple(request.regions),
               request.min_workers)
        return key, du
