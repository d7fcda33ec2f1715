"""The risk-aware planner (`solver="risk"`): the cheapest plan, by expected cost, that meets the
deadline with at least the target probability under per-type revocation hazards.

Candidates are the exact planner's optima at tighter internal deadlines, spaced evenly from the
budget down to the fastest plan's time (so the last is the fastest plan, the most slack to be
had), each also with every type capped at SPREAD_CAP instances (spread across types, so that one
type's revocations cost less). Each candidate's P(meet) and expected cost come from a fast
vectorised Monte Carlo with a fixed seed (common random numbers for all candidates):
- revocations of type m arrive as a Poisson process at n_m * h_m over the budget window (later
  ones cannot make the deadline be missed);
- a revocation while training runs removes one instance of its type for `recovery_s` (its
  replacement's start and join), delaying completion by recovery_s * (1 - T(C) / T(C - e_m)),
  where T is the model's predicted time; a revocation after completion does not count;
- the replacement is paid from its launch, the cluster for the whole (delayed) run;
- re-planning: when a revocation first pushes the projected finish F past the deadline, the
  re-planner switches, once the overhead has passed, to the cheapest plan that does the rest of
  the work in the time left. The rest is the share phi = (F - switch) / T_plan of a whole run;
  a plan whose whole run takes T does it in phi * T at phi times its whole-run cost. The plans
  on offer are the frontier of unconstrained optima at the internal deadlines plus the fastest
  plan; if even the fastest is too slow the run is late.
This first-order model ignores overlapping outages; the replay (replay.py) measures what a plan
really achieves.
Candidates are visited cheapest first; the search stops once a candidate's predicted
(revocation-free) cost, a lower bound of every later candidate's expected cost, reaches the best
expected cost found that meets the level.
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict

import numpy as np

from tasks.planner import exact
from tasks.planner.problem import PlanResult, Problem, make_result

SLACK_STEPS = (1.0, 0.75, 0.5, 0.25, 0.0)  # internal deadline: fastest + step * (budget - fastest)
SPREAD_CAP = 2
SAMPLES = 2000
SEED = 20230601
# Deadlines whose candidates are assessed together: most re-plans stop after the first two.
ROUNDS = ((0, 2), (2, len(SLACK_STEPS)))


@dataclasses.dataclass(frozen=True)
class Risk:
    meet_probability: float
    expected_cost_usd: float
    predicted_cost_usd: float
    predicted_time_s: float


@dataclasses.dataclass(frozen=True)
class Frontier:
    """Whole-run time and cost of the cheapest plan for a few deadlines, fastest first: what a
    re-plan can buy when a run must speed up."""

    time_s: np.ndarray
    cost_usd: np.ndarray

    @classmethod
    def of(cls, problem: Problem, plans: list[np.ndarray]) -> "Frontier":
        """From some plans (at least one)."""
        r = problem.evaluate(np.array(plans))
        order = np.argsort(r["time_s"], kind="stable")
        t, c = r["time_s"][order], r["cost_usd"][order]
        keep = c <= np.minimum.accumulate(c)  # a slower plan is only worth it if it is cheaper
        return cls(t[keep], c[keep])

    def cheapest_within(self, allowed_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(time, cost) of the cheapest frontier plan taking at most allowed_s; the fastest
        plan where none does."""
        i = np.clip(np.searchsorted(self.time_s, allowed_s, side="right") - 1, 0, None)
        return self.time_s[i], self.cost_usd[i]


