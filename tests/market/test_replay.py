"""The replay simulator and the policies: no revocation reproduces the model, a revocation costs
what it should and triggers a re-plan around the survivors, restarts lose work since the last
checkpoint, and the risk-aware planner meets its level."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tasks.core.model import Model
from tasks.core.profile import load_profile, profile_from_dict
from tasks.market.policies import Policy, Situation, standard_policies
from tasks.market.replay import Market, ReplayConfig, replay
from tasks.planner import PlanRequest, build_problem, fastest_time_s, solve
from tests.helpers import RecordingPolicy, SHIPPED_PROFILE

PROFILE = load_profile(SHIPPED_PROFILE)
MODEL = Model.from_profile(PROFILE)
NAMES = MODEL.types.names
P3 = NAMES.index("p3.2xlarge")


def p3_revoked_at(time_s: float, fraction: float = 1.0) -> Market:
    """Spot prices of the profile; only p3.2xlarge is revoked, once, at time_s."""
    events = [None] * len(NAMES)
    events[P3] = (np.array([time_s]), np.array([fraction]))
    return Market(MODEL.types.spot_usd_per_h, np.zeros(len(NAMES)), events, seed=0)


@pytest.mark.parametrize("deadline_s", [2200.0, 3000.0, 4000.0])
def test_no_revocation_reproduces_the_model(deadline_s):
    plan = solve(PlanRequest(PROFILE, 0.8, deadline_s))
    calm = Market(MODEL.types.spot_usd_per_h, np.zeros(len(NAMES)), [None] * len(NAMES), seed=0)
    for market in (None, calm):
        out = replay(PROFILE, MODEL, Policy("exact"), ReplayConfig(0.8, deadline_s), market)
        assert out.time_s == pytest.approx(plan.predicted_time_s, rel=1e-9)
        assert out.cost_usd == pytest.approx(plan.predicted_cost_usd, rel=1e-9)
        assert out.met_deadline and out.finished and out.revocations == out.replans == 0


def test_on_demand_pays_on_demand_and_is_never_revoked():
    plan = solve(PlanRequest(PROFILE, 0.8, 3000.0, on_demand=True))
    out = replay(PROFILE, MODEL, Policy("on-demand", on_demand=True), ReplayConfig(0.8, 3000.0), p3_revoked_at(100.0))
    assert out.revocations == 0
    assert out.cost_usd == pytest.approx(plan.predicted_cost_usd, rel=1e-9)


def test_losing_the_only_instance_costs_the_outage_in_time_and_the_startup_in_cost():
    cfg = ReplayConfig(0.8, 4000.0, overhead_s=120.0)
    policy = RecordingPolicy("p3 only", types=("p3.2xlarge",))
    alone = solve(PlanRequest(PROFILE, 0.8, 4000.0))
    assert alone.plan == {"p3.2xlarge": 1}
    out = replay(PROFILE, MODEL, policy, cfg, p3_revoked_at(1000.0))
    # No survivor: nothing trains until the replacement joins at 1120 s, which then does the rest.
    assert out.revocations == 1 and out.replans == 1
    assert out.time_s == pytest.approx(alone.predicted_time_s + 120.0, rel=1e-9)
    price = PROFILE.instance("p3.2xlarge").spot_price
    assert out.cost_usd == pytest.approx(price * out.time_s / 3600, rel=1e-9)  # 1000 s + launch to end
    replan = policy.seen[1]
    assert replan.existing == {} and replan.time_left_s == pytest.approx(3000.0)
    assert 0.8 < replan.current_loss < 1.5


def test_revocation_triggers_a_replan_that_keeps_the_survivors():
    cfg = ReplayConfig(0.8, 2500.0, overhead_s=120.0)
    policy = RecordingPolicy("exact")
    calm = replay(PROFILE, MODEL, policy, cfg, None)
    first = solve(PlanRequest(PROFILE, 0.8, 2500.0)).plan
    assert first == {"p3.2xlarge": 2, "g3.8xlarge": 3}
    policy.seen.clear()
    out = replay(PROFILE, MODEL, policy, cfg, p3_revoked_at(1000.0))
    assert out.revocations == 2 and out.replans == 1
    replan = policy.seen[1]
    assert replan.existing == {"g3.8xlarge": 3}  # the survivors are kept, the p3s are gone
    assert replan.time_left_s == pytest.approx(1500.0) and replan.overhead_s == 120.0
    new_plan = Policy("exact").plan(PROFILE, 0.8, replan)
    assert new_plan["g3.8xlarge"] >= 3 and new_plan != {"g3.8xlarge": 3}
    assert out.cost_usd > calm.cost_usd  # the lost p3 work is bought again at a worse rate
    assert out.met_deadline


def test_restart_policy_resumes_from_the_last_checkpoint():
    cfg = ReplayConfig(0.8, 4000.0, overhead_s=120.0, checkpoint_s=300.0)
    policy = Policy("restart", types=("p3.2xlarge",), restart_on_preemption=True)
    t_alone = solve(PlanRequest(PROFILE, 0.8, 4000.0)).predicted_time_s
    out = replay(PROFILE, MODEL, policy, cfg, p3_revoked_at(1000.0))
    # Saved at 900 s, revoked at 1000 s, back at 1120 s: 100 s of work lost plus the outage.
    assert out.time_s == pytest.approx(t_alone + 100.0 + 120.0, rel=1e-9)
    assert out.replans == 0 and out.revocations == 1


def test_partial_revocation_thins_the_trace_per_instance():
    market = p3_revoked_at(500.0, fraction=0.5)
    times = market.revocation_times_s(P3, 4000, launch_s=0.0)
    assert set(np.unique(times)) <= {500.0, np.inf}
    assert 0.45 < np.mean(times == 500.0) < 0.55
    assert np.isinf(market.revocation_times_s(P3, 3, launch_s=500.0)).all()  # launched after the event


def test_fallback_when_no_plan_meets_the_deadline_any_more():
    s = Situation({"p3.2xlarge": 1}, 50.0, 1.0, 120.0)  # the deadline lies within the overhead
    plan = Policy("exact").plan(PROFILE, 0.8, s)
    assert plan["p3.2xlarge"] >= 1 and sum(plan.values()) > 1  # the fastest it can run


def test_risk_aware_meets_its_level_under_synthetic_hazards():
    level, deadline_s = 0.9, 2300.0
    hazards = {"p3.2xlarge": 0.6, "g4dn.4xlarge": 0.6, "g3.8xlarge": 0.3, "g3.16xlarge": 0.3, "p2.8xlarge": 0.3}
    rate_per_s = np.array([hazards[n] for n in NAMES]) / 3600.0
    cfg = ReplayConfig(0.8, deadline_s, overhead_s=120.0)
    policy = Policy("risk-aware", solver="risk", target_probability=level, hazards_per_h=hazards)
    runs = [replay(PROFILE, MODEL, policy, cfg, Market(MODEL.types.spot_usd_per_h, rate_per_s, [None] * len(NAMES), i))
            for i in range(12)]
    assert np.mean([r.met_deadline for r in runs]) >= level
    assert sum(r.revocations for r in runs) > 0


def test_standard_policies_are_the_seven_of_the_comparison():
    policies = standard_policies(PROFILE, 0.8, 3000.0, 0.95, {"p3.2xlarge": 0.6})
    names = [p.name for p in policies]
    assert names == ["heuristic", "exact", "homogeneous-fast", "homogeneous-slow", "on-demand", "restart-single",
                     "risk-aware"]
    by_name = {p.name: p for p in policies}
    assert by_name["homogeneous-fast"].types == ("p3.2xlarge",)  # fastest per GPU
    assert by_name["homogeneous-slow"].types == ("p2.8xlarge",)  # slowest per GPU (K80)
    assert by_name["restart-single"].restart_on_preemption
    assert by_name["risk-aware"].solver == "risk"



@settings(max_examples=12, deadline=None)
@given(loss=st.floats(0.65, 1.2), slack=st.floats(1.02, 2.5), cut=st.floats(0.01, 0.95))
def test_replay_time_and_cost_follow_the_model(loss, slack, cut):
    """For any target: with no revocation the replay is the model; when every instance is lost at
    once and a restart without checkpoints relaunches the plan, the run takes the lost time plus
    T_ohd plus a whole run, and every instance-second is paid."""
    deadline_s = fastest_time_s(build_problem(PlanRequest(PROFILE, loss, 1e9))) * slack
    plan = solve(PlanRequest(PROFILE, loss, deadline_s))
    calm = replay(PROFILE, MODEL, Policy("exact"), ReplayConfig(loss, deadline_s), None)
    assert calm.time_s == pytest.approx(plan.predicted_time_s, rel=1e-9)
    assert calm.cost_usd == pytest.approx(plan.predicted_cost_usd, rel=1e-9)
    cut_s = cut * plan.predicted_time_s
    market = Market(MODEL.types.spot_usd_per_h, np.zeros(len(NAMES)),
                    [(np.array([cut_s]), np.array([1.0]))] * len(NAMES), seed=0)
    cfg = ReplayConfig(loss, deadline_s, overhead_s=120.0, checkpoint_s=0.0)  # 0: never saved
    out = replay(PROFILE, MODEL, Policy("restart", restart_on_preemption=True), cfg, market, first_plan=plan.plan)
    assert out.revocations == sum(plan.plan.values()) and out.replans == 0
    assert out.time_s == pytest.approx(cut_s + 120.0 + plan.predicted_time_s, rel=1e-9)
    assert out.cost_usd == pytest.approx(plan.usd_per_h * out.time_s / 3600.0, rel=1e-9)


def _with_further_terms() -> Model:
    data = PROFILE.model_dump()
    data["contention"].update(overlap=0.6, overlap_width=0.3)
    data["loss"]["batch_n_exponent"] = -0.7
    return Model.from_profile(profile_from_dict(data))


@pytest.mark.parametrize("further", [False, True])
def test_cluster_clock_tells_the_models_remaining_time(further):
    """Also with the further terms of docs/model.md: the clock's time per unit of progress is
    the model's, whatever the cluster's overlap and batch n-exponent."""
    from tasks.market.replay import ClusterClock

    model = _with_further_terms() if further else MODEL
    clock = ClusterClock(model, 0.8)
    rng = np.random.default_rng(3)
    for _ in range(20):
        counts = rng.integers(0, 3, len(NAMES))
        counts[P3] += 1
        loss = float(rng.uniform(0.82, 2.0))
        r = model.evaluate(counts, 0.8, loss)
        assert clock.remaining_s(counts, loss) == pytest.approx(float(r["time_s"][0]), rel=1e-12)
        start = model.evaluate(counts, 0.8)
        assert clock.from_start(counts) == (float(start["time_s"][0]), float(start["iterations"][0]))
    if further:  # the terms are in effect: 12 workers of one type (a contended PS) are slower than without them
        same = MODEL.counts_vector({"g3.16xlarge": 12})
        assert model.evaluate(same, 0.8)["iteration_time_s"][0] > MODEL.evaluate(same, 0.8)["iteration_time_s"][0]
