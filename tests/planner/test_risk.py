"""The risk-aware planner, as the pipeline reaches it: tasks.planner.solve with solver="risk"."""
import dataclasses

import numpy as np
import pytest

from tasks.core.errors import InfeasibleError, UserInputError
from tasks.core.profile import load_profile
from tasks.planner import PlanRequest, build_problem, exact, solve
from tasks.planner.risk import Frontier, assess
from tests.helpers import SHIPPED_PROFILE

PROFILE = load_profile(SHIPPED_PROFILE)
STORMY = {"p3.2xlarge": 2.0, "g4dn.4xlarge": 2.0, "g3.8xlarge": 2.0, "g3.16xlarge": 2.0, "p2.8xlarge": 2.0}


def fastest_only(problem):
    best, _ = exact.search(problem, "time", deadline_s=np.inf)
    return Frontier.of(problem, [best.counts])


def test_without_hazards_risk_is_the_exact_optimum():
    for deadline_s in (2500.0, 4000.0):
        exact = solve(PlanRequest(PROFILE, 0.8, deadline_s))
        risk = solve(PlanRequest(PROFILE, 0.8, deadline_s, solver="risk"))
        assert risk.plan == exact.plan and risk.solver == "risk"
        assert risk.meet_probability == 1.0


@pytest.mark.parametrize("level", [0.5, 0.9, 0.99])
def test_risk_plan_meets_its_level_and_costs_at_least_the_exact_plan(level):
    req = PlanRequest(PROFILE, 0.8, 3000.0, solver="risk", target_probability=level, hazards_per_h=STORMY)
    risk = solve(req)
    exact = solve(dataclasses.replace(req, solver="exact"))
    assert risk.meet_probability >= level and not risk.message
    assert risk.predicted_cost_usd >= exact.predicted_cost_usd * (1 - 1e-9)
    assert risk.predicted_time_s <= 3000.0


def test_stormier_markets_buy_more_slack():
    calm = solve(PlanRequest(PROFILE, 0.8, 2800.0, solver="risk", hazards_per_h={"p3.2xlarge": 0.01}))
    stormy = solve(PlanRequest(PROFILE, 0.8, 2800.0, solver="risk", hazards_per_h=STORMY, target_probability=0.99))
    assert stormy.predicted_time_s < calm.predicted_time_s
    assert stormy.predicted_cost_usd > calm.predicted_cost_usd


def test_assess_is_exact_without_hazards_and_lower_with_them():
    counts = np.array([2, 0, 5, 4, 0])  # the exact optimum at 2000 s: 1980 s, near the fastest 1921 s
    problem = build_problem(PlanRequest(PROFILE, 0.8, 2000.0, solver="risk"))
    quiet = assess(problem, counts, fastest_only(problem))
    assert quiet.meet_probability == 1.0
    assert quiet.expected_cost_usd == pytest.approx(quiet.predicted_cost_usd)
    stormy_problem = build_problem(PlanRequest(PROFILE, 0.8, 2000.0, solver="risk", hazards_per_h=STORMY))
    stormy = assess(stormy_problem, counts, fastest_only(stormy_problem))
    # 11 instances at two revocations an hour each, 20 s of slack, and re-planning can hardly
    # speed up a plan that is already nearly the fastest.
    assert stormy.meet_probability < 0.8
    assert stormy.expected_cost_usd > quiet.expected_cost_usd
    again = assess(stormy_problem, counts, fastest_only(stormy_problem))
    assert again == stormy  # fixed seed: the same answer every time


def test_a_replacement_the_market_refuses_counts_as_a_longer_outage():
    counts = np.array([2, 0, 5, 4, 0])
    hazards = {t: 0.5 for t in STORMY}
    plain = build_problem(PlanRequest(PROFILE, 0.8, 2100.0, solver="risk", hazards_per_h=hazards))
    dry = build_problem(PlanRequest(PROFILE, 0.8, 2100.0, solver="risk", hazards_per_h=hazards,
                                    replacement_wait_s={t: 600.0 for t in STORMY}))
    wet, parched = assess(plain, counts, fastest_only(plain)), assess(dry, counts, fastest_only(dry))
    assert parched.meet_probability < wet.meet_probability
    none_waits = build_problem(PlanRequest(PROFILE, 0.8, 2100.0, solver="risk", hazards_per_h=hazards,
                                           replacement_wait_s={"p3.2xlarge": 0.0}))
    assert assess(none_waits, counts, fastest_only(none_waits)) == wet
    with pytest.raises(UserInputError, match="replacement wait for p3.2xlarge must be zero or more seconds"):
        build_problem(PlanRequest(PROFILE, 0.8, 2100.0, replacement_wait_s={"p3.2xlarge": -1.0}))


