"""The provisioning problem (docs/model.md, Eq. 11-14) and its answer, independent of the solver."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from tasks.core.errors import UserInputError
from tasks.core.intervals import time_factor
from tasks.core.model import Model
from tasks.core.profile import Profile
from tasks.planner.offers import market_profile
from tasks.planner.on_demand import base_type, by_offer, is_on_demand, require_allowed, split_counts, with_on_demand
from tasks.planner.solvers import DEFAULT_SOLVER, get_solver

# Costs within this relative distance are ties (then lower time, then fewer instances win), so
# that floating-point summation order never decides between equally good plans.
COST_TIE_REL = 1e-9
RISK_LEVEL = 0.95  # the risk solver's default probability of meeting the deadline


@dataclass(frozen=True)
class PlanRequest:
    profile: Profile
    loss_target: float
    deadline_s: float
    existing: dict[str, int] = field(default_factory=dict)
    quota: dict[str, int] = field(default_factory=dict)  # overrides the profile's per-type quota
    # overrides the profile's per-type on_demand_quota: plans may then use `TYPE:on-demand` offers
    # (on_demand.py); quota and existing may name those offers too
    on_demand_quota: dict[str, int] = field(default_factory=dict)
    overhead_s: float = 0.0  # T_ohd: start/join time of new instances, taken off the deadline
    current_loss: float | None = None  # re-planning mid-training: the loss reached so far
    bandwidth_margin: float = 0.0
    solver: str = DEFAULT_SOLVER  # a name in solvers.SOLVERS
    on_demand: bool = False  # price at on-demand rates (the all-on-demand baseline)
    # solver="risk" (tasks/planner/risk.py): the cheapest plan (expected cost) that meets the
    # deadline with at least this probability, given per-type revocation hazards (revocations per
    # instance-hour; types left out are never revoked) and the time a revoked instance's
    # replacement takes to join.
    target_probability: float = RISK_LEVEL
    hazards_per_h: dict[str, float] = field(default_factory=dict)
    recovery_s: float = 120.0
    # ... and, per type, how much longer on average a revoked instance stays out because the
    # market refuses its replacement (no spot capacity): P(refused) x the mean wait for capacity
    # to return (market/study.py derives it from capacity records). Types left out: 0.
    replacement_wait_s: dict[str, float] = field(default_factory=dict)
    # Plan over offers (type, region) in these regions ("all": every one the catalog prices)
    # instead of the profile's types at its prices (offers.py); quota and existing may then
    # name offers (TYPE@REGION), and quota also types (every region).
    regions: tuple[str, ...] = ()
    # Plan no cluster smaller than this (a revocation then leaves survivors). None: the smallest
    # cluster the profile's loss curve was fitted on (Profile.fitted_workers), else 1.
    min_workers: int | None = None
    # Meet the deadline at the upper end of the prediction's two-sided interval at this level
    # (tasks/core/intervals.py; the profile must carry its measured error spread); None: at the centre.
    confidence: float | None = None


@dataclass(frozen=True)
class Problem:
    """A validated request as arrays: counts must lie in [lower, upper] per type."""

    request: PlanRequest
    model: Model
    lower: np.ndarray
    upper: np.ndarray
    budget_s: float  # deadline minus overhead, divided by time_factor
    time_factor: float = 1.0  # upper end of the confidence interval / central prediction
    offers: dict | None = None  # name -> offers.Offer when planning over regions
    min_workers: int = 1  # no plan has fewer workers (PlanRequest.min_workers)

    def evaluate(self, counts: np.ndarray) -> dict[str, np.ndarray]:
        return self.model.evaluate(counts, self.request.loss_target, self.request.current_loss)

    @property
    def sizes(self) -> np.ndarray:
        """The cluster sizes a plan may have: from the floor (or the existing instances, if more)
        to every quota filled."""
        return np.arange(max(self.min_workers, int(self.lower.sum())), int(self.upper.sum()) + 1)

    def large_enough(self, counts: np.ndarray) -> np.ndarray:
        """Which rows of counts have at least min_workers workers (so none is empty)."""
        return counts.sum(axis=1) >= self.min_workers

    @property
    def progress_left(self) -> float | None:
        """Mid-training, the remaining progress du = 1/(L - gamma5) - 1/(L0 - gamma5): every
        cluster's remaining iterations, time and cost are proportional to it (docs/model.md,
        re-planning). None before training, where they are not."""
        req = self.request
        if req.current_loss is None:
            return None
        g5 = self.model.profile.loss.gamma5
        return 1.0 / (req.loss_target - g5) - 1.0 / (req.current_loss - g5)

    @property
    def name_order(self) -> np.ndarray:
        """Type indices in name order: plans tied on cost, time and size are told apart by name,
        so the order of types in a profile never changes the answer."""
        return np.argsort(np.array(self.model.types.names), kind="stable")

    def tie_key(self, counts: np.ndarray) -> tuple[int, ...]:
        return tuple(int(c) for c in np.asarray(counts)[self.name_order])


@dataclass(frozen=True)
class PlanResult:
    """How the solve ended, scipy.optimize style: `status` says whether `plan` is usable."""

    status: Literal["optimal", "feasible", "infeasible"]
    plan: dict[str, int]
    predicted_time_s: float
    predicted_cost_usd: float
    iterations: float
    wa_batch: float
    cc: float
    usd_per_h: float
    solver: str
    solve_seconds: float
    evaluated: int = 0  # clusters scored
    fastest_time_s: float | None = None  # set when infeasible
    message: str = ""
    meet_probability: float | None = None  # solver="risk": estimated P(meeting the deadline)
    offers: dict[str, dict] | None = None  # planning over regions: each planned offer (Offer.to_json)
    # with a confidence level: level, time_factor, upper_time_s, central_cost_usd (the plan at
    # the centre's cost) and extra_cost_usd (what meeting the deadline at the upper end adds)
    confidence: dict | None = None
    min_workers: int = 1  # the floor the plan was held to (Problem.min_workers)
    # what one instance of each planned offer costs per hour, as the solve priced it (a spot type,
    # an offer, an on-demand twin): the table people read shows it
    unit_usd_per_h: dict[str, float] = field(default_factory=dict)
    # on-demand offers were allowed (on_demand.py): the JSON then splits the plan by market
    on_demand_allowed: bool = False

    @property
    def feasible(self) -> bool:
        return self.status != "infeasible"

    def to_json(self) -> dict:
        """The CLI contract's `plan --json` object."""
        return {
            "plan": self.plan,
            "predicted_time_s": self.predicted_time_s,
            "predicted_cost_usd": self.predicted_cost_usd,
            "iterations": self.iterations,
            "wa_batch": self.wa_batch,
            "cc": self.cc,
            "solver": self.solver,
            "solve_seconds": self.solve_seconds,
            **({} if self.offers is None else {"offers": self.offers}),
            **({} if self.confidence is None else {"confidence": self.confidence}),
            **({} if self.min_workers == 1 else {"min_workers": self.min_workers}),
            **({"markets": split_counts(self.plan)} if self.on_demand_allowed else {}),
        }


