"""The exact and the heuristic solver as answers: a search's best cluster as a PlanResult, the
reason when there is none, and, at a confidence level, what the plan costs over the centre's.
Below the dispatch, so the risk solver falls back on the exact answer from here."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from tasks.planner import exact, heuristic
from tasks.planner.exact import Incumbent, fastest_time_s
from tasks.planner.problem import PlanResult, Problem, build_problem, make_result
from tasks.planner.solvers import register


def seconds(value: float) -> str:
    """A time for a message: tenths of a second, or three digits once it is past a billion (a
    profile's absurd numbers would otherwise print hundreds of digits)."""
    return f"{value:.1f}" if abs(value) < 1e9 else f"{value:.3g}"


@register("exact")
def exact_answer(problem: Problem) -> PlanResult:
    """The optimum (exact.py seeds its own incumbent, so the heuristic's would add nothing)."""
    started = time.perf_counter()
    best, stats = exact.search(problem, "cost")
    return _answer(problem, exact_answer, best, stats.evaluated, "optimal", started)


@register("heuristic")
def heuristic_answer(problem: Problem) -> PlanResult:
    """The spotDNN paper's Algorithm 1 (heuristic.py): searches within its size bounds only, so
    it may find no plan where the exact solver finds one."""
    started = time.perf_counter()
    best, evaluated = heuristic.solve_heuristic(problem)
    return _answer(problem, heuristic_answer, best, evaluated, "feasible", started, bounded=True)


def _answer(problem: Problem, solve: Callable[[Problem], PlanResult], best: Incumbent, evaluated: int,
            status: str, started: float, *, bounded: bool = False) -> PlanResult:
    """`best` as the answer of `solve` (which also solves the centre, for a confidence level);
    bounded: the search may miss a plan that the fastest plan's time shows exists."""
    elapsed = time.perf_counter() - started
    solver = problem.request.solver
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
        elif bounded and fastest <= have:
            msg = (f"the {solver} found no plan within its size bounds; the exact solver may "
                   f"(the fastest plan takes {seconds(fastest)} s, {seconds(have)} s are available)")
        return make_result(problem, None, solver, "infeasible", elapsed, evaluated, fastest, msg)
    result = make_result(problem, best.counts, solver, status, elapsed, evaluated)
    if problem.request.confidence is None:
        return result
    central = solve(build_problem(replace(problem.request, confidence=None)))
    return replace(result, confidence={
        "level": problem.request.confidence, "time_factor": problem.time_factor,
        "upper_time_s": result.predicted_time_s * problem.time_factor,
        "central_cost_usd": central.predicted_cost_usd,
        "extra_cost_usd": result.predicted_cost_usd - central.predicted_cost_usd,
    })
