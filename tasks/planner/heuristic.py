"""The spotDNN paper's Algorithm 1, kept faithful for comparison: bounds on the cluster size,
instances sorted by iteration time, and a sliding window of adjacent instances.

- n_lower (Eq. 15): the smallest size whose fastest possible cluster could still meet the
  deadline (the same valid bound the exact solver uses per size).
- n_upper (Eq. 16): the largest size at which the PS is not yet fully contended, P(n) < 1, i.e.
  alpha1*sqrt(n) + beta1 < 1. This is the paper's design choice, not a valid bound: it is one
  reason the heuristic can miss the optimum.
- Every available instance (quota minus existing) is listed once, sorted by its iteration time
  alone; for each size every window of adjacent instances (plus the existing instances, which are
  always in) is scored, and the cheapest window that meets the deadline wins.
"""
from __future__ import annotations

import math

import numpy as np

from tasks.planner.bounds import size_bounds
from tasks.planner.exact import Incumbent, pick_best, scored_rows
from tasks.planner.problem import COST_TIE_REL, Problem


def size_range(problem: Problem) -> tuple[int, int]:
    sizes, hi_total = problem.sizes, int(problem.upper.sum())
    j_lo, x_max, _ = size_bounds(problem, sizes)
    reachable = sizes[j_lo / x_max <= problem.budget_s]
    n_lower = int(reachable[0]) if len(reachable) else hi_total + 1
    a1, b1 = problem.request.profile.contention.alpha1, problem.request.profile.contention.beta1
    root = (1.0 - b1) / a1 if a1 > 0 else math.inf  # a1*sqrt(n) + b1 < 1  <=>  sqrt(n) < root
    n_upper = hi_total if root > math.sqrt(hi_total + 1) else math.ceil(root**2) - 1
    return n_lower, max(min(n_upper, hi_total), 0)


def solve_heuristic(problem: Problem) -> tuple[Incumbent, int]:
    """Returns the chosen cluster (or an empty Incumbent) and how many clusters were scored."""
    n_lower, n_upper = size_range(problem)
    counts, r = scored_rows(problem, f"heuristic windows from {n_lower}", lambda: windows(problem, n_lower, n_upper))
    best = Incumbent()
    ok = np.flatnonzero(r["time_s"] <= problem.budget_s * (1 + COST_TIE_REL))  # ties as exact.py
    if len(ok):
        i = ok[pick_best(r["cost_usd"][ok], r["time_s"][ok], r["workers"][ok], "cost", counts[ok], problem.name_order)]
        best = Incumbent(counts[i].copy(), float(r["cost_usd"][i]), float(r["time_s"][i]), float(r["workers"][i]))
    return best, len(counts)


def windows(problem: Problem, n_lower: int, n_upper: int) -> np.ndarray:
    """The distinct windows of every size from n_lower to n_upper (rows): the existing instances
    plus adjacent available instances in the order of their iteration time alone."""
    model = problem.model
    alone_s = model.iteration_times_s(np.array(1.0))
    name_rank = np.argsort(problem.name_order)  # ties in speed are listed by name, not profile order
    order = np.lexsort((name_rank, alone_s))
    free = problem.upper - problem.lower
    instances = np.repeat(order, free[order])  # type index of each available instance, fastest first
    existing = problem.lower
    m = len(existing)
    onehot = np.zeros((len(instances) + 1, m), dtype=np.int64)
    onehot[1:][np.arange(len(instances)), instances] = 1
    cum = np.cumsum(onehot, axis=0)  # cum[i] counts each type among the first i instances
    out = [np.zeros((0, m), dtype=np.int64)]
    for n in range(max(n_lower, int(existing.sum())), n_upper + 1):
        width = n - int(existing.sum())
        if width > len(instances):
            break
        if width == 0:
            out.append(existing[None, :].copy())
            continue
        starts = np.arange(len(instances) - width + 1)
        out.append(np.unique(cum[starts + width] - cum[starts] + existing, axis=0))
    return np.concatenate(out)
