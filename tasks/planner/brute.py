"""Brute force: score every composition within the bounds. Only for checking the exact solver
(tests, `spotfill bench planner`) on problems small enough to enumerate."""
from __future__ import annotations

import numpy as np

from tasks.planner.exact import Incumbent, composition_count, compositions, pick_best
from tasks.planner.problem import COST_TIE_REL, Problem, better

CHUNK_ROWS = 1 << 18


def solve_brute_force(problem: Problem, budgets_s: list[float] | None = None) -> list[Incumbent]:
    """The best plan for each budget (default: the problem's own), from one pass over every
    composition."""
    budgets_s = [problem.budget_s] if budgets_s is None else budgets_s
    total = composition_count(problem)
    best = [Incumbent() for _ in budgets_s]
    for start in range(0, total, CHUNK_ROWS):
        counts = compositions(problem, start, min(total, start + CHUNK_ROWS))
        r = problem.evaluate(counts)
        for b, budget_s in enumerate(budgets_s):
            ok = np.flatnonzero((r["time_s"] <= budget_s * (1 + COST_TIE_REL)) & (r["workers"] > 0))
            if not len(ok):
                continue
            i = ok[pick_best(r["cost_usd"][ok], r["time_s"][ok], r["workers"][ok], "cost",
                             counts[ok][:, problem.name_order])]
            cand = Incumbent(counts[i].copy(), float(r["cost_usd"][i]), float(r["time_s"][i]), float(r["workers"][i]))
            cur = best[b]
            if cur.counts is None or better(cand.cost, cand.time_s, cand.workers, cur.cost, cur.time_s, cur.workers,
                                            problem.tie_key(cand.counts), problem.tie_key(cur.counts)):
                best[b] = cand
    return best
