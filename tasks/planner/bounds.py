"""Valid bounds for branch and bound over instance counts, and the greedy fills they rest on.

For a cluster of n workers every instance of type m has the same iteration time T_m(n), so the
cluster's iteration rate X = sum n_m / T_m(n), sample rate Y = sum n_m b_m / T_m(n) and hourly
price P = sum n_m p_m are linear in the counts. Time is j / X and cost is j * P / X / 3600, and:
- the WA batch Y / X is a rate-weighted mean of the types' batches, so it lies between the
  smallest and largest batch of the types in the cluster (or of a fixed part's mean and the rest);
- j is affine in the WA batch and non-decreasing in the convergence coefficient R >= 0, so its
  minimum over a batch interval is at an end, with R = 0 (numerators clipped at 0 keep it a
  valid bound where the fitted curve stops descending);
- X_max and P_min over the free counts are exact greedy fills (a knapsack row of unit weights);
- a mediant is never below its smallest ratio: P/X >= min(P_fixed/X_fixed, min_m p_m T_m(n)).
Both extensions of docs/model.md keep these bounds valid:
- loss.kappa > 0: ((R + gamma4) n) ** kappa still grows with R, so R = 0 still bounds j below;
- contention by load: T_m depends on the cluster's PS load n_eff, not on n alone, so the rates
  are no longer fixed by n. But every type in a cluster shares one Bwk, n_eff lies in
  [1 + (n - 1) T_min / T_max, n] (T_min, T_max: the usable types' times alone) and Bwk does not
  grow with the load when alpha1 >= 0 (Bwk <= Breq always), so the rates at the smallest load
  (at Breq when alpha1 < 0) are ceilings on every cluster's rates (`rate_ceilings`): X_max, and
  every ratio P/X built on them, stay bounds. The fixed part's mean batch, which needs the true
  rates, is then not used: the WA batch is bounded by the types' batch range alone.
"""
from __future__ import annotations

import numpy as np

from tasks.model import cluster_spread
from tasks.profile import Profile


def greedy_fill_suffixes(values: np.ndarray, lower: np.ndarray, extra: np.ndarray, take_best: str, n: int) -> np.ndarray:
    """Greedy fills for every suffix k of the types at once: row k, column rem is the best
    (take_best "max" or "min") sum of `values` over counts of types k.. within [lower, lower +
    extra] that add up to rem (0 <= rem <= n); columns beyond the suffix's capacity are not
    meaningful (callers rule them out)."""
    m = len(values)
    order = np.argsort(-values if take_best == "max" else values, kind="stable")
    in_suffix = order[None, :] >= np.arange(m)[:, None]  # M x M: type order[j] belongs to suffix k
    cap = np.where(in_suffix, extra[order], 0).astype(float)
    before = np.cumsum(cap, axis=1) - cap
    lower_sum = np.where(in_suffix, lower[order], 0).sum(axis=1)
    forced = np.where(in_suffix, (lower * values)[order], 0.0).sum(axis=1)
    free = np.arange(n + 1, dtype=float)[None, :] - lower_sum[:, None]  # M x (n+1)
    take = np.clip(free[:, :, None] - before[:, None, :], 0.0, cap[:, None, :])
    return forced[:, None] + take @ values[order]


def max_rate_by_size(rates: np.ndarray, lower: np.ndarray, upper: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The largest iteration rate X of any cluster of each size (rates: S x M, one row per size).

    The types' rate order is the same at every size (contention adds the same network time to
    every type), so one greedy order serves all rows."""
    order = np.argsort(-rates[0], kind="stable")
    cap = (upper - lower)[order].astype(float)
    before = np.cumsum(cap) - cap
    take = np.clip((sizes - lower.sum())[:, None] - before[None, :], 0.0, cap[None, :])
    return rates @ lower + (take * rates[:, order]).sum(axis=1)


def size_bounds(problem, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each cluster size: a lower bound on iterations j, the largest rate X, and the lowest
    price-per-rate ratio of any usable type, over all clusters the problem allows."""
    model, req = problem.model, problem.request
    usable = problem.upper > 0
    b_lo, b_hi = float(model.types.batch[usable].min()), float(model.types.batch[usable].max())
    j_lo = np.array([IterationBound(req.profile, float(n), req.loss_target, req.current_loss).lower(b_lo, b_hi)
                     for n in sizes])
    rates = rate_ceilings(problem, sizes)
    x_max = max_rate_by_size(rates, problem.lower, problem.upper, sizes)
    ratio_min = (model.prices_usd_per_h[usable] / rates[:, usable]).min(axis=1)
    return j_lo, x_max, ratio_min


def rates_fixed_by_size(problem) -> bool:
    """Do the types' rates depend on the cluster size alone (contention by workers, the paper)?"""
    return problem.model.profile.contention.by != "load"


def rate_ceilings(problem, sizes: np.ndarray) -> np.ndarray:
    """Per size (rows) and type (columns), an iteration rate 1/T_m no cluster of that size exceeds:
    the exact rates when contention is by workers; with contention by load, the rates at the
    smallest PS load a cluster of that size can have (see the module's docstring)."""
    model = problem.model
    sizes = np.asarray(sizes, dtype=float)
    if rates_fixed_by_size(problem):
        return 1.0 / model.iteration_times_s(sizes)
    alone = model.alone_times_s[problem.upper > 0]
    if model.profile.contention.alpha1 < 0:
        return 1.0 / model.iteration_times_s(np.zeros_like(sizes))  # load 0: every worker at Breq
    least_load = 1.0 + (sizes - 1.0) * float(alone.min() / alone.max())
    return 1.0 / model.iteration_times_s(least_load)


class IterationBound:
    """Lower bounds on iterations j for clusters of one size n, as plain floats (hot loop)."""

    def __init__(self, profile: Profile, n: float, loss_target: float, current_loss: float | None):
        g = profile.loss
        self.gamma2, self.gamma3 = g.gamma2, g.gamma3
        spread_at_r0 = float(cluster_spread(0.0, n, g.gamma4, g.kappa))
        if current_loss is None:
            self.scale = spread_at_r0 / (loss_target - g.gamma5)
            self.offset = g.gamma1
        else:
            self.scale = spread_at_r0 * (1.0 / (loss_target - g.gamma5) - 1.0 / (current_loss - g.gamma5))
            self.offset = 0.0

    def lower(self, batch_lo: float, batch_hi: float) -> float:
        """min j over WA batches in [batch_lo, batch_hi] (and any R >= 0)."""
        batch = batch_hi if self.gamma2 < 0 else batch_lo
        numerator = max(self.gamma2 * batch + self.gamma3, 0.0)
        return max(numerator * self.scale - self.offset, 0.0)
