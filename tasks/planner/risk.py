"""The risk-aware planner (`solver="risk"`): the cheapest plan, by expected cost, that meets the
deadline with at least the target probability under per-type revocation hazards.

Candidates are the exact planner's optima at tighter internal deadlines, spaced evenly from the
budget down to the fastest plan's time (so the last is the fastest plan, the most slack to be
had), each also with every type capped at SPREAD_CAP instances (spread across types, so that one
type's revocations cost less). Each candidate's P(meet) and expected cost come from a fast
vectorised Monte Carlo with a fixed seed (common random numbers for all candidates):
- revocations of type m arrive as a Poisson process at n_m * h_m over the budget window (later
  ones cannot make the deadline be missed); on-demand workers (`TYPE:on-demand`, on_demand.py)
  have no hazard (build_problem refuses one), so they are never revoked;
- a revocation while training runs removes one instance of its type for `recovery_s` (its
  replacement's start and join) plus the type's `replacement_wait_s` (the mean wait when the
  market refuses the replacement for want of capacity, times how often it does), delaying
  completion by that outage * (1 - T(C) / T(C - e_m)), where T is the model's predicted time;
  a revocation after completion does not count;
- the replacement, of the revoked worker's spot type at its price, is paid from its launch, the
  cluster for the whole (delayed) run;
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

A replay re-plans thousands of times over the same few plans, so each plan's draws are kept
(`_draws`) with everything that does not depend on the time left: its samples sorted by first
arrival, and per arrival the delays so far, their running maxima and the replacement prices so
far. An assessment then cuts them at the window and the plan's time: the samples revoked before
the run ends are a prefix, the revocations that count a prefix of each sample's, found by one
comparison per arrival. The delays' ratios T(C) / T(C - e_m) are taken at a fixed reference
loss, so a plan's draws serve every re-plan (mid-training every time scales with the remaining
progress alike).
"""
from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict

import numpy as np

from tasks.planner import exact
from tasks.planner.plain import exact_answer
from tasks.planner.problem import PlanResult, Problem, make_result
from tasks.planner.solvers import register

SLACK_STEPS = (1.0, 0.75, 0.5, 0.25, 0.0)  # internal deadline: fastest + step * (budget - fastest)
SPREAD_CAP = 2
SAMPLES = 2000
SEED = 20230601


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


@dataclasses.dataclass(frozen=True)
class _Draws:
    """One plan's sampled revocations with what each costs it, ready to be cut at any window and
    plan time: the samples with an arrival by `window_s`, sorted by their first arrival (so the
    samples with one before a time are a prefix). Arrays are arrival j by sample (column-major:
    each step over arrivals is one vectorised operation over the samples), inf-padded, with a
    last row no arrival reaches."""

    window_s: float
    first_s: np.ndarray  # each sample's first arrival (increasing)
    reach_s: np.ndarray  # arrival j's earliest time over the samples (increasing)
    times_s: np.ndarray  # arrivals
    slack_s: np.ndarray  # running max of arrival minus the delays before it: counted while below the plan's time
    delayed_s: np.ndarray  # delays up to and including each arrival
    overrun_s: np.ndarray  # running max of delayed_s: the run is late from the first above the plan's slack
    paid_usd_per_h: np.ndarray  # replacement prices up to and including each arrival

    @classmethod
    def of(cls, window_s: float, times_s: np.ndarray, kinds: np.ndarray, delay_s: np.ndarray,
           price_usd_per_h: np.ndarray) -> "_Draws":
        """From the merged arrivals (sample by arrival)."""
        order = np.argsort(times_s[:, 0], kind="stable")
        width = int(np.searchsorted(times_s.min(axis=0, initial=np.inf), window_s))  # arrivals any sample has by window_s
        times, kinds_t = np.full((width + 1, len(order)), np.inf), np.zeros((width + 1, len(order)), dtype=np.int64)
        times[:width], kinds_t[:width] = times_s[order, :width].T, kinds[order, :width].T
        times_s, kinds = times, kinds_t
        delays = delay_s[kinds]
        delayed, slack, overrun, paid = (np.empty_like(times_s) for _ in range(4))
        prices = price_usd_per_h[kinds]
        delayed[0], slack[0], overrun[0], paid[0] = delays[0], times_s[0], delays[0], prices[0]
        for j in range(1, len(times_s)):  # running sums and maxima, one arrival at a time
            delayed[j] = delayed[j - 1] + delays[j]
            slack[j] = np.maximum(slack[j - 1], times_s[j] - delayed[j - 1])
            overrun[j] = np.maximum(overrun[j - 1], delayed[j])
            paid[j] = paid[j - 1] + prices[j]
        return cls(window_s, times_s[0].copy(), times_s.min(axis=1, initial=np.inf), times_s, slack, delayed, overrun, paid)


