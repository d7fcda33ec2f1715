"""Brute force: score every composition within the bounds (exact.search_all). For checking the
exact solver's branch and bound (tests, `spotfill bench planner`) on problems small enough to
enumerate."""
from __future__ import annotations

from tasks.planner.exact import Incumbent, search_all
from tasks.planner.problem import Problem


def solve_brute_force(problem: Problem, budgets_s: list[float] | None = None) -> list[Incumbent]:
    """The best plan for each budget (default: the problem's own), from one pass over every
    composition."""
    budgets_s = [problem.budget_s] if budgets_s is None else budgets_s
    return [best for best, _ in search_all(problem, "cost", budgets_s)]
