"""The exact solver: branch and bound over instance counts, one worker total n at a time.

Why per n: the contention term makes every T_m depend on the cluster size alone, so with n fixed
the rates and prices are linear in the counts and tight bounds follow (bounds.py). Sizes are
visited in the order of their lower bound and the search stops once that bound exceeds the
incumbent, so there is no guessed cap on n. Inside one size the search fixes the counts of the
types in order (largest batch first, so the WA-batch interval narrows early), a whole level of
partial clusters at a time as numpy arrays (depth-first over chunks when a level grows large, so
the incumbent tightens as it goes), and prunes every prefix whose bound cannot beat the incumbent
or meet the deadline. Every bound is valid, so the answer is optimal.

Three things make the bounds bite early:
- Dominated offers: offers with the same hardware (the same type in several regions, or types
  with the same GPUs and batch) are twins that differ only in price. Swapping an instance to a
  cheaper twin changes nothing but the cost, so a twin is only used beyond its existing count
  once every cheaper twin is full; twins then cost no more branching than one type.
- A seeded incumbent: before any search, the greedy clusters of the sizes with the lowest bounds
  (filled fastest first, best price per rate first, and one type at a time) are scored in one
  vectorised pass, besides any incumbent the caller passes.
- The one-class completion bound (bounds.VertexBound): with the rates fixed by the size, the
  cheapest (or quickest) completion of a prefix, relaxed to real counts, puts every free instance
  in one class, so a bound that weighs iterations and price together costs one pass over the
  classes; it also bounds each size before any search.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from tasks.planner.bounds import (IterationBound, MultiplierTest, SuffixFills, VertexBound, rate_ceilings,
                                  rates_fixed_by_size, size_bounds)
from tasks.planner.problem import COST_TIE_REL, Problem, better

Objective = Literal["cost", "time"]
_CHUNK_ROWS = 1 << 15
_ENUMERATE_ROWS = 1 << 14
_ENUMERATE_CHUNK_ROWS = 1 << 18
_MULTIPLIER_MIN_ROWS = 32  # levels with fewer live prefixes skip the multiplier tests
_GRID = 32  # multipliers per size at which MultiplierTest takes its fills
_SEED_SIZES = 64  # the sizes with the lowest bounds are seeded


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
              counts: np.ndarray, order: np.ndarray) -> int:
    """Index of the best row: lowest objective, ties (relative COST_TIE_REL) broken by the other
    measure, then by fewer workers, then by the largest tie key (the row of counts in `order`)."""
    first, second = (cost, time_s) if objective == "cost" else (time_s, cost)
    idx = np.flatnonzero(first <= first.min() * (1 + COST_TIE_REL))
    if len(idx) > 1:
        idx = idx[second[idx] <= second[idx].min() * (1 + COST_TIE_REL)]
        idx = idx[workers[idx] == workers[idx].min()]
    if len(idx) == 1:
        return int(idx[0])
    keys = counts[idx][:, order]
    return int(idx[max(range(len(idx)), key=lambda j: tuple(keys[j]))])


class BranchAndBound:
    def __init__(self, problem: Problem, objective: Objective, deadline_s: float, incumbent: Incumbent):
        self.problem = problem
        self.objective = objective
        self.deadline_s = deadline_s
        self.best = incumbent
        self.stats = SearchStats()
        types = problem.model.types
        price = problem.model.prices_usd_per_h
        name_rank = np.argsort(problem.name_order)
        # Items (the offers) by class, largest batch first, then fastest; within a class (same
        # hardware) cheapest first, then by name, which is how ties between twins are broken
        # (Problem.tie_key).
        self.order = np.lexsort((name_rank, price, types.gpus, types.compute_s, -types.batch))
        hardware = np.stack([types.batch, types.compute_s, types.gpus], axis=1)[self.order]
        self.owner = np.cumsum(np.r_[False, (hardware[1:] != hardware[:-1]).any(axis=1)])
        self.item_lower = problem.lower[self.order]
        self.item_extra = (problem.upper - problem.lower)[self.order]
        self.item_price = price[self.order]
        self.m = int(self.owner[-1]) + 1
        self.first = np.flatnonzero(np.r_[True, self.owner[1:] != self.owner[:-1]])  # first item of each class
        self.lower = np.bincount(self.owner, self.item_lower, self.m).astype(np.int64)
        self.upper = self.lower + np.bincount(self.owner, self.item_extra, self.m).astype(np.int64)
        self.batch = types.batch[self.order][self.first]
        # An instance beyond the existing goes to the cheapest member with room: what a class of
        # c instances costs is convex in c (row: class, column: c).
        self.extra_before = (np.cumsum(self.item_extra) - self.item_extra) - (np.cumsum(self.item_extra)
                                                                              - self.item_extra)[self.first][self.owner]
        self.class_price = np.full((self.m, int(self.upper.max()) + 1), np.inf)
        for c in range(self.m):
            mine = self.owner == c
            cap, p = self.item_extra[mine].astype(float), self.item_price[mine]
            counts = np.arange(self.lower[c], self.upper[c] + 1)
            fill = np.interp(counts - self.lower[c], np.r_[0.0, np.cumsum(cap)], np.r_[0.0, np.cumsum(cap * p)])
            self.class_price[c, counts] = (self.item_lower[mine] * p).sum() + fill
        # Contention by load: the rates are ceilings, so a fixed part's mean batch is unknown.
        self.exact_rates = rates_fixed_by_size(problem)
        self.free_price = np.minimum.reduceat(np.where(self.item_extra > 0, self.item_price, np.inf), self.first)
        self.price_fills = SuffixFills(self.item_price, self.item_lower, self.item_extra, "min", self.owner)
        self.lo_suffix = np.concatenate([np.cumsum(self.lower[::-1])[::-1], [0]])
        self.hi_suffix = np.concatenate([np.cumsum(self.upper[::-1])[::-1], [0]])
        # Batch range of the classes still usable from each level on.
        self.suffix_batch_lo = [min((b for b, u in zip(self.batch[k:], self.upper[k:]) if u > 0), default=np.inf)
                                for k in range(self.m + 1)]
        self.suffix_batch_hi = [max((b for b, u in zip(self.batch[k:], self.upper[k:]) if u > 0), default=-np.inf)
                                for k in range(self.m + 1)]
        # Where the affine iteration bound touches j when j is convex in the batch (the noise term):
        # inside the usable batch range, so that the tangent is close over all of it (with no usable
        # class nothing is searched, and any batch does).
        lo, hi = self.suffix_batch_lo[0], self.suffix_batch_hi[0]
        self.tangent_batch = float(np.sqrt(lo * hi)) if lo <= hi else 1.0

    def run(self) -> None:
        sizes = self.problem.sizes
        j_lo, x_max, ratio_min = size_bounds(self.problem, sizes)
        time_lo, cost_lo = j_lo / x_max, j_lo * ratio_min / 3600.0
        key_lo = cost_lo if self.objective == "cost" else time_lo
        if self.exact_rates:  # one-class completions of each size (bounds.VertexBound)
            vertex = self.vertex_bound(sizes)
            zero = np.zeros(len(sizes))
            t_root, c_root = vertex.bounds(0, sizes, zero, zero, zero, self.deadline_s * (1 + COST_TIE_REL))
            time_lo = np.maximum(time_lo, t_root)
            key_lo = np.maximum(key_lo, c_root if self.objective == "cost" else t_root)
        order = np.argsort(key_lo, kind="stable")
        order = order[time_lo[order] <= self.deadline_s * (1 + COST_TIE_REL)]
        self.seed(sizes[order[:_SEED_SIZES]])
        for i in order:
            if key_lo[i] > self.best.key(self.objective) * (1 + COST_TIE_REL):
                break  # sizes are visited in bound order: none after this can win
            self.search_size(int(sizes[i]))

    def seed(self, sizes: np.ndarray) -> None:
        """Score the greedy clusters of some sizes: a good incumbent before the search starts."""
        if not len(sizes):
            return
        rate = self.size_rates(int(np.median(sizes)))
        cheapest = self.item_price[self.first]
        extra = (self.upper - self.lower).astype(float)
        free = (sizes - self.lower.sum()).astype(float)
        fills = []
        for first in (np.argsort(-rate, kind="stable"), np.argsort(cheapest / rate, kind="stable")):
            cap = extra[first]
            take = np.clip(free[:, None] - (np.cumsum(cap) - cap)[None, :], 0.0, cap[None, :])
            rows = np.repeat(self.lower[None, :], len(sizes), axis=0)
            rows[:, first] += take.astype(np.int64)
            fills.append(rows)
        for k in np.flatnonzero(extra > 0):  # one class added to the existing instances
            fit = free[(free >= 0) & (free <= extra[k])]
            rows = np.repeat(self.lower[None, :], len(fit), axis=0)
            rows[:, k] += fit.astype(np.int64)
            fills.append(rows)
        rows = np.concatenate(fills)
        rows = rows[self.problem.large_enough(rows)]
        for start in range(0, len(rows), _CHUNK_ROWS):
            self.consider(rows[start:start + _CHUNK_ROWS])
        self.climb()

    def climb(self, rounds: int = 50) -> None:
        """Hill-climb from the incumbent: add, drop or move one instance while that improves it."""
        if self.best.counts is None:
            return
        eye = np.eye(self.m, dtype=np.int64)
        steps = np.concatenate([eye, -eye, (eye[:, None, :] - eye[None, :, :]).reshape(-1, self.m)])
        for _ in range(rounds):
            before = self.best
            here = np.bincount(self.owner, self.best.counts[self.order], self.m).astype(np.int64)
            rows = here + steps
            inside = ((rows >= self.lower) & (rows <= self.upper)).all(axis=1)
            rows = rows[inside & self.problem.large_enough(rows)]
            self.consider(rows)
            if self.best is before:
                return

    def vertex_bound(self, sizes: np.ndarray) -> VertexBound:
        """The one-class completion bound of clusters of each size (row i: size i)."""
        req = self.problem.request
        rate = rate_ceilings(self.problem, sizes)[:, self.order][:, self.first]
        j_each = IterationBound(req.profile, sizes[:, None].astype(float), req.loss_target,
                                req.current_loss).affine(self.batch, self.tangent_batch)
        return VertexBound(rate, j_each, self.lower, self.upper, self.class_price[np.arange(self.m), self.lower],
                           self.free_price)

    def size_rates(self, n: int) -> np.ndarray:
        """Iteration rate of one instance of each class in a cluster of n (with contention by load,
        a ceiling on it: bounds.rate_ceilings)."""
        return rate_ceilings(self.problem, np.array([n]))[0][self.order][self.first]

    def search_size(self, n: int) -> None:
        self.stats.sizes_searched += 1
        req = self.problem.request
        rate = self.size_rates(n)
        item_rate = rate[self.owner]
        jb = IterationBound(req.profile, float(n), req.loss_target, req.current_loss)
        j_each = jb.affine(self.batch, self.tangent_batch)
        lower, extra, owner = self.item_lower, self.item_extra, self.owner
        x_max = SuffixFills(item_rate, lower, extra, "max", owner)
        ratio = np.where(lower + extra > 0, self.item_price / item_rate, np.inf)
        level = _SizeLevels(
            jb=jb, rate=rate, j_each=j_each,
            # Best fills of each suffix of the class order, for any remaining count.
            x_max=x_max, x_min=SuffixFills(item_rate, lower, extra, "min", owner), p_min=self.price_fills,
            ratio_min=np.minimum.accumulate(np.minimum.reduceat(ratio, self.first)[::-1])[::-1],
            price_test=None, time_test=None,
            vertex=self.vertex_bound(np.array([n])) if self.exact_rates else None,
        )
        x_root = float(x_max.at(0, np.array([n]))[0])
        t_bound = min(self.deadline_s, self.best.time_s if self.objective == "time" else np.inf) * (1 + COST_TIE_REL)
        if 0 < t_bound < np.inf and x_root > 0 and self.exact_rates:  # L / X needs the true rates
            level.time_test = MultiplierTest(item_rate * j_each[owner], item_rate, lower, extra,
                                             _geometric(0.05 * t_bound * x_root, t_bound * x_root), owner)
        j_root = float(jb.lower(self.suffix_batch_lo[0], self.suffix_batch_hi[0]))
        cost_bound = self.best.cost * (1 + COST_TIE_REL)
        if self.objective == "cost" and np.isfinite(cost_bound) and j_root > 0:
            top = 3600.0 * cost_bound / j_root
            if top > level.ratio_min[0] > 0:
                level.price_test = MultiplierTest(self.item_price, item_rate, lower, extra,
                                                  _geometric(level.ratio_min[0], top), owner)
        zero = np.zeros(1)
        self.descend(level, 0, np.zeros((1, self.m), dtype=np.int64), np.array([n]), zero, zero, zero, zero)

    def descend(self, lv: "_SizeLevels", k: int, counts: np.ndarray, rem: np.ndarray, x_f: np.ndarray,
                y_f: np.ndarray, p_f: np.ndarray, l_f: np.ndarray) -> None:
        """Fix the counts of classes k.. for a batch of prefixes (rows of counts), pruning as it goes."""
        deadline = self.deadline_s * (1 + COST_TIE_REL)
        while True:
            self.stats.nodes += len(rem)
            keep = self.bound_holds(lv, k, rem, x_f, y_f, p_f, l_f, deadline)
            c_lo = np.maximum(self.lower[k], rem - self.hi_suffix[k + 1])
            c_hi = np.minimum(self.upper[k], rem - self.lo_suffix[k + 1])
            keep &= c_lo <= c_hi
            if not keep.all():
                counts, rem, x_f, y_f, p_f, l_f, c_lo, c_hi = (
                    a[keep] for a in (counts, rem, x_f, y_f, p_f, l_f, c_lo, c_hi))
            if not len(rem):
                return
            width = c_hi - c_lo + 1
            if k == self.m - 1:
                counts[:, k] = c_lo
                self.consider(counts)
                return
            ends = np.cumsum(width)
            if ends[-1] > _CHUNK_ROWS and len(rem) > 1:  # depth first over chunks of this level
                cuts = np.searchsorted(ends, np.arange(_CHUNK_ROWS, ends[-1], _CHUNK_ROWS), side="right")
                for part in np.split(np.arange(len(rem)), np.unique(np.clip(cuts, 1, len(rem) - 1))):
                    self.descend(lv, k, counts[part], rem[part], x_f[part], y_f[part], p_f[part], l_f[part])
                return
            parent = np.repeat(np.arange(len(rem)), width)
            c = c_lo[parent] + np.arange(ends[-1]) - (ends - width)[parent]
            counts = counts[parent]
            counts[:, k] = c
            r_k = lv.rate[k]
            rem, x_f = rem[parent] - c, x_f[parent] + c * r_k
            y_f, p_f = y_f[parent] + c * r_k * self.batch[k], p_f[parent] + self.class_price[k, c]
            l_f = l_f[parent] + c * r_k * lv.j_each[k]
            k += 1

    def bound_holds(self, lv: "_SizeLevels", k: int, rem: np.ndarray, x_f: np.ndarray, y_f: np.ndarray,
                    p_f: np.ndarray, l_f: np.ndarray, deadline: float) -> np.ndarray:
        """Which prefixes (types before k fixed, rem instances left) may still hold a cluster that
        beats the incumbent within the deadline."""
        b_lo, b_hi = self.suffix_batch_lo[k], self.suffix_batch_hi[k]
        x_rest_max, x_rest_min = lv.x_max.at(k, rem), lv.x_min.at(k, rem)
        x_ub = x_f + x_rest_max
        with np.errstate(divide="ignore", invalid="ignore"):
            if k == 0:
                j_lo = np.full(len(rem), lv.jb.lower(b_lo, b_hi))
                ratio_lb = np.maximum(lv.p_min.at(k, rem) / x_ub, lv.ratio_min[k])
            else:
                # The rest (batches in [b_lo, b_hi], rate in [x_rest_min, x_rest_max]) pulls the
                # fixed part's mean batch towards its own batches, the more the faster it is.
                mean_b = y_f / x_f

                def pulled(b: float, towards: np.ndarray) -> np.ndarray:
                    x = np.where(towards, x_rest_max, x_rest_min)
                    return (y_f + b * x) / (x_f + x)

                hi = pulled(b_hi, mean_b <= b_hi)
                lo = pulled(b_lo, mean_b >= b_lo)
                if self.exact_rates:
                    j_lo = np.where(x_f > 0, lv.jb.lower(lo, hi), lv.jb.lower(b_lo, b_hi))
                else:  # fixed classes come first in the order, so their batches are >= b_lo
                    j_lo = np.where(x_f > 0, lv.jb.lower(b_lo, self.suffix_batch_hi[0]), lv.jb.lower(b_lo, b_hi))
                # P / X: the rest pays at least ratio_min per unit of rate (and p_min in all),
                # so the mediant is bounded at the end of the rest's rate range nearest to it.
                rho = lv.ratio_min[k]
                x = np.where(p_f >= rho * x_f, x_rest_max, x_rest_min)
                mediant = np.where(x_f + x > 0, (p_f + rho * x) / (x_f + x), np.inf)
                ratio_lb = np.maximum((p_f + lv.p_min.at(k, rem)) / x_ub, mediant)
            time_lb = j_lo / x_ub
            bound = self.best.key(self.objective) * (1 + COST_TIE_REL)
            pruned = (x_ub <= 0) | (time_lb > deadline)
            if self.objective == "time":
                pruned |= time_lb > bound
            else:
                pruned |= j_lo * ratio_lb / 3600.0 > bound
            live = np.flatnonzero(~pruned)
            if lv.vertex is not None and len(live):
                args = (k, rem[live], l_f[live], x_f[live], p_f[live])
                t_lb, c_lb = lv.vertex.bounds(*args, deadline)
                pruned[live] = (t_lb > deadline) | ((t_lb if self.objective == "time" else c_lb) > bound)
                live = np.flatnonzero(~pruned)
            if len(live) < _MULTIPLIER_MIN_ROWS:  # a few prefixes: cheaper to expand than to test
                return ~pruned
            if lv.price_test is not None:
                pruned[live] = lv.price_test.fails(k, rem[live], p_f[live], x_f[live], 3600.0 * bound / j_lo[live])
                live = np.flatnonzero(~pruned)
            if lv.time_test is not None and len(live):
                t = min(deadline, bound) if self.objective == "time" else deadline
                pruned[live] = lv.time_test.fails(k, rem[live], l_f[live], x_f[live], t * x_ub[live])
        return ~pruned

    def offer_counts(self, rows: np.ndarray) -> np.ndarray:
        """Class counts (rows) -> offer counts in profile order, each class filled cheapest first."""
        extra = (rows - self.lower)[:, self.owner]
        items = self.item_lower + np.clip(extra - self.extra_before, 0, self.item_extra)
        counts = np.empty_like(items)
        counts[:, self.order] = items
        return counts

    def consider(self, rows: np.ndarray) -> None:
        """Score complete clusters (rows of class counts) and keep the best as the incumbent."""
        self.consider_counts(self.offer_counts(rows))

    def consider_counts(self, counts: np.ndarray) -> None:
        """Score complete clusters (rows of offer counts, profile order); keep the best."""
        self.best = keep_best(self.problem, self.objective, self.deadline_s, self.best, counts)
        self.stats.evaluated += len(counts)


def keep_best(problem: Problem, objective: Objective, deadline_s: float, best: Incumbent, counts: np.ndarray,
              r: dict[str, np.ndarray] | None = None) -> Incumbent:
    """The better of `best` and the best of `counts` (rows of offer counts, scored as `r` when
    given) that finish within deadline_s."""
    if not len(counts):
        return best
    r = problem.evaluate(counts) if r is None else r
    ok = np.flatnonzero(r["time_s"] <= deadline_s * (1 + COST_TIE_REL))
    if not len(ok):
        return best
    i = ok[pick_best(r["cost_usd"][ok], r["time_s"][ok], r["workers"][ok], objective, counts[ok], problem.name_order)]
    cand = (float(r["cost_usd"][i]), float(r["time_s"][i]), float(r["workers"][i]))
    cur = (best.cost, best.time_s, best.workers)
    if objective == "time":
        cand, cur = (cand[1], cand[0], cand[2]), (cur[1], cur[0], cur[2])
    if best.counts is None or better(*cand, *cur, problem.tie_key(counts[i]), problem.tie_key(best.counts)):
        return Incumbent(counts[i].copy(), *(float(r[k][i]) for k in ("cost_usd", "time_s", "workers")))
    return best


@dataclass
class _SizeLevels:
    """What bounds every prefix in a cluster of one size: rates, best suffix fills and the
    iteration bound."""

    jb: IterationBound
    rate: np.ndarray
    j_each: np.ndarray  # IterationBound.affine at each type's batch
    x_max: SuffixFills
    x_min: SuffixFills
    p_min: SuffixFills
    ratio_min: np.ndarray
    price_test: MultiplierTest | None  # cost within the incumbent's
    time_test: MultiplierTest | None  # time within the deadline (and the incumbent's, for time)
    vertex: VertexBound | None  # one-class completions (rates fixed by the size only)


def _geometric(lo: float, hi: float) -> np.ndarray:
    """_GRID multipliers from lo to hi, evenly spaced in ratio (hi itself last)."""
    return lo * (hi / lo) ** (np.arange(_GRID) / (_GRID - 1))


def compositions(problem: Problem, start: int, stop: int) -> np.ndarray:
    """Rows start..stop-1 of every count vector within the problem's bounds, in mixed radix."""
    radix = problem.upper - problem.lower + 1
    strides = np.concatenate([np.cumprod(radix[::-1])[::-1][1:], [1]])
    idx = np.arange(start, stop, dtype=np.int64)
    return (idx[:, None] // strides) % radix + problem.lower


def composition_count(problem: Problem) -> int:
    return int(np.prod((problem.upper - problem.lower + 1).astype(object)))


def search(problem: Problem, objective: Objective = "cost", deadline_s: float | None = None,
           incumbent: Incumbent | None = None, enumerate_below: int = _ENUMERATE_ROWS) -> tuple[Incumbent, SearchStats]:
    """Optimal counts for `objective` among clusters finishing within deadline_s (default: the
    problem's budget; pass np.inf for no deadline). Problems with fewer than `enumerate_below`
    count vectors (re-plans of a few types) are scored whole in one vectorised pass, cheaper
    than setting up bounds."""
    deadline_s = problem.budget_s if deadline_s is None else deadline_s
    if composition_count(problem) < enumerate_below:
        return search_all(problem, objective, [deadline_s], incumbent)[0]
    bnb = BranchAndBound(problem, objective, deadline_s, incumbent or Incumbent())
    bnb.run()
    return bnb.best, bnb.stats


def fastest_plan(problem: Problem) -> tuple[Incumbent, SearchStats]:
    """The quickest plan the quotas (and existing instances) allow, whatever it costs: no deadline."""
    return search(problem, objective="time", deadline_s=np.inf)


def fastest_time_s(problem: Problem) -> float:
    """The shortest predicted time of any plan allowed by the quotas (no deadline)."""
    return fastest_plan(problem)[0].time_s


def search_deadlines(problem: Problem, deadlines_s: list[float]) -> list[tuple[Incumbent, SearchStats]]:
    """The cost optimum at each deadline: one scoring pass when the problem is small enough to
    enumerate, one search per deadline otherwise."""
    if composition_count(problem) < _ENUMERATE_ROWS:
        return search_all(problem, "cost", deadlines_s)
    return [search(problem, "cost", deadline_s=d) for d in deadlines_s]


def search_all(problem: Problem, objective: Objective, deadlines_s: list[float],
               incumbent: Incumbent | None = None) -> list[tuple[Incumbent, SearchStats]]:
    """Brute force: score every count vector once (in chunks) and keep the best for each deadline."""
    best = [incumbent or Incumbent() for _ in deadlines_s]
    stats = SearchStats()
    for counts, r in _scored_chunks(problem):
        stats.evaluated += len(counts)
        best = [keep_best(problem, objective, d, b, counts, r) for b, d in zip(best, deadlines_s)]
    return [(b, stats) for b in best]


def _scored_chunks(problem: Problem) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Every count vector of at least min_workers with its scores, in chunks (one, remembered, when small)."""
    total = composition_count(problem)
    if total <= _ENUMERATE_ROWS:
        yield scored_compositions(problem)
        return
    for start in range(0, total, _ENUMERATE_CHUNK_ROWS):
        counts = compositions(problem, start, min(total, start + _ENUMERATE_CHUNK_ROWS))
        counts = counts[problem.large_enough(counts)]
        yield counts, problem.evaluate(counts)


@dataclass
class _Scored:
    profile: object  # holds the profile whose id is in the key, so that id is not reused while kept
    counts: np.ndarray
    scored: dict[str, np.ndarray]
    progress: float | None  # Problem.progress_left the times were scored at


_SCORED: OrderedDict[tuple, _Scored] = OrderedDict()
_SCORED_KEPT = 128
_SCORED_LOCK = threading.Lock()


def scored_compositions(problem: Problem) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every count vector of at least min_workers of a small problem with its scores (problem.evaluate),
    remembered across problems with the same model and bounds (`scored_rows`)."""
    def every() -> np.ndarray:
        counts = compositions(problem, 0, composition_count(problem))
        return counts[problem.large_enough(counts)]

    return scored_rows(problem, "compositions", every)


def forget_scored() -> None:
    """Drop every remembered scoring (benchmarks time solves from scratch)."""
    with _SCORED_LOCK:
        _SCORED.clear()


def scored_rows(problem: Problem, kind: str, rows: Callable[[], np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Candidate clusters (`rows()`, named by `kind`) of a problem with their scores, remembered
    across problems with the same model and bounds: a re-plan with the same survivors differs
    only in the remaining progress, which scales every time and cost (Problem.progress_left), so
    the replay's thousands of re-plans score each set of survivors once."""
    model, req = problem.model, problem.request
    progress = problem.progress_left
    key = (kind, id(model.profile), model.bandwidth_margin, model.on_demand, tuple(problem.lower),
           tuple(problem.upper), problem.min_workers, req.loss_target if progress is None else None)
    with _SCORED_LOCK:
        known = _SCORED.get(key)
    if known is None:
        counts = rows()
        known = _Scored(model.profile, counts, problem.evaluate(counts), progress)
        with _SCORED_LOCK:
            _SCORED[key] = known
            if len(_SCORED) > _SCORED_KEPT:
                _SCORED.popitem(last=False)
    if progress is None or progress == known.progress:
        return known.counts, known.scored
    scale = progress / known.progress
    r = dict(known.scored)
    for name in ("iterations", "time_s", "cost_usd"):
        r[name] = r[name] * scale
    return known.counts, r
