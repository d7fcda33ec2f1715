"""Provisioning: the cheapest spot mix that reaches the loss target before the deadline.

One entry point, `solve(PlanRequest) -> PlanResult`, whichever solver; see problem.py.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from tasks.core.errors import InfeasibleError
from tasks.planner import exact
from tasks.planner.heuristic import solve_heuristic
from tasks.planner.problem import PlanRequest, PlanResult, Problem, build_problem, make_result, require_training

__all__ = ["PlanRequest", "PlanResult", "solve", "solve_problem", "fastest_plan", "fastest_time_s"]


def seconds(value: float) -> str:
    """A time for a message: tenths of a second, or three digits once it is past a billion (a
    profile's absurd numbers would otherwise print hundreds of digits)."""
    return f"{value:.1f}" if abs(value) < 1e9 else f"{value:.3g}"


def fastest_plan(problem: Problem) -> tuple[exact.Incumbent, exact.SearchStats]:
    """The quickest plan the quotas (and existing instances) allow, whatever it costs: no deadline."""
    return exact.search(problem, objective="time", deadline_s=np.inf)


def fastest_time_s(problem: Problem) -> float:
    """The shortest predicted time of any plan allowed by the quotas (no deadline)."""
    return fastest_plan(problem)[0].time_s


def solve_problem(problem: Problem) -> PlanResult:
    """Solve a validated problem; an infeasible one comes back with status "infeasible"."""
    started = time.perf_counter()
    solver = problem.request.solver
    if solver == "risk":
        from tasks.planner.risk import solve_risk

        return solve_risk(problem)
    if solver == "exact":  # seeds its own incumbent (exact.py), so the heuristic's adds nothing
        best, stats = exact.search(problem, "cost")
        evaluated, status = stats.evaluated, "optimal"
    else:
        (best, evaluated), status = solve_heuristic(problem), "feasible"
    elapsed = time.perf_counter() - started
    if best.counts is None:
        fastest = fastest_time_s(problem)
        have = problem.budget_s * problem.time_factor
        overhead = problem.request.overhead_s
        level = problem.request.confidence
        floor = f" of at least {problem.min_workers} workers" if problem.min_workers > 1 else ""
        at = "" if level is None else f" at the upper end of its {level:.0%} interval"
        msg = (f"no plan meets the deadline{at}: the fastest plan within the quotas{floor} takes "
               f"{seconds(fastest * problem.time_factor)} s{' there' if at else ''} and {seconds(have)} s are available"
               + (f" (deadline minus {overhead:g} s overhead)" if overhead else ""))
        if not np.isfinite(fastest):
            msg = (f"no plan: the profile's numbers give no cluster a finite time (the fastest takes {fastest} s); "
                   "check the magnitudes of its fields")
        elif solver == "heuristic" and fastest <= have:
            msg = (f"the heuristic found no plan within its size bounds; the exact solver may "
                   f"(the fastest plan takes {seconds(fastest)} s, {seconds(have)} s are available)")
        return make_result(problem, None, solver, "infeasible", elapsed, evaluated, fastest, msg)
    result = make_result(problem, best.counts, solver, status, elapsed, evaluated)
    return result if problem.request.confidence is None else with_confidence(problem, result)


def with_confidence(problem: Problem, result: PlanResult) -> PlanResult:
    """The plan for the interval's upper end, with what it costs over the plan for the centre."""
    central = solve_problem(build_problem(replace(problem.request, confidence=None)))
    return replace(result, confidence={
        "level": problem.request.confidence, "time_factor": problem.time_factor,
        "upper_time_s": result.predicted_time_s * problem.time_factor,
        "central_cost_usd": central.predicted_cost_usd,
        "extra_cost_usd": result.predicted_cost_usd - central.predicted_cost_usd,
    })


def solve(request: PlanRequest) -> PlanResult:
    """Validate and solve; raises UserInputError for bad input and InfeasibleError when no plan
    meets the deadline (its message and `fastest_time_s` give the fastest reachable time)."""
    result = solve_problem(build_problem(request))
    if not result.feasible:
        raise InfeasibleError(result.message, result.fastest_time_s)
    require_training(result.iterations, request.loss_target, result.plan)
    return result