_DRAWS: OrderedDict[tuple, tuple[object, _Draws]] = OrderedDict()
_DRAWS_KEPT = 1024
_DRAWS_MARGIN = 1.25


def _draws(problem: Problem, counts: np.ndarray, hazard_per_s: np.ndarray, window_s: float, samples: int,
           seed: int) -> _Draws:
    """A plan's draws over at least window_s, remembered per plan and what its delays depend on.
    A revocation of type j delays the run by its outage (recovery_s plus the type's
    replacement_wait_s) * (1 - T(C) / T(C - e_j)): mid-training
    every time is proportional to the remaining progress (docs/model.md, re-planning), so the
    ratio is taken at a fixed reference loss (the target + 1), the same for every re-plan."""
    req, model = problem.request, problem.model
    start = req.current_loss is None
    outage_s = req.recovery_s + np.array([req.replacement_wait_s.get(n, 0.0) for n in model.types.names])
    key = (id(model.profile), model.bandwidth_margin, model.on_demand, req.loss_target, start, outage_s.tobytes(),
           counts.tobytes(), hazard_per_s.tobytes(), samples, seed)
    known = _DRAWS.get(key)
    if known is not None and known[1].window_s >= window_s:
        _DRAWS.move_to_end(key)
        return known[1]
    m = len(counts)
    rows = np.repeat(counts[None, :], m + 1, axis=0)
    rows[1:] -= np.eye(m, dtype=np.int64) * (counts > 0)
    time_s = model.evaluate(rows, req.loss_target, None if start else req.loss_target + 1.0)["time_s"]
    with np.errstate(invalid="ignore", divide="ignore"):
        delay_s = outage_s * (1.0 - time_s[0] / time_s[1:])
    delay_s = np.where(counts > 0, np.where(np.isnan(delay_s), outage_s, delay_s), 0.0)
    window_s *= _DRAWS_MARGIN  # later re-plans of the plan, with more time left, need no new draws
    times_a, kinds = _merged(counts * hazard_per_s, window_s, samples, seed)
    draws = _Draws.of(window_s, times_a, kinds, delay_s, model.prices_usd_per_h)
    _DRAWS[key] = (model.profile, draws)
    if len(_DRAWS) > _DRAWS_KEPT:
        _DRAWS.popitem(last=False)
    return draws


