"""Valid bounds for branch and bound over instance counts, and the greedy fills they rest on.

For a cluster of n workers every instance of type m has the same iteration time T_m(n), so the
cluster's iteration rate X = sum n_m / T_m(n), sample rate Y = sum n_m b_m / T_m(n) and hourly
price P = sum n_m p_m are linear in the counts. Time is j / X and cost is j * P / X / 3600, and:
- the WA batch Y / X is a rate-weighted mean of the types' batches, so it lies between the
  smallest and largest batch of the types in the cluster (or of a fixed part's mean and the rest);
- j is affine in the WA batch and non-decreasing in the convergence coefficient R >= 0, so its
  minimum over a batch interval is at an end (with the noise term below: at a point inside),
  with R = 0 (numerators clipped at 0 keep it a valid bound where the fitted curve stops
  descending);
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
The further terms (docs/model.md) keep them valid too:
- contention.overlap (omega >= 0): a type's PS time is stretched by 1 + omega * share >= 1,
  so its rate never exceeds the rate without the term; the rates without it (exact by n, or the
  load ceilings above) are ceilings, and the search treats the rates as mix-dependent;
- contention.link_cap: where the PS link caps the update rate, every type's time is stretched
  by one factor >= 1, so the rates without the cap are ceilings (as for the overlap), and the
  shares of the rates, hence the WA batch and R, are those without it;
- loss.batch_n_exponent (eta) and loss.batch_staleness (psi): for one size n the batch term
  (gamma2 * n ** eta + psi * (n - 1)) * bw is still affine in the WA batch; its slope's sign may
  differ from size to size, and every bound above is per size and takes the end of the batch
  interval by the sign of that size's slope, so they hold with gamma2 replaced by the size's slope;
- loss.batch_noise (beta >= 0): the numerator's beta / bw makes j convex in the WA batch for one
  size. Its minimum over a batch interval is at the stationary point sqrt(beta / slope) clipped
  into the interval (`IterationBound.lower`), and the bounds that need j affine in the batch (the
  time test and the one-class completions, whose rate-weighted mean over the types must be the
  value at the WA batch) take j's tangent at one batch instead, an affine function below j.
"""
from __future__ import annotations

import numpy as np

from tasks.core.model import batch_slope, cluster_spread
from tasks.core.profile import Profile


class SuffixFills:
    """Greedy fills of every suffix k of the search levels: `at(k, rem)` is the best (take_best
    "max" or "min") sum of `values` over counts of the items of levels k.. (item i belongs to
    level owner[i]; default: item i is level i) within [lower, lower + extra] adding up to rem
    (an array); rem beyond the suffix's capacity is not meaningful (callers rule it out).

    A greedy fill is piecewise linear in the count, one segment per item, best first; each
    suffix's breakpoints are built when first asked for."""

    def __init__(self, values: np.ndarray, lower: np.ndarray, extra: np.ndarray, take_best: str,
                 owner: np.ndarray | None = None):
        self.values, self.lower, self.extra = values, lower, extra.astype(float)
        self.owner = np.arange(len(values)) if owner is None else owner
        self.order = np.argsort(-values if take_best == "max" else values, kind="stable")
        self.segments: dict[int, tuple[float, float, np.ndarray, np.ndarray]] = {}

    def at(self, k: int, rem: np.ndarray) -> np.ndarray:
        if k not in self.segments:
            mine = self.order[(self.owner[self.order] >= k) & (self.extra[self.order] > 0)]
            cap = self.extra[mine]
            xp = np.concatenate([[0.0], np.cumsum(cap)])
            fp = np.concatenate([[0.0], np.cumsum(cap * self.values[mine])])
            suffix = self.owner >= k
            self.segments[k] = (float(self.lower[suffix].sum()), float((self.lower * self.values)[suffix].sum()), xp, fp)
        lower_sum, forced, xp, fp = self.segments[k]
        return forced + np.interp(rem - lower_sum, xp, fp, left=0.0)


