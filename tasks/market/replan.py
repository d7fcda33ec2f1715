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
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.core.errors import InfeasibleError
from tasks.planner import PlanRequest, PlanResult, build_problem, fastest_plan, solve
from tasks.planner.on_demand import is_on_demand, on_demand_name
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
    its spot quotas are what the market has now. The cheapest spot-only plan around the spot
    survivors is taken while it meets the deadline and the run is safe: were it hit now, the
    fastest mix of spot and on-demand workers could still finish after one more re-plan's
    overhead (`reserve_s`); the model's interval is the request's `confidence`. Otherwise the
    workers running now, as they are, if they finish in time without help; else the cheapest mix
    that meets the deadline with the reserve to spare, else without it, else the fastest mix. Running on-demand workers are not held: a plan with fewer of them releases the
    rest, which is how a run goes back to spot once capacity returns and the slack allows."""
    answers: dict[int, Replanned] = {}

    def answer(r: PlanRequest) -> tuple[bool, float]:
        if id(r) not in answers:
            answers[id(r)] = cheapest_or_fastest(r)
        return answers[id(r)].at_risk is None, answers[id(r)].result.predicted_time_s

    chosen = deadline_safe_choice(request, reserve_s, answer, lambda r: fastest_result(r).predicted_time_s)
    answer(chosen)
    return answers[id(chosen)]


def deadline_safe_choice(request: PlanRequest, reserve_s: float, answer: Callable[[PlanRequest], tuple[bool, float]],
                         fastest_s: Callable[[PlanRequest], float]) -> PlanRequest:
    """The question whose answer deadline_safe takes (the live session and the replay's memo ask
    their own way): `answer(r)`, whether r's answer meets its deadline and its predicted time;
    `fastest_s(r)`, the fastest plan's time under r's quotas and survivors."""
    spot_survivors = {t: n for t, n in request.existing.items() if not is_on_demand(t)}
    mixed = dataclasses.replace(request, existing=spot_survivors)
    spot_types = [i.type for i in request.profile.instances if not is_on_demand(i.type)]
    spot_only = dataclasses.replace(mixed, on_demand_quota={t: 0 for t in spot_types})
    if request.deadline_s > request.overhead_s and can_provision(spot_only):
        meets, time_s = answer(spot_only)
        # safe if the spot plan itself leaves the reserve (the fastest mix, which may use every
        # spot instance and more, is no slower), else if the fastest mix does
        if meets and (time_s + request.overhead_s + reserve_s <= request.deadline_s
                      or fastest_s(mixed) + reserve_s <= request.deadline_s):
            return spot_only
    # the workers running now, as they are: no start overhead (the planner charges one to every
    # plan, which near the end hides that the survivors alone still finish in time)
    spot_held = {t: spot_survivors.get(t, 0) for t in spot_types}
    on_demand_held = {t: request.existing.get(on_demand_name(t), 0) for t in spot_types}
    as_they_are = dataclasses.replace(request, quota=spot_held, on_demand_quota=on_demand_held, overhead_s=0.0)
    if any(request.existing.values()) and can_provision(as_they_are) and answer(as_they_are)[0]:
        return as_they_are
    reserved = dataclasses.replace(mixed, deadline_s=request.deadline_s - reserve_s)
    if reserved.deadline_s > reserved.overhead_s and can_provision(reserved) and answer(reserved)[0]:
        return reserved
    return mixed


def can_provision(request: PlanRequest) -> bool:
    """Whether the request can be planned at all: some quota (spot or on-demand) above 0 or
    survivors, and its floor of workers (min_workers) within the quotas."""
    spot = sum(request.quota.get(i.type, i.quota) for i in request.profile.instances)
    on_demand = sum(request.on_demand_quota.get(i.type, i.on_demand_quota) for i in request.profile.instances)
    most = max(spot + on_demand, sum(request.existing.values()))
    return most > 0 and (request.min_workers is None or request.min_workers <= most)


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

    def lookup(self, budget: float) -> tuple[dict[str, int], bool, float] | None:
        """The plan for this budget, whether it is the fastest plan (none meets it) and its scaled
        time, if known."""
        if self.fastest is not None and budget < self.fastest[0] * (1 - COST_TIE_REL):
            return self.fastest[1], True, self.fastest[0]
        i = bisect.bisect_right(self.starts, budget * (1 + COST_TIE_REL)) - 1  # plans' intervals are disjoint
        return (self.plans[i], False, self.starts[i]) if i >= 0 and self.ends[i] * (1 + COST_TIE_REL) >= budget else None

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
        return self.answer(request)[0]

    def deadline_safe(self, request: PlanRequest, reserve_s: float) -> dict[str, int]:
        """deadline_safe(request, reserve_s).result.plan, through the memo."""
        def meets_in(r: PlanRequest) -> tuple[bool, float]:
            _, at_risk, time_s = self.answer(r)
            return not at_risk, time_s

        return self.plan(deadline_safe_choice(request, reserve_s, meets_in, self.fastest_s))

    def fastest_s(self, request: PlanRequest) -> float:
        """The fastest plan's time under the request's quotas and survivors (remembered as the
        answer below its time)."""
        key, du = self._key(request)
        if key is None:  # before training (or with hazards) times do not scale, but the fastest is one number
            key, du = ("unscaled", request.current_loss, _request_key(request)), 1.0
        answers = self.answers.setdefault(key, _Answers())
        if answers.fastest is None:
            self.solves += 1
            result = fastest_result(request)
            answers.fastest = (result.predicted_time_s / du, result.plan)
        return answers.fastest[0] * du

    def answer(self, request: PlanRequest) -> tuple[dict[str, int], bool, float]:
        """The plan, whether it is the fastest plan because none meets the deadline, and its
        predicted time."""
        key, du = self._key(request)
        self.profiles[id(request.profile)] = request.profile
        budget = (request.deadline_s - request.overhead_s) / du if key is not None else None
        if key is not None and budget > 0:
            known = self.answers.setdefault(key, _Answers()).lookup(budget)
            if known is not None:
                self.hits += 1
                plan, at_risk, time_scaled = known
                return plan, at_risk, time_scaled * du
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
        return plan, replanned.at_risk is not None, replanned.result.predicted_time_s

    @staticmethod
    def _key(request: PlanRequest) -> tuple[tuple | None, float]:
        """The request less its budget and remaining progress, and du; (None, nan) when its
        answer does not scale (before training, or a solver that uses hazards)."""
        if request.current_loss is None or get_solver(request.solver).uses_hazards:
            return None, float("nan")
        g5 = request.profile.loss.gamma5
        du = 1.0 / (request.loss_target - g5) - 1.0 / (request.current_loss - g5)
        return _request_key(request), du


def _request_key(request: PlanRequest) -> tuple:
    """What a re-plan's answer depends on besides its budget and remaining progress."""
    return (id(request.profile), request.loss_target, request.solver, request.on_demand, request.bandwidth_margin,
            tuple(sorted(request.existing.items())), tuple(sorted(request.quota.items())),
            tuple(sorted(request.on_demand_quota.items())), tuple(request.regions), request.min_workers)
