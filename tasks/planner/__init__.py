"""Provisioning: the cheapest spot mix that reaches the loss target before the deadline.

One entry point, `solve(PlanRequest) -> PlanResult`, whichever solver; see problem.py. Solvers
are dispatched by name from one table (solvers.py).
"""
from __future__ import annotations

from tasks.core.errors import InfeasibleError
from tasks.planner import plain, risk  # noqa: F401  each registers its solvers (solvers.py), plain's first
from tasks.planner.exact import fastest_plan, fastest_time_s
from tasks.planner.problem import PlanRequest, PlanResult, Problem, build_problem, require_training
from tasks.planner.solvers import SOLVERS

__all__ = ["PlanRequest", "PlanResult", "solve", "solve_problem", "fastest_plan", "fastest_time_s"]


def solve_problem(problem: Problem) -> PlanResult:
    """Solve a validated problem; an infeasible one comes back with status "infeasible"."""
    return SOLVERS[problem.request.solver].solve(problem)


def solve(request: PlanRequest) -> PlanResult:
    """Validate and solve; raises UserInputError for bad input and InfeasibleError when no plan
    meets the deadline (its message and `fastest_time_s` give the fastest reachable time)."""
    result = solve_problem(build_problem(request))
    if not result.feasible:
        raise InfeasibleError(result.message, result.fastest_time_s)
    require_training(result.iterations, request.loss_target, result.plan)
    return result