class MultiplierTest:
    """Prunes prefixes none of whose completions can have sum c_m (a_m - mult * r_m) <= 0.

    For the price, a = p and mult = 3600 * cost bound / j_lo: a cluster within the bound needs
    P / X <= mult. For the time, a = r * j_affine and mult = time bound * X_max: a cluster
    within the bound needs j X <= t X^2 <= t X_max X. The left side is linear in the counts, so
    its minimum over the free counts is a greedy fill; the fill is only ever taken at a grid of
    multipliers, at the first grid value at or above a prefix's own (the sum only falls as the
    multiplier grows, so this stays a valid test)."""

    def __init__(self, a: np.ndarray, rate: np.ndarray, lower: np.ndarray, extra: np.ndarray, grid: np.ndarray,
                 owner: np.ndarray | None = None):
        self.grid, self.a, self.rate, self.lower, self.extra, self.owner = grid, a, rate, lower, extra, owner
        self.fills: dict[int, SuffixFills] = {}  # built for the grid values asked for

    def fails(self, k: int, rem: np.ndarray, a_fixed: np.ndarray, x_fixed: np.ndarray, mult: np.ndarray) -> np.ndarray:
        at = np.searchsorted(self.grid, mult)
        out = np.zeros(len(rem), dtype=bool)
        for g in np.unique(at[at < len(self.grid)]):
            sel = at == g
            if g not in self.fills:
                self.fills[g] = SuffixFills(self.a - self.grid[g] * self.rate, self.lower, self.extra, "min", self.owner)
            out[sel] = a_fixed[sel] - self.grid[g] * x_fixed[sel] + self.fills[g].at(k, rem[sel]) > 0
        return out


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
    j_lo = IterationBound(req.profile, sizes.astype(float), req.loss_target, req.current_loss).lower(b_lo, b_hi)
    rates = rate_ceilings(problem, sizes)
    x_max = max_rate_by_size(rates, problem.lower, problem.upper, sizes)
    ratio_min = (model.prices_usd_per_h[usable] / rates[:, usable]).min(axis=1)
    return j_lo, x_max, ratio_min


def rates_fixed_by_size(problem) -> bool:
    """Do the types' rates depend on the cluster size alone (contention by workers without the
    overlap term or the link cap, the paper)?"""
    contention = problem.model.profile.contention
    return contention.by != "load" and not contention.overlap and not contention.link_cap


def rate_ceilings(problem, sizes: np.ndarray) -> np.ndarray:
    """Per size (rows) and type (columns), an iteration rate 1/T_m no cluster of that size exceeds:
    the rates when contention is by workers (exact without the overlap term, which only slows);
    with contention by load, the rates at the smallest PS load a cluster of that size can have
    (see the module's docstring)."""
    model = problem.model
    sizes = np.asarray(sizes, dtype=float)
    if model.profile.contention.by != "load":
        return 1.0 / model.iteration_times_s(sizes)
    alone = model.alone_times_s[problem.upper > 0]
    if model.profile.contention.alpha1 < 0:
        return 1.0 / model.iteration_times_s(np.zeros_like(sizes))  # load 0: every worker at Breq
    least_load = 1.0 + (sizes - 1.0) * float(alone.min() / alone.max())
    return 1.0 / model.iteration_times_s(least_load)


class IterationBound:
    """Lower bounds on iterations j for clusters of one size n (or an array of sizes)."""

    def __init__(self, profile: Profile, n, loss_target: float, current_loss: float | None):
        g = profile.loss
        # the batch term's slope at this size: gamma2, or gamma2 * n ** eta + psi * (n - 1)
        self.gamma2 = batch_slope(n, g.gamma2, g.batch_n_exponent, g.batch_staleness)
        self.gamma3 = g.gamma3
        self.noise = g.batch_noise  # beta of beta / bw, or None
        spread_at_r0 = cluster_spread(0.0, n, g.gamma4, g.kappa)
        if current_loss is None:
            self.scale = spread_at_r0 / (loss_target - g.gamma5)
            self.offset = g.gamma1
        else:
            self.scale = spread_at_r0 * (1.0 / (loss_target - g.gamma5) - 1.0 / (current_loss - g.gamma5))
            self.offset = 0.0

    def affine(self, batch, tangent_at: float):
        """j's tangent at WA batch `tangent_at` (R = 0, before any clipping), evaluated at WA batch
        `batch`: never above j (j is convex in the batch with the noise term beta / bw, and the
        numerator and j are clipped at 0; R only adds), and affine, so its rate-weighted mean
        over a cluster's types is its value at the cluster's WA batch. Without the term (beta 0)
        the tangent is j itself."""
        noise = self.noise or 0.0
        slope = self.gamma2 - noise / tangent_at**2
        return (slope * batch + self.gamma3 + 2.0 * noise / tangent_at) * self.scale - self.offset

    def lower(self, batch_lo, batch_hi):
        """min j over WA batches in [batch_lo, batch_hi] (and any R >= 0); floats or arrays. The
        numerator gamma2 * b + gamma3 (+ beta / b) is affine, or convex for b > 0 with its
        minimum at sqrt(beta / gamma2) where gamma2 > 0 and falling where gamma2 <= 0: its
        minimum over the interval is at that point clipped into it."""
        if self.noise is None:
            batch = np.where(self.gamma2 < 0, batch_hi, batch_lo)
            numerator = np.maximum(self.gamma2 * batch + self.gamma3, 0.0)
        else:
            rising = np.asarray(self.gamma2) > 0
            with np.errstate(over="ignore"):  # a slope near 0: the turn is beyond any batch
                turn = np.where(rising, np.sqrt(self.noise / np.where(rising, self.gamma2, 1.0)), np.inf)
            batch = np.clip(turn, batch_lo, batch_hi)
            numerator = np.maximum(self.gamma2 * batch + self.gamma3 + self.noise / batch, 0.0)
        return np.maximum(numerator * self.scale - self.offset, 0.0)