def test_unreachable_level_returns_the_likeliest_plan_with_a_message():
    req = PlanRequest(PROFILE, 0.8, 1990.0, solver="risk", target_probability=0.999,
                      hazards_per_h={k: 50.0 for k in STORMY})
    result = solve(req)
    assert result.feasible and result.meet_probability < 0.999
    assert "no candidate meets the deadline with probability 0.999" in result.message


def test_risk_bad_input():
    with pytest.raises(UserInputError, match="target probability must be in"):
        solve(PlanRequest(PROFILE, 0.8, 3000.0, solver="risk", target_probability=1.5))
    with pytest.raises(UserInputError, match="hazard for p3.2xlarge must be zero or more"):
        solve(PlanRequest(PROFILE, 0.8, 3000.0, solver="risk", hazards_per_h={"p3.2xlarge": -1.0}))
    with pytest.raises(UserInputError, match="unknown instance type"):
        solve(PlanRequest(PROFILE, 0.8, 3000.0, solver="risk", hazards_per_h={"x1.large": 1.0}))
    with pytest.raises(InfeasibleError) as err:
        solve(PlanRequest(PROFILE, 0.8, 1000.0, solver="risk", hazards_per_h=STORMY))
    assert err.value.fastest_time_s == pytest.approx(1921.0, abs=1.0)


def test_assess_does_not_depend_on_what_was_assessed_before():
    """The Monte Carlo's arrivals grow in seeded blocks and each plan's draws are remembered: a
    plan's risk is the same whether or not a stormier plan needed more arrivals first, and
    whether its draws were made for this window or a longer one."""
    from tasks.planner import risk

    problem = build_problem(PlanRequest(PROFILE, 0.8, 2000.0, solver="risk", hazards_per_h=STORMY))
    counts = np.array([2, 0, 5, 4, 0])
    risk._ARRIVALS.clear()
    risk._DRAWS.clear()
    fresh = assess(problem, counts, fastest_only(problem))
    wide = build_problem(PlanRequest(PROFILE, 0.8, 20000.0, solver="risk", hazards_per_h=STORMY))
    assess(wide, counts * 2, fastest_only(wide))
    assert assess(problem, counts, fastest_only(problem)) == fresh
    # The same plan over a longer window first: its remembered draws serve the shorter one.
    risk._DRAWS.clear()
    assess(wide, counts, fastest_only(wide))
    assert assess(problem, counts, fastest_only(problem)) == fresh


def random_replans(seed: int, count: int) -> list[PlanRequest]:
    """Risk-aware re-plans as a replay makes them: survivors, time left, loss reached."""
    rng = np.random.default_rng(seed)
    survivors = [{}, {"p3.2xlarge": 1}, {"g3.8xlarge": 2}, {"p3.2xlarge": 1, "g4dn.4xlarge": 2}, {"p2.8xlarge": 1}]
    hazards = [STORMY, {k: 0.3 for k in STORMY}, {"p3.2xlarge": 1.0, "g4dn.4xlarge": 0.5}]
    return [PlanRequest(PROFILE, 0.8, float(rng.uniform(400, 2600)), existing=survivors[rng.integers(len(survivors))],
                        overhead_s=120.0, current_loss=float(rng.uniform(0.85, 1.6)), solver="risk",
                        target_probability=float(rng.choice([0.9, 0.95, 0.99])),
                        hazards_per_h=hazards[rng.integers(len(hazards))], recovery_s=120.0)
            for _ in range(count)]


def test_remembered_draws_answer_what_fresh_draws_answer():
    """Re-plans after many others (draws remembered, made for other windows) get exactly the
    answer and estimate of a solve with nothing remembered."""
    from tasks.planner import risk

    requests = random_replans(18, 30)
    remembered = []
    for request in requests:
        try:
            remembered.append(solve(request))
        except InfeasibleError:
            remembered.append(None)
    for request, warm in zip(requests, remembered):
        if warm is None:
            continue
        problem = build_problem(request)
        frontier = fastest_only(problem)
        counts = problem.model.counts_vector(warm.plan)
        warm_risk = assess(problem, counts, frontier)
        risk._DRAWS.clear()
        risk._ARRIVALS.clear()
        assert assess(problem, counts, frontier) == warm_risk
        risk._DRAWS.clear()
        fresh = solve(request)
        assert (warm.plan, warm.meet_probability) == (fresh.plan, fresh.meet_probability)