def assess(problem: Problem, counts: np.ndarray, frontier: Frontier, samples: int = SAMPLES,
           seed: int = SEED) -> Risk:
    """P(meet the budget) and expected cost of one plan under the request's hazards, from the
    plan's remembered draws (`_draws`): only the samples with a revocation before the run ends
    are followed, one vectorised step per arrival."""
    req, model = problem.request, problem.model
    counts = np.asarray(counts, dtype=np.int64)
    hazard_per_s = np.array([req.hazards_per_h.get(n, 0.0) for n in model.types.names]) / 3600.0
    window_s, rec_s = problem.budget_s, req.recovery_s
    on_time = window_s * (1 + 1e-9)
    r = problem.evaluate(counts)
    t_plan, usd_per_h = float(r["time_s"][0]), float(r["usd_per_h"][0])
    d = _draws(problem, counts, hazard_per_s, window_s, samples, seed)
    # Samples whose first revocation comes after the run or the window change nothing.
    n = int(np.searchsorted(d.first_s, min(t_plan, window_s)))
    meet, cost_sum = 0, 0.0
    if n:
        size = d.times_s.shape[1]
        steps = int(np.searchsorted(d.reach_s, window_s)) + 1  # + 1: an arrival none has in the window
        # A revocation counts while every one so far came before the (delayed) finish; the
        # tests hold for a prefix of each sample's arrivals (running maxima, sorted times).
        fits = (d.slack_s[:steps, :n] < t_plan) & (d.times_s[:steps, :n] < window_s)
        last = (fits.sum(axis=0) - 1) * size + np.arange(n)
        finish_s = t_plan + d.delayed_s.take(last)
        replacement_usd = d.paid_usd_per_h.take(last) * rec_s / 3600.0
        cost = finish_s * usd_per_h / 3600.0 + replacement_usd
        # Re-planning from the first revocation that makes the run late.
        late = d.overrun_s.take(last) > window_s - t_plan
        first_late = (d.overrun_s[:steps, :n] <= window_s - t_plan).sum(axis=0) * size + np.arange(n)
        switch_s = np.where(late, d.times_s.take(np.minimum(first_late, last)) + rec_s, 0.0)
        share = (finish_s - switch_s) / t_plan
        replan = late & (share > 0)
        allowed_s = (window_s - switch_s) / np.where(replan, share, 1.0)
        run_s, run_usd = frontier.cheapest_within(allowed_s)
        finish_s = np.where(replan, switch_s + share * run_s, finish_s)
        cost = np.where(replan, switch_s * usd_per_h / 3600.0 + share * run_usd + replacement_usd, cost)
        meet, cost_sum = np.count_nonzero(finish_s <= on_time), float(cost.sum())
    quiet = samples - n
    return Risk(float((quiet * (t_plan <= on_time) + meet) / samples),
                (quiet * t_plan * usd_per_h / 3600.0 + cost_sum) / samples, float(r["cost_usd"][0]), t_plan)


def _merged(rate_per_s: np.ndarray, window_s: float, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The arrivals of all types up to at least window_s, sorted per sample (inf-padded), and
    their types, of the samples (in order) that have any within window_s: type m's revocations
    are a Poisson process at rate_per_s[m], drawn as the unit-rate arrivals of `_unit_arrivals`
    over rate_per_s[m] (the same arrivals for every plan: common random numbers). Only those
    samples are merged and sorted."""
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
    return np.take_along_axis(times_a, order, axis=1), kind_of[order]


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


@register("risk", uses_hazards=True)
def solve_risk(problem: Problem) -> PlanResult:
    started = time.perf_counter()
    level = problem.request.target_probability
    fastest, stats = exact.fastest_plan(problem)
    evaluated = stats.evaluated
    if fastest.time_s > problem.budget_s * (1 + 1e-9):  # no plan meets the deadline even without revocations
        result = exact_answer(problem)  # infeasible too: its message says why
        return dataclasses.replace(result, solve_seconds=time.perf_counter() - started)
    deadlines_s = [fastest.time_s + step * (problem.budget_s - fastest.time_s) for step in SLACK_STEPS]
    optima = []
    for best, stats in exact.search_deadlines(problem, [d * (1 + 1e-9) for d in deadlines_s]):
        evaluated += stats.evaluated
        optima.append(best.counts if best.counts is not None else fastest.counts)
    frontier = Frontier.of(problem, optima)
    spread = dataclasses.replace(problem, upper=np.maximum(problem.lower, np.minimum(problem.upper, SPREAD_CAP)))
    seen: dict[tuple, Risk] = {}
    for deadline_s, optimum in zip(deadlines_s, optima):
        variants = [optimum]
        if (optimum > spread.upper).any():  # otherwise the optimum is already spread
            capped, stats = exact.search(spread, "cost", deadline_s=deadline_s * (1 + 1e-9))
            evaluated += stats.evaluated
            variants.append(capped.counts)
        for counts in variants:
            if counts is not None and tuple(counts) not in seen:
                seen[tuple(counts)] = assess(problem, counts, frontier)
        meeting = [r.expected_cost_usd for r in seen.values() if r.meet_probability >= level]
        if meeting and seen[tuple(optimum)].predicted_cost_usd >= min(meeting):
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