class VertexBound:
    """Bounds on the best completion of a prefix from its one-class completions.

    With the rates fixed by n (contention by workers), j >= the affine iteration bound at the WA
    batch, whose rate-weighted form is A / X with A = sum c_m r_m e_m (e_m: IterationBound.affine
    at type m's batch). So time = j / X >= A+ / X^2 and 3600 cost = j P / X >= A+ P / X^2 (A+ =
    max(A, 0)). Relax the free counts of a suffix to any non-negative reals adding up to the
    free instances left (quotas dropped, each free instance priced at its class's cheapest offer
    with room): A, P and X are affine in the counts, (A+ / X, P / X) and (A+ / X, 1 / X) are
    linear-fractional images of them, and x+ y is quasiconcave for y > 0, so both minima over
    that simplex lie at a vertex: every free instance in one class. The deadline D enters by
    Lagrange: for any mu >= 0 a completion within it has 3600 cost >= A+ (P + mu) / X^2 - mu D,
    minimised at a vertex the same way; mu is taken from the cheapest vertex and its best partner
    that meets D (the LP's optimum when their edge is on the hull, a valid bound otherwise)."""

    def __init__(self, rate: np.ndarray, j_each: np.ndarray, lower: np.ndarray, upper: np.ndarray,
                 forced_usd_per_h: np.ndarray, free_usd_per_h: np.ndarray):
        """Per class (columns; rate and j_each may have one row per prefix row instead)."""
        self.ae, self.rate, self.free_price = rate * j_each, rate, free_usd_per_h
        self.free = np.flatnonzero(upper > lower)
        # What the suffix's existing instances add, for each level k (and k = m: nothing).
        self.forced = [np.concatenate([np.flip(np.cumsum(np.flip(v, -1), axis=-1), -1), np.zeros(v.shape[:-1] + (1,))],
                                      axis=-1) for v in (lower * rate * j_each, lower * rate, forced_usd_per_h)]
        self.lo_suffix = np.concatenate([np.cumsum(lower[::-1])[::-1], [0]])

    def vertices(self, k: int, rem, a_f, x_f, p_f) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A+, X and P of each row's one-class completions (rows x classes from k on)."""
        s = self.free[self.free >= k]
        ae, rate, price = (v[..., s] if len(s) else np.zeros(v.shape[:-1] + (1,))
                           for v in (self.ae, self.rate, self.free_price))
        free = (np.asarray(rem) - self.lo_suffix[k])[:, None].astype(float)
        a = (a_f + self.forced[0][..., k])[:, None] + free * ae
        x = (x_f + self.forced[1][..., k])[:, None] + free * rate
        p = (p_f + self.forced[2][..., k])[:, None] + free * price
        return np.maximum(a, 0.0), x, p

    def bounds(self, k: int, rem, a_f, x_f, p_f, deadline_s: float) -> tuple[np.ndarray, np.ndarray]:
        """Lower bounds on the time and on the cost within deadline_s of every completion of each row."""
        return vertex_bounds(*self.vertices(k, rem, a_f, x_f, p_f), deadline_s)


def vertex_bounds(a: np.ndarray, x: np.ndarray, p: np.ndarray, deadline_s: float) -> tuple[np.ndarray, np.ndarray]:
    """VertexBound's time and cost bounds from the A+, X and P of each row's vertices (columns)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(x > 0, a / x**2, np.inf)
        c = np.where(x > 0, a * p / x**2, np.inf)
        rows = np.arange(len(t))
        cheapest = c.argmin(axis=1)
        t_c, c_c = t[rows, cheapest], c[rows, cheapest]
        # mu: the slope of the lowest edge at D from the cheapest vertex to one meeting D.
        slope = np.where((t <= deadline_s) & (t_c[:, None] > deadline_s), (c - c_c[:, None]) / (t_c[:, None] - t), np.inf)
        mu = slope.min(axis=1)
        mu = np.where(np.isfinite(mu), mu, 0.0)
        dual = np.where(x > 0, a * (p + mu[:, None]) / x**2, np.inf).min(axis=1) - mu * deadline_s
    return t.min(axis=1), np.maximum(dual, 0.0) / 3600.0
