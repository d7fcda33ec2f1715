"""The exact solver: branch and bound over instance counts, one worker total n at a time.

Why per n: the contention term makes every T_m depend on the cluster size alone, so with n fixed
the rates and prices are linear in the counts and tight bounds follow (bounds.py). Sizes are
visited in the order of their lower bound and the search stops once that bound exceeds the
incumbent, so there is no guessed cap on n. Inside one size a depth-first search fixes the counts
of the types (largest batch first, so the WA-batch interval narrows early) and prunes every prefix
whose bound cannot beat the incumbent or meet the deadline; the last two types are scored together
in one vectorised call. Every bound is valid, so the answer is optimal; the search is seeded with
the heuristic's plan, so it is never worse than the heuristic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from tasks.planner.bounds import IterationBound, greedy_fill_suffixes, rate_ceilings, rates_fixed_by_size, size_bounds
from tasks.planner.problem import COST_TIE_REL, Problem, better

Objective = Literal["cost", "time"]
_FLUSH_ROWS = 4096


@dataclass
class Incumbent:
    counts: np.ndarray | None = None
    cost: float = np.inf
    time_s: float = np.inf
    workers: float = np.inf

    def key(self, objective: Objective) -> float:
        return self.cost if objective == "cost" else self.time_s


@dataclass
class SearchStats:
    evaluated: int = 0
    nodes: int = 0
    sizes_searched: int = 0


def pick_best(cost: np.ndarray, time_s: np.ndarray, workers: np.ndarray, objective: Objective,
              keys: np.ndarray) -> int:
    """Index of the best row: lowest objective, ties (relative COST_TIE_REL) broken by the other
    measure, then by fewer workers, then by the largest tie key (rows of `keys`)."""
    first, second = (cost, time_s) if objective == "cost" else (time_s, cost)
    idx = np.flatnonzero(first <= first.min() * (1 + COST_TIE_REL))
    idx = idx[second[idx] <= second[idx].min() * (1 + COST_TIE_REL)]
    idx = idx[workers[idx] == workers[idx].min()]
    return int(max(idx, key=lambda i: tuple(keys[i])))


class BranchAndBound:
    def __init__(self, problem: Problem, objective: Objective, deadline_s: float, incumbent: Incumbent):
        self.problem = problem
        self.objective = objective
        self.deadline_s = deadline_s
        self.best = incumbent
        self.stats = SearchStats()
        types = problem.model.types
        alone_s = problem.model.iteration_times_s(np.array(1.0))
        self.order = np.lexsort((alone_s, -types.batch))  # largest batch first, then fastest
        self.lower = problem.lower[self.order]
        self.upper = problem.upper[self.order]
        self.batch = types.batch[self.order]
        self.price = problem.model.prices_usd_per_h[self.order]
        self.m = len(self.order)
        self.lo_suffix = np.concatenate([np.cumsum(self.lower[::-1])[::-1], [0]])
        self.hi_suffix = np.concatenate([np.cumsum(self.upper[::-1])[::-1], [0]])
        # Batch range of the types still usable from each level on.
        self.suffix_batch_lo = [min((b for b, u in zip(self.batch[k:], self.upper[k:]) if u > 0), default=np.inf)
                                for k in range(self.m + 1)]
        self.suffix_batch_hi = [max((b for b, u in zip(self.batch[k:], self.upper[k:]) if u > 0), default=-np.inf)
                                for k in range(self.m + 1)]
        self.buffer: list[np.ndarray] = []
        self.buffered = 0

    def run(self) -> None:
        lo_total, hi_total = int(self.lower.sum()), int(self.upper.sum())
        sizes = np.arange(max(1, lo_total), hi_total + 1)
        j_lo, x_max, ratio_min = size_bounds(self.problem, sizes)
        time_lo, cost_lo = j_lo / x_max, j_lo * ratio_min / 3600.0
        key_lo = cost_lo if self.objective == "cost" else time_lo
        for i in np.argsort(key_lo, kind="stable"):
            if time_lo[i] > self.deadline_s * (1 + COST_TIE_REL):
                continue
            if key_lo[i] > self.best.key(self.objective) * (1 + COST_TIE_REL):
                break  # sizes are visited in bound order: none after this can win
            self.search_size(int(sizes[i]))
            self.flush()

    def search_size(self, n: int) -> None:
        self.stats.sizes_searched += 1
        req = self.problem.request
        jb = IterationBound(req.profile, float(n), req.loss_target, req.current_loss)
        rate_arr = rate_ceilings(self.problem, np.array([n]))[0][self.order]
        exact_rates = rates_fixed_by_size(self.problem)  # else the fixed part's mean batch is unknown
        extra = self.upper - self.lower
        # Best fills of each suffix of the type order, for every remaining count 0..n (as lists:
        # the search below is scalar Python, where list indexing is far cheaper than numpy's).
        x_max = greedy_fill_suffixes(rate_arr, self.lower, extra, "max", n).tolist()
        x_min = greedy_fill_suffixes(rate_arr, self.lower, extra, "min", n).tolist()
        p_min = greedy_fill_suffixes(self.price, self.lower, extra, "min", n).tolist()
        ratio = np.where(self.upper > 0, self.price / rate_arr, np.inf)
        ratio_min = np.minimum.accumulate(ratio[::-1])[::-1].tolist()
        rate, price, batch = rate_arr.tolist(), self.price.tolist(), self.batch.tolist()
        lower, upper = self.lower.tolist(), self.upper.tolist()
        lo_suffix, hi_suffix = self.lo_suffix.tolist(), self.hi_suffix.tolist()
        b_lo, b_hi = self.suffix_batch_lo, self.suffix_batch_hi
        counts = np.zeros(self.m, dtype=np.int64)
        objective = self.objective
        deadline = self.deadline_s * (1 + COST_TIE_REL)
        last = self.m - 1
        stats = self.stats

        def descend(k: int, rem: int, x_f: float, y_f: float, p_f: float) -> None:
            stats.nodes += 1
            x_ub = x_f + x_max[k][rem]
            if x_ub <= 0:
                return
            if x_f > 0 and exact_rates:
                # The fixed part's mean batch can only be diluted towards the rest's batches, and
                # least so when the rest iterates slowest (x_min).
                mean_b, x_slow = y_f / x_f, x_min[k][rem]
                hi = mean_b if mean_b <= b_hi[k] else (y_f + b_hi[k] * x_slow) / (x_f + x_slow)
                lo = mean_b if mean_b >= b_lo[k] else (y_f + b_lo[k] * x_slow) / (x_f + x_slow)
                j_lo = jb.lower(min(lo, b_lo[k]), max(hi, b_hi[k]))
            else:  # fixed types come first in the order, so their batches are >= b_lo[k]
                j_lo = jb.lower(b_lo[k], b_hi[k] if x_f <= 0 else b_hi[0])
            time_lb = j_lo / x_ub
            if time_lb > deadline:
                return
            bound = self.best.key(objective) * (1 + COST_TIE_REL)
            if objective == "time":
                if time_lb > bound:
                    return
            else:
                ratio_lb = (p_f + p_min[k][rem]) / x_ub
                if x_f > 0:
                    ratio_lb = max(ratio_lb, min(p_f / x_f, ratio_min[k]))
                if j_lo * ratio_lb / 3600.0 > bound:
                    return
            c_lo = max(lower[k], rem - hi_suffix[k + 1])
            c_hi = min(upper[k], rem - lo_suffix[k + 1])
            if c_lo > c_hi:
                return
            if k >= last - 1:
                self.emit_leaves(counts, k, rem, c_lo, c_hi)
                return
            r_k, b_k, p_k = rate[k], batch[k], price[k]
            for c in range(c_lo, c_hi + 1):
                counts[k] = c
                descend(k + 1, rem - c, x_f + c * r_k, y_f + c * r_k * b_k, p_f + c * p_k)
            counts[k] = 0

        descend(0, n, 0.0, 0.0, 0.0)

    def emit_leaves(self, prefix: np.ndarray, k: int, rem: int, c_lo: int, c_hi: int) -> None:
        """All completions of a prefix whose free types are k (and k+1, taking the rest)."""
        cs = np.arange(c_lo, c_hi + 1)
        rows = np.repeat(prefix[None, :], len(cs), axis=0)
        rows[:, k] = cs
        if k + 1 < self.m:
            rows[:, k + 1] = rem - cs
        self.buffer.append(rows)
        self.buffered += len(rows)
        if self.buffered >= _FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        rows = np.concatenate(self.buffer)
        self.buffer, self.buffered = [], 0
        counts = np.empty_like(rows)
        counts[:, self.order] = rows  # back to profile order
        r = self.problem.evaluate(counts)
        self.stats.evaluated += len(rows)
        ok = np.flatnonzero(r["time_s"] <= self.deadline_s * (1 + COST_TIE_REL))
        if not len(ok):
            return
        keys = counts[:, self.problem.name_order]
        i = ok[pick_best(r["cost_usd"][ok], r["time_s"][ok], r["workers"][ok], self.objective, keys[ok])]
        cand = (float(r["cost_usd"][i]), float(r["time_s"][i]), float(r["workers"][i]))
        cur = (self.best.cost, self.best.time_s, self.best.workers)
        if self.objective == "time":
            cand, cur = (cand[1], cand[0], cand[2]), (cur[1], cur[0], cur[2])
        if self.best.counts is None or better(*cand, *cur, self.problem.tie_key(counts[i]),
                                              self.problem.tie_key(self.best.counts)):
            self.best = Incumbent(counts[i].copy(), *(float(r[k][i]) for k in ("cost_usd", "time_s", "workers")))


def search(problem: Problem, objective: Objective = "cost", deadline_s: float | None = None,
           incumbent: Incumbent | None = None) -> tuple[Incumbent, SearchStats]:
    """Optimal counts for `objective` among clusters finishing within deadline_s (default: the
    problem's budget; pass np.inf for no deadline)."""
    bnb = BranchAndBound(problem, objective, problem.budget_s if deadline_s is None else deadline_s,
                         incumbent or Incumbent())
    bnb.run()
    return bnb.best, bnb.stats
