"""The shared re-plan policy and its memo: a remembered answer is the answer a solve would give."""
import numpy as np
import pytest

from tasks.core.profile import load_profile
from tasks.market.replan import ReplanMemo, cheapest_or_fastest, fastest_result
from tasks.planner import PlanRequest
from tests.helpers import SHIPPED_PROFILE

PROFILE = load_profile(SHIPPED_PROFILE)


@pytest.mark.parametrize("solver", ["exact", "heuristic"])
def test_memo_answers_what_a_solve_answers(solver):
    rng = np.random.default_rng(18)
    memo = ReplanMemo()
    survivors = [{}, {"p3.2xlarge": 1}, {"p3.2xlarge": 1, "g3.8xlarge": 3}, {"g3.8xlarge": 2}]
    for _ in range(60):
        request = PlanRequest(PROFILE, 0.8, float(rng.uniform(150, 2600)), existing=survivors[rng.integers(4)],
                              overhead_s=120.0, current_loss=float(rng.uniform(0.85, 1.6)), solver=solver)
        assert memo.plan(request) == cheapest_or_fastest(request).result.plan
    assert memo.hits > 10 and memo.hits + memo.solves == 60


def test_no_plan_in_time_falls_back_to_the_fastest_with_the_reason():
    late = cheapest_or_fastest(PlanRequest(PROFILE, 0.8, 300.0))
    fastest = fastest_result(PlanRequest(PROFILE, 0.8, 300.0))
    assert late.result.plan == fastest.plan and "no plan meets the deadline" in late.at_risk
    within = cheapest_or_fastest(PlanRequest(PROFILE, 0.8, 100.0, overhead_s=120.0, current_loss=1.0))
    assert "within the start overhead" in within.at_risk and within.result.solver == "fastest"
    assert cheapest_or_fastest(PlanRequest(PROFILE, 0.8, 3000.0)).at_risk is None


def test_memo_keeps_answers_for_different_size_floors_apart():
    memo = ReplanMemo()
    for floor in (1, 8, 1, 8):
        request = PlanRequest(PROFILE, 0.8, 2400.0, overhead_s=120.0, current_loss=1.2, min_workers=floor)
        assert memo.plan(request) == cheapest_or_fastest(request).result.plan
    assert memo.hits == 2