def assess_all(problem: Problem, plans: list[np.ndarray], frontier: Frontier, samples: int = SAMPLES,
               seed: int = SEED) -> list[Risk]:
    """P(meet the budget) and expected cost of each plan under the request's hazards, in one
    vectorised pass: the samples of every plan are stacked as rows (each row knows its plan), so
    a re-plan's candidates cost one set of array operations, not one per candidate. Each plan's
    numbers are the ones it gets alone (`assess`): every operation is per row or per plan."""
    req, model = problem.request, problem.model
    m = len(model.types.names)
    plans = np.asarray(plans, dtype=np.int64).reshape(-1, m)
    k = len(plans)
    hazard_per_s = np.array([req.hazards_per_h.get(n, 0.0) for n in model.types.names]) / 3600.0
    # Per plan, row 0: the plan; row 1 + j: the plan less one instance of type j.
    rows = np.repeat(plans[:, None, :], m + 1, axis=1)
    rows[:, 1:, :] -= np.eye(m, dtype=np.int64)[None, :, :] * (plans[:, None, :] > 0)
    r = problem.evaluate(rows.reshape(-1, m))
    time_s = r["time_s"].reshape(k, m + 1)
    t_plan, usd_per_h = time_s[:, 0], r["usd_per_h"].reshape(k, m + 1)[:, 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        delay_s = req.recovery_s * (1.0 - t_plan[:, None] / time_s[:, 1:])
    delay_s = np.where(plans > 0, np.nan_to_num(delay_s, nan=req.recovery_s), 0.0)
    # Stack the plans' samples that have a revocation in the window; padding is type m, which
    # never arrives in time (inf) and delays and costs nothing.
    window_s = problem.budget_s
    drawn = [_revocations(p * hazard_per_s, window_s, samples, seed) for p in plans]
    sizes = np.array([len(t) for t, _ in drawn])
    width = max(t.shape[1] for t, _ in drawn)
    times_a = np.full((sizes.sum(), width), np.inf)
    kinds = np.full((sizes.sum(), width), m)
    ends = np.cumsum(sizes)
    for (t, kd), end, size in zip(drawn, ends, sizes):
        times_a[end - size:end, :t.shape[1]] = t
        kinds[end - size:end, :t.shape[1]] = kd
    plan_of = np.repeat(np.arange(k), sizes)
    delays_a = np.concatenate([delay_s, np.zeros((k, 1))], axis=1)[plan_of[:, None], kinds]
    prices_a = np.r_[model.prices_usd_per_h, 0.0][kinds]
    t_row, usd_row = t_plan[plan_of], usd_per_h[plan_of]
    before = np.cumsum(delays_a, axis=1) - delays_a
    counted = np.logical_and.accumulate(times_a < t_row[:, None] + before, axis=1)
    finish_s = t_row + np.cumsum(delays_a * counted, axis=1)[:, -1]
    replacement_usd = np.cumsum(counted * prices_a, axis=1)[:, -1] * req.recovery_s / 3600.0
    cost = finish_s * usd_row / 3600.0 + replacement_usd
    # Re-planning from the first revocation that makes the run late.
    late = counted & (t_row[:, None] + before + delays_a > window_s)
    any_late = late.any(axis=1)
    switch_s = np.where(any_late, times_a[np.arange(len(times_a)), late.argmax(axis=1)] + req.recovery_s, 0.0)
    share = (finish_s - switch_s) / t_row
    replan = any_late & (share > 0)
    allowed_s = (window_s - switch_s) / np.where(replan, share, 1.0)
    run_s, run_usd = frontier.cheapest_within(allowed_s)
    finish_s = np.where(replan, switch_s + share * run_s, finish_s)
    cost = np.where(replan, switch_s * usd_row / 3600.0 + share * run_usd + replacement_usd, cost)
    # Samples without a revocation in the window finish on time at the plan's predicted cost.
    on_time = window_s * (1 + 1e-9)
    risks = []
    for c, (end, size) in enumerate(zip(ends, sizes)):
        tp, rate = float(t_plan[c]), float(usd_per_h[c])
        quiet = samples - int(size)
        meet = (quiet * (tp <= on_time) + np.count_nonzero(finish_s[end - size:end] <= on_time)) / samples
        mean_cost = (quiet * tp * rate / 3600.0 + cost[end - size:end].sum()) / samples
        risks.append(Risk(float(meet), float(mean_cost), float(r["cost_usd"][c * (m + 1)]), tp))
    return risks


def assess(problem: Problem, counts: np.ndarray, frontier: Frontier, samples: int = SAMPLES,
           seed: int = SEED) -> Risk:
    """P(meet the budget) and expected cost of one plan under the request's hazards."""
    return assess_all(problem, [counts], frontier, samples, seed)[0]


def _revocations(rate_per_s: np.ndarray, window_s: float, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Revocation times within the window, per sample (rows, sorted, inf-padded to the most any
    sample has) with each one's type, for the samples that have any: type m's revocations are a
    Poisson process at rate_per_s[m], drawn as the unit-rate arrivals of `_unit_arrivals` over
    rate_per_s[m] (the same arrivals for every plan: common random numbers). The merged arrivals
    of a rate vector are kept (`_merged`): re-plans assess the same plans over other windows."""
    times, kinds = _merged(rate_per_s, window_s, samples, seed)
    some = times[:, 0] < window_s
    if not some.any():
        return np.full((0, 1), np.inf), np.zeros((0, 1), dtype=np.int64)
    times, kinds = times[some], kinds[some]
    width = int((times < window_s).sum(axis=1).max())
    times, kinds = times[:, :width], kinds[:, :width]
    return np.where(times < window_s, times, np.inf), kinds


_MERGED: OrderedDict[tuple, tuple[float, np.ndarray, np.ndarray]] = OrderedDict()
_MERGED_KEPT = 256


def _merged(rate_per_s: np.ndarray, window_s: float, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The arrivals of all types up to at least window_s, sorted (inf-padded), and their types,
    of the samples (in order) that have any within window_s (so of every sample that has any
    within a shorter window); remembered per rate vector and grown when a longer window is
    asked for. Only those few samples are merged and sorted."""
    key = (samples, seed, np.asarray(rate_per_s, dtype=float).tobytes())
    known = _MERGED.get(key)
    if known is None or known[0] < window_s:
        units = []
        some = np.zeros(samples, dtype=bool)
        for m in np.flatnonzero(rate_per_s > 0):
            reach = rate_per_s[m] * window_s  # the window in the unit-rate process's time
            unit, first = _unit_arrivals(samples, seed, int(m), reach)
            units.append((m, unit, int(np.searchsorted(first, reach))))  # arrivals any sample has within the window
            some |= unit[:, 0] < reach
        times, kinds = [np.full((int(some.sum()), 1), np.inf)], [np.zeros(1, dtype=np.int64)]
        for m, unit, width in units:
            times.append(unit[some, :width] / rate_per_s[m])
            kinds.append(np.full(width, m))
        times_a, kind_of = np.concatenate(times, axis=1), np.concatenate(kinds)
        order = np.argsort(times_a, axis=1, kind="stable")
        known = (window_s, np.take_along_axis(times_a, order, axis=1), kind_of[order])
        _MERGED[key] = known
        if len(_MERGED) > _MERGED_KEPT:
            _MERGED.popitem(last=False)
    return known[1], known[2]


_ARRIVALS: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
_ARRIVAL_BLOCK = 8


def _unit_arrivals(samples: int, seed: int, kind: int, reach: float) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times (samples x arrivals) of a unit-rate Poisson process per sample for one
    type, with enough arrivals that every sample's passes `reach`, and the earliest time of each
    arrival over the samples (increasing). Grown in blocks seeded by (seed, type, block), so the
    first arrivals are the same however far callers have needed them."""
    key = (samples, seed, kind)
    if key in _ARRIVALS and _ARRIVALS[key][1][-1] > reach:
        return _ARRIVALS[key]
    have = _ARRIVALS[key][0] if key in _ARRIVALS else None
    while have is None or have[:, -1].min() <= reach:
        block = 0 if have is None else have.shape[1] // _ARRIVAL_BLOCK
        gaps = np.random.default_rng([seed, kind, block]).exponential(1.0, (samples, _ARRIVAL_BLOCK))
        more = (0.0 if have is None else have[:, -1:]) + np.cumsum(gaps, axis=1)
        have = more if have is None else np.concatenate([have, more], axis=1)
    _ARRIVALS[key] = (have, have.min(axis=0))
    return _ARRIVALS[key]


def solve_risk(problem: Problem) -> PlanResult:
    started = time.perf_counter()
    level = problem.request.target_probability
    fastest, stats = exact.search(problem, "time", deadline_s=np.inf)
    evaluated = stats.evaluated
    if fastest.time_s > problem.budget_s * (1 + 1e-9):  # no plan meets the deadline even without revocations
        from tasks.planner import solve_problem

        plain = dataclasses.replace(problem.request, solver="exact")
        result = solve_problem(dataclasses.replace(problem, request=plain))
        return dataclasses.replace(result, solver="risk", solve_seconds=time.perf_counter() - started)
    deadlines_s = [fastest.time_s + step * (problem.budget_s - fastest.time_s) for step in SLACK_STEPS]
    optima = []
    for best, stats in exact.search_deadlines(problem, [d * (1 + 1e-9) for d in deadlines_s]):
        evaluated += stats.evaluated
        optima.append(best.counts if best.counts is not None else fastest.counts)
    frontier = Frontier.of(problem, optima)
    spread = dataclasses.replace(problem, upper=np.maximum(problem.lower, np.minimum(problem.upper, SPREAD_CAP)))
    seen: dict[tuple, Risk] = {}
    for lo, hi in ROUNDS:
        wide = [i for i in range(lo, hi) if (optima[i] > spread.upper).any()]  # others are already spread
        capped = dict(zip(wide, exact.search_deadlines(spread, [deadlines_s[i] * (1 + 1e-9) for i in wide])))
        variants = {i: [optima[i]] + ([capped[i][0].counts] if i in capped else []) for i in range(lo, hi)}
        evaluated += sum(stats.evaluated for _, stats in capped.values())
        fresh = list({tuple(c): c for i in variants for c in variants[i]
                      if c is not None and tuple(c) not in seen}.values())
        assessed = dict(zip(map(tuple, fresh), assess_all(problem, fresh, frontier))) if fresh else {}
        stop = False
        for i in range(lo, hi):  # what visiting the deadlines one by one would have seen
            for counts in variants[i]:
                if counts is not None:
                    seen.setdefault(tuple(counts), assessed.get(tuple(counts)))
            meeting = [r.expected_cost_usd for r in seen.values() if r.meet_probability >= level]
            if meeting and seen[tuple(optima[i])].predicted_cost_usd >= min(meeting):
                stop = True
                break
        if stop:
            break
    meeting_keys = [k for k, r in seen.items() if r.meet_probability >= level]
    if meeting_keys:
        key = min(meeting_keys, key=lambda k: (seen[k].expected_cost_usd, seen[k].predicted_time_s))
        message = ""
    else:  # best effort: the most likely plan
        key = max(seen, key=lambda k: (seen[k].meet_probability, -seen[k].expected_cost_usd))
        message = (f"no candidate meets the deadline with probability {level:g}; "
                   f"the best reaches {seen[key].meet_probability:.3f}")
    result = make_result(problem, np.array(key), "risk", "feasible", time.perf_counter() - started, evaluated,
                         message=message)
    return dataclasses.replace(result, meet_probability=seen[key].meet_probability)