def _check_counts(profile: Profile, counts: dict[str, int], what: str) -> None:
    for name, n in counts.items():
        require_allowed(profile, name)
        profile.instance(name)
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise UserInputError(f"{what} for {name} must be a non-negative integer, got {n!r}")


def build_problem(req: PlanRequest) -> Problem:
    """Validate a request against its profile; every message names the offending value."""
    offers = None
    if req.regions:
        market, offers = market_profile(req.profile, tuple(req.regions), req.quota)
        req = dataclasses.replace(req, profile=market, quota={}, regions=(),
                                  on_demand_quota=by_offer(req.on_demand_quota, offers))
    req = dataclasses.replace(req, profile=with_on_demand(req.profile, req.on_demand_quota), on_demand_quota={})
    profile = req.profile
    g5 = profile.loss.gamma5
    if not math.isfinite(req.deadline_s) or req.deadline_s <= 0:
        raise UserInputError(f"deadline must be a positive number of seconds, got {req.deadline_s}")
    if not math.isfinite(req.loss_target):
        raise UserInputError(f"loss target must be a finite number, got {req.loss_target}")
    profile.loss.require_reachable(req.loss_target)
    if req.current_loss is not None:
        if not math.isfinite(req.current_loss) or req.current_loss <= g5:
            raise UserInputError(f"current loss must be a finite number above gamma5 = {g5}, got {req.current_loss}")
        if req.current_loss <= req.loss_target:
            raise UserInputError(
                f"current loss {req.current_loss} already meets the target {req.loss_target}: nothing to plan"
            )
    if not math.isfinite(req.overhead_s) or req.overhead_s < 0:
        raise UserInputError(f"overhead must be zero or more seconds, got {req.overhead_s}")
    if not 0.0 <= req.bandwidth_margin < 1.0:
        raise UserInputError(f"bandwidth margin must be in [0, 1), got {req.bandwidth_margin}")
    get_solver(req.solver)
    if not 0.0 < req.target_probability < 1.0:
        raise UserInputError(f"target probability must be in (0, 1), got {req.target_probability}")
    if not math.isfinite(req.recovery_s) or req.recovery_s < 0:
        raise UserInputError(f"recovery time must be zero or more seconds, got {req.recovery_s}")
    for name, wait_s in req.replacement_wait_s.items():
        profile.instance(name)
        if not math.isfinite(wait_s) or wait_s < 0:
            raise UserInputError(f"replacement wait for {name} must be zero or more seconds, got {wait_s}")
    for name, h in req.hazards_per_h.items():
        profile.instance(name)
        if not math.isfinite(h) or h < 0:
            raise UserInputError(f"hazard for {name} must be zero or more revocations per hour, got {h}")
        if h > 0 and is_on_demand(name):  # the risk solver counts no revocation of theirs
            raise UserInputError(f"hazard for {name}: on-demand workers are never revoked (name the spot "
                                 f"type {base_type(name)})")
    _check_counts(profile, req.existing, "existing count")
    _check_counts(profile, req.quota, "quota")

    model = Model.from_profile(profile, req.bandwidth_margin, req.on_demand)
    lower = model.counts_vector(req.existing)
    upper = model.types.quota.copy()
    for name, q in req.quota.items():
        upper[model.types.names.index(name)] = q
    short = [(nm, int(lo), int(hi)) for nm, lo, hi in zip(model.types.names, lower, upper) if hi < lo]
    if short:
        nm, lo, hi = short[0]
        raise UserInputError(f"quota for {nm} ({hi}) is below its existing count ({lo})")
    if upper.sum() == 0:
        raise UserInputError("every quota is 0: no instance can be provisioned")
    min_workers = workers_floor(req, int(upper.sum()))
    budget_s = req.deadline_s - req.overhead_s
    if budget_s <= 0:
        raise UserInputError(
            f"overhead {req.overhead_s} s leaves no time before the deadline {req.deadline_s} s"
        )
    factor = 1.0 if req.confidence is None else time_factor(profile, req.confidence, "confidence")
    return Problem(req, model, lower, upper, budget_s / factor, factor, offers, min_workers)


