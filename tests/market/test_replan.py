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


def test_a_floor_spot_alone_cannot_reach_moves_the_missing_worker_to_on_demand():
    """The market refused a type (its spot quota 0): spot alone cannot reach min_workers, which is
    no error but a reason for an on-demand twin (the live run's drought)."""
    from tasks.market.replan import deadline_safe
    from tests.helpers import LOCAL_QUICK_PROFILE

    request = PlanRequest(load_profile(LOCAL_QUICK_PROFILE), 1.7, 50.0, existing={"g3.8xlarge": 2},
                          quota={"p3.2xlarge": 0, "g3.8xlarge": 2}, on_demand_quota={"p3.2xlarge": 2},
                          overhead_s=3.0, min_workers=3, current_loss=2.5)
    replanned = deadline_safe(request, reserve_s=3.0)
    assert replanned.result.plan == {"g3.8xlarge": 2, "p3.2xlarge:on-demand": 1} and replanned.at_risk is None
