"""Provisioning: the cheapest spot mix that reaches the loss target before the deadline.

One entry point, `solve(PlanRequest) -> PlanResult`, whichever solver; see problem.py.
"""
from __future__ import annotations

import time

import numpy as np

from tasks.errors import InfeasibleError
from tasks.planner import exact
from tasks.planner.heuristic import solve_heuristic
from tasks.planner.problem import PlanRequest, PlanResult, Problem, build_problem, make_result

__all__ = ["PlanRequest", "PlanResult", "solve", "solve_problem", "fastest_time_s"]


def fastest_time_s(problem: Problem) -> float:
    """The shortest predicted time of any plan allowed by the quotas (no deadline)."""
    best, _ = exact.search(problem, objective="time", deadline_s=np.inf)
    return best.time_s


def solve_problem(problem: Problem) -> PlanResult:
    """Solve a validated problem; an infeasible one comes back with status "infeasible"."""
    started = time.perf_counter()
    solver = problem.request.solver
    if solver == "risk":
        from tasks.market.risk import solve_risk

        return solve_risk(problem)
    if solver == "exact":  # seeds its own incumbent (exact.py), so the heuristic's adds nothing
        best, stats = exact.search(problem, "cost")
        evaluated, status = stats.evaluated, "optimal"
    else:
        (best, evaluated), status = solve_heuristic(problem), "feasible"
    elapsed = time.perf_counter() - started
    if best.counts is None:
        fastest = fastest_time_s(problem)
        have = problem.budget_s
        overhead = problem.request.overhead_s
        msg = (f"no plan meets the deadline: the fastest plan within the quotas takes {fastest:.1f} s"
               f" and {have:.1f} s are available" + (f" (deadline minus {overhead:g} s overhead)" if overhead else ""))
        if solver == "heuristic" and np.isfinite(fastest) and fastest <= have:
            msg = (f"the heuristic found no plan within its size bounds; the exact solver may "
                   f"(the fastest plan takes {fastest:.1f} s, {have:.1f} s are available)")
        return make_result(problem, None, solver, "infeasible", elapsed, evaluated, fastest, msg)
    return make_result(problem, best.counts, solver, status, elapsed, evaluated)


def solve(request: PlanRequest) -> PlanResult:
    """Validate and solve; raises UserInputError for bad input and InfeasibleError when no plan
    meets the deadline (its message and `fastest_time_s` give the fastest reachable time)."""
    result = solve_problem(build_problem(request))
    if not result.feasible:
        raise InfeasibleError(result.message, result.fastest_time_s)
    return result
