"""The offline optimum's lower bound: what a run could cost at the least if it knew the whole
market in advance (every capacity change, every price), as the floor to measure policies by.

It relaxes what a real run must do, so no policy can beat it on the same draw:
- no start overhead and no revocation (a revoked instance only takes capacity away);
- work is counted as the share of the job each cluster would do alone: cluster c finishes the
  job in T_c at cost K_c (the model's prediction from the start), and clusters may be
  time-shared fractionally inside each stretch of constant capacity (a linear programme: x[r, c]
  the share done in stretch r on cluster c, each stretch's time within its length, shares
  summing to the whole job before the deadline). With no capacity limit this is the planner's
  cost-time frontier made convex, at or just below the exact optimum's cost.
A cluster is a count of each type; in a stretch where the market hands out s_m spot instances of
type m, its n_m instances are the s_m cheapest (spot) and the rest on-demand offers, within the
on-demand quota. Only clusters on the Pareto front of (T_c, K_c) can be in an optimal
time-share, so the programme has a few hundred columns per stretch, not every composition.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from scipy.optimize import linprog

from tasks.core.model import Model

MAX_CLUSTERS = 400_000  # compositions scored for the bound; larger problems skip it


class OfflineBound:
    """Scores every cluster once (per unit of progress); `cost_usd` solves one draw."""

    def __init__(self, model: Model, loss_target: float, quota: np.ndarray, on_demand_quota: np.ndarray,
                 on_demand_usd_per_h: np.ndarray):
        self.on_demand_cap = on_demand_quota
        radix = quota + on_demand_quota + 1
        total = int(np.prod(radix.astype(object)))
        self.usable = total <= MAX_CLUSTERS
        if not self.usable:
            return
        strides = np.concatenate([np.cumprod(radix[::-1])[::-1][1:], [1]])
        counts = (np.arange(1, total, dtype=np.int64)[:, None] // strides) % radix
        per_unit = model.evaluate(counts, loss_target)["time_s"]  # the whole job on the cluster alone
        finite = np.isfinite(per_unit) & (per_unit > 0)
        self.counts, self.per_unit_s = counts[finite], per_unit[finite]
        self.units = 1.0
        self.on_demand_usd_per_h = on_demand_usd_per_h
        # stretches of one draw, and draws of the same zone prices, share fronts
        self._front = functools.lru_cache(maxsize=4096)(functools.partial(_front_of, self))

    def cost_usd(self, spot_usd_per_h: np.ndarray, stretches: list[tuple[float, np.ndarray]],
                 deadline_s: float) -> float:
        """The bound for one draw: `stretches` are (length in seconds, spot capacity per type)
        covering [0, deadline]; nan when no cluster can finish by the deadline."""
        cols_time, cols_cost, rows = [], [], []
        for r, (length_s, spot_cap) in enumerate(stretches):
            front = self._front(tuple(np.asarray(spot_cap, dtype=float).tolist()), tuple(spot_usd_per_h.tolist()))
            cols_time += front[0]
            cols_cost += front[1]
            rows += [r] * len(front[0])
        if not cols_time:
            return math.nan
        rows_arr = np.array(rows)
        a_ub = np.zeros((len(stretches) + 1, len(cols_time)))
        a_ub[rows_arr, np.arange(len(cols_time))] = cols_time
        a_ub[-1] = -1.0  # progress done >= units needed
        b_ub = np.array([length for length, _ in stretches] + [-self.units])
        res = linprog(np.array(cols_cost), A_ub=a_ub, b_ub=b_ub, bounds=(0, None), method="highs")
        return float(res.fun) if res.status == 0 else math.nan


def _front_of(bound: "OfflineBound", spot_cap: tuple, spot_usd_per_h: tuple) -> tuple[list[float], list[float]]:
    """The Pareto front of (time, cost) per share of the job of every cluster under this capacity
    and these prices."""
    spot = np.minimum(bound.counts, np.array(spot_cap))
    ok = np.all(bound.counts - spot <= bound.on_demand_cap, axis=1)
    rate = spot @ np.array(spot_usd_per_h) + (bound.counts - spot) @ bound.on_demand_usd_per_h
    return _pareto(bound.per_unit_s[ok], (rate[ok] / 3600.0) * bound.per_unit_s[ok])


def _pareto(t: np.ndarray, k: np.ndarray) -> tuple[list[float], list[float]]:
    """The clusters no other beats on both time and cost per share of the job: only those can
    be in a cost-minimising time-share (the programme itself finds their convex hull)."""
    order = np.lexsort((k, t))
    t, k = t[order], k[order]
    keep = np.r_[True, np.minimum.accumulate(k)[:-1] > k[1:]] if len(t) else np.zeros(0, dtype=bool)
    return t[keep].tolist(), k[keep].tolist()
