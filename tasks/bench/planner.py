"""`spotfill bench planner`: heuristic vs exact solve time and cost gap, checked by brute force.

Cases: 5 x quota 10 (paper size), 5 x 50, 7 x 10, 7 x 50, 20 x 20 and 40 x 100 types x quota,
each at a tight deadline (1.25 x the fastest plan's time) and a loose one (2 x). The first five
types are the shipped ResNet-110 profile's; more are synthetic (synthetic.py, seed 7). The
"market" case plans over offers (offers.py): every catalog GPU type sharing a GPU model with the
shipped profile's types, in MARKET_REGIONS, quota 100 per offer; "market+od" adds each offer's
on-demand twin (on_demand.py), its on-demand quota equal to its spot quota, so the search has
twice the offers and every class two prices. Times are medians of repeated
solves in this one run (wall and CPU seconds), the fastest-plan search timed too; brute force
runs wherever its estimated time is under a minute.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from tasks.core.catalog import REPO
from tasks.core.profile import load_profile
from tasks.core.progress import ProgressBar
from tasks.planner import exact
from tasks.planner.brute import solve_brute_force
from tasks.planner.exact import composition_count
from tasks.planner.heuristic import solve_heuristic
from tasks.planner.offers import market_profile
from tasks.planner.problem import COST_TIE_REL, PlanRequest, build_problem
from tasks.planner.synthetic import extend_profile

CASES = [(5, 10), (5, 50), (7, 10), (7, 50), (20, 20), (40, 100)]
MARKET_REGIONS = ("us-east-1", "us-east-2", "us-west-2", "ap-northeast-1")
MARKET_QUOTA = 100
DEADLINE_FACTORS = {"tight": 1.25, "loose": 2.0}
LOSS_TARGET = 0.8
BRUTE_BUDGET_S = 60.0
ON_DEMAND_LIMIT_S = 1.0  # the exact solve over spot and on-demand offers should stay within this


def _median_time_s(fn, repeats: int) -> tuple[float, object, float]:
    """Median wall seconds, the last result, median CPU seconds, each solve from scratch."""
    times, cpu, out = [], [], None
    for _ in range(repeats):
        exact.forget_scored()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), out, statistics.median(cpu)


def market_case_profile(base, on_demand: bool = False):
    """The shipped profile's GPU models across MARKET_REGIONS, MARKET_QUOTA per offer (on_demand:
    as many on-demand workers of each offer, planned as its `:on-demand` twin)."""
    market, _ = market_profile(base, MARKET_REGIONS, {}, require_prices=False)
    on_demand_quota = MARKET_QUOTA if on_demand else 0
    market = market.model_copy(update={"workload": f"{base.workload}-market", "instances": [
        i.model_copy(update={"quota": MARKET_QUOTA, "on_demand_quota": on_demand_quota}) for i in market.instances]})
    return market


def _brute_rate_per_s(problem) -> float:
    """Compositions brute force scores per second, measured on this machine now."""
    rows = np.tile(problem.lower, (1 << 16, 1)) + 1
    t0 = time.perf_counter()
    problem.evaluate(rows)
    return (1 << 16) / (time.perf_counter() - t0)


def run_bench(quick: bool = False) -> dict:
    base = load_profile(REPO / "profiles" / "resnet110-cifar100.json")
    repeats = 3 if quick else 5
    rows = []
    rate = None
    cases = [(f"{n} x {q}", extend_profile(base, n, q)) for n, q in CASES]
    cases.append(("market", market_case_profile(base)))
    cases.append(("market+od", market_case_profile(base, on_demand=True)))
    with ProgressBar(len(cases), "bench planner") as bar:
        for case, profile in cases:
            open_problem = build_problem(PlanRequest(profile, LOSS_TARGET, 1e12))
            f_s, (fastest, _), f_cpu = _median_time_s(
                lambda: exact.search(open_problem, "time", deadline_s=np.inf), repeats)
            problems = {name: build_problem(PlanRequest(profile, LOSS_TARGET, f * fastest.time_s))
                        for name, f in DEADLINE_FACTORS.items()}
            rate = rate or _brute_rate_per_s(open_problem)
            count = composition_count(open_problem)
            brute_est_s = count / rate
            brute = None
            if brute_est_s <= BRUTE_BUDGET_S and not (quick and brute_est_s > 5):
                t0 = time.perf_counter()
                brute = solve_brute_force(open_problem, [p.budget_s for p in problems.values()])
                brute_s = time.perf_counter() - t0
            names = open_problem.model.types.names  # offers, on-demand twins included
            for b, (name, problem) in enumerate(problems.items()):
                h_s, (h_best, _), _ = _median_time_s(lambda: solve_heuristic(problem), repeats)
                e_s, (e_best, stats), e_cpu = _median_time_s(lambda: exact.search(problem, "cost"), repeats)
                row = {
                    "case": case, "types": len(names),
                    "quota": int(open_problem.upper.max()), "deadline": name,
                    "deadline_s": problem.budget_s, "heuristic_s": h_s, "exact_s": e_s, "exact_cpu_s": e_cpu,
                    "fastest_search_s": f_s, "fastest_search_cpu_s": f_cpu,
                    "heuristic_cost_usd": h_best.cost, "exact_cost_usd": e_best.cost,
                    "gap": (h_best.cost / e_best.cost - 1) if np.isfinite(h_best.cost) else None,
                    "exact_plan": {names[i]: int(c) for i, c in enumerate(e_best.counts) if c},
                    "exact_nodes": stats.nodes, "exact_clusters_scored": stats.evaluated,
                    "compositions": count, "brute_estimate_s": brute_est_s,
                    "brute_s": None, "brute_cost_usd": None, "exact_equals_brute": None,
                }
                if brute is not None:
                    row["brute_s"] = brute_s
                    row["brute_cost_usd"] = brute[b].cost
                    row["exact_equals_brute"] = bool(abs(brute[b].cost - e_best.cost) <= COST_TIE_REL * brute[b].cost)
                rows.append(row)
            bar.advance(note=case)
    checked = [r for r in rows if r["exact_equals_brute"] is not None]
    on_demand_s = max(r["exact_s"] for r in rows if r["case"] == "market+od")
    return {
        "loss_target": LOSS_TARGET, "repeats": repeats, "rows": rows,
        "exact_never_worse": all(r["exact_cost_usd"] <= r["heuristic_cost_usd"] * (1 + COST_TIE_REL) for r in rows),
        "brute_checked": len(checked), "brute_all_equal": all(r["exact_equals_brute"] for r in checked),
        "max_gap": max((r["gap"] for r in rows if r["gap"] is not None), default=None),
        "on_demand_exact_s": on_demand_s, "on_demand_within_limit": on_demand_s <= ON_DEMAND_LIMIT_S,
    }


def format_table(result: dict) -> str:
    head = (f"{'case':<10}{'types':>6}{'deadline':>9}{'heur ms':>9}{'exact ms':>10}{'fastest ms':>11}"
            f"{'heur $':>9}{'exact $':>9}{'gap':>8}{'brute':>16}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        if r["brute_s"] is None:
            brute = f"skip (~{r['brute_estimate_s']:.0e} s)"
        else:
            brute = ("= exact" if r["exact_equals_brute"] else "DIFFERS") + f" {r['brute_s']:.1f}s"
        gap = "n/a" if r["gap"] is None else f"{100 * r['gap']:.1f}%"
        lines.append(
            f"{r['case']:<10}{r['types']:>6}{r['deadline']:>9}{1000 * r['heuristic_s']:>9.1f}"
            f"{1000 * r['exact_s']:>10.1f}{1000 * r['fastest_search_s']:>11.1f}{r['heuristic_cost_usd']:>9.3f}"
            f"{r['exact_cost_usd']:>9.3f}{gap:>8}{brute:>16}")
    lines.append("")
    lines.append(f"exact never costlier than heuristic: {result['exact_never_worse']}; "
                 f"brute force agrees on {result['brute_checked']} case(s): {result['brute_all_equal']}; "
                 f"largest heuristic gap: {100 * (result['max_gap'] or 0):.1f}%  (median of {result['repeats']} solves; "
                 f"market: {', '.join(MARKET_REGIONS)}, quota {MARKET_QUOTA} per offer)")
    lines.append(f"market with on-demand offers: slowest exact solve {1000 * result['on_demand_exact_s']:.1f} ms, "
                 f"within {ON_DEMAND_LIMIT_S:g} s: {result['on_demand_within_limit']}")
    return "\n".join(lines)