def workers_floor(req: PlanRequest, most: int) -> int:
    """The fewest workers a plan may have: the request's min_workers (more than the quotas allow
    is an error), else the smallest cluster the loss curve was fitted on, as far as the quotas
    allow: a re-plan short of quota still runs what it can rather than stop."""
    if req.min_workers is not None:
        if type(req.min_workers) is not int or req.min_workers < 1:
            raise UserInputError(f"min_workers must be a positive whole number, got {req.min_workers!r}")
        if req.min_workers > most:
            raise UserInputError(f"min_workers {req.min_workers} is more than the quotas allow ({most} in all)")
        return req.min_workers
    fitted = req.profile.fitted_workers
    return 1 if fitted is None else max(1, min(fitted[0], most))


def better(cost_a: float, time_a: float, n_a: float, cost_b: float, time_b: float, n_b: float,
           key_a: tuple = (), key_b: tuple = ()) -> bool:
    """Is plan a strictly better than plan b under docs/model.md's order (cost, then time, then size),
    full ties going to the larger tie key (Problem.tie_key: alphabetically earlier types)?"""
    if cost_a < cost_b * (1 - COST_TIE_REL):
        return True
    if cost_b < cost_a * (1 - COST_TIE_REL):
        return False
    if time_a < time_b * (1 - COST_TIE_REL):
        return True
    if time_b < time_a * (1 - COST_TIE_REL):
        return False
    if n_a != n_b:
        return n_a < n_b
    return key_a > key_b


def require_training(iterations: float, loss_target: float, cluster: dict[str, int]) -> None:
    """A target the fitted curve starts below needs no update: every cluster it holds for costs
    $0, so an answer of 0 s would look valid and say nothing. Refused, naming the cluster."""
    if iterations == 0:
        named = ", ".join(f"{t}={n}" for t, n in cluster.items() if n)
        raise UserInputError(f"loss target {loss_target:g} is at or above where the fitted loss curve starts on "
                             f"{named}: the model needs no update to reach it; name a lower target")


def make_result(problem: Problem, counts: np.ndarray | None, solver: str, status: str, solve_s: float,
                evaluated: int, fastest_time_s: float | None = None, message: str = "") -> PlanResult:
    names = problem.model.types.names
    on_demand_allowed = any(is_on_demand(name) for name in names)
    if counts is None:
        nan = float("nan")
        return PlanResult("infeasible", {}, nan, nan, nan, nan, nan, nan, solver, solve_s, evaluated,
                          fastest_time_s, message, min_workers=problem.min_workers, on_demand_allowed=on_demand_allowed)
    r = problem.evaluate(counts)
    plan = {names[i]: int(c) for i, c in enumerate(counts) if c > 0}
    unit_usd_per_h = {names[i]: float(problem.model.prices_usd_per_h[i]) for i, c in enumerate(counts) if c > 0}
    # an on-demand twin of an offer is bought in the offer's region, on the other market
    offers = None if problem.offers is None else {
        name: problem.offers[base_type(name)].to_json() | ({"market": "on-demand"} if is_on_demand(name) else {})
        for name in plan}
    return PlanResult(
        status=status, plan=plan,
        predicted_time_s=float(r["time_s"][0]), predicted_cost_usd=float(r["cost_usd"][0]),
        iterations=float(r["iterations"][0]), wa_batch=float(r["wa_batch"][0]), cc=float(r["cc"][0]),
        usd_per_h=float(r["usd_per_h"][0]), solver=solver, solve_seconds=solve_s, evaluated=evaluated,
        message=message, offers=offers, min_workers=problem.min_workers, unit_usd_per_h=unit_usd_per_h,
        on_demand_allowed=on_demand_allowed,
    )
