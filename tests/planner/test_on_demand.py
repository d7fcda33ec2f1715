"""On-demand offers (tasks/planner/on_demand.py): `TYPE:on-demand` twins of the spot types, and
the exact solver over spot and on-demand offers together against brute force."""
import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.core.errors import UserInputError
from tasks.core.profile import load_profile, profile_from_dict
from tasks.planner import PlanRequest, fastest_plan, solve, solve_problem
from tasks.planner import exact
from tasks.planner.brute import solve_brute_force
from tasks.planner.exact import composition_count
from tasks.planner.on_demand import (base_type, is_on_demand, market_of, on_demand_name, on_demand_quotas,
                                     split_counts, with_on_demand)
from tasks.planner.problem import build_problem
from tasks.planner.risk import SAMPLES, SEED, Frontier, _draws, assess
from tests.helpers import SHIPPED_PROFILE, fastest, profiles, same_cost


@pytest.fixture(scope="module")
def shipped():
    return load_profile(SHIPPED_PROFILE)


def with_field(profile, on_demand_quota):
    """The profile with these types' `on_demand_quota` set, as a profile file would give it."""
    data = profile.model_dump()
    for inst in data["instances"]:
        inst["on_demand_quota"] = on_demand_quota.get(inst["type"], 0)
    return profile_from_dict(data)


def test_names_say_the_market_and_the_type():
    assert on_demand_name("p3.2xlarge") == "p3.2xlarge:on-demand"
    assert is_on_demand("p3.2xlarge:on-demand") and not is_on_demand("p3.2xlarge")
    assert base_type("p3.2xlarge:on-demand") == base_type("p3.2xlarge") == "p3.2xlarge"
    assert (market_of("p3.2xlarge:on-demand"), market_of("p3.2xlarge@us-east-1")) == ("on-demand", "spot")
    assert split_counts({"p3.2xlarge": 2, "p3.2xlarge:on-demand": 1, "g3.8xlarge": 0}) == {
        "spot": {"p3.2xlarge": 2}, "on-demand": {"p3.2xlarge": 1}}


def test_no_on_demand_quota_leaves_the_profile_as_it_is(shipped):
    assert with_on_demand(shipped) is shipped
    assert with_on_demand(shipped, {"p3.2xlarge": 0}) is shipped
    assert set(on_demand_quotas(shipped, {}).values()) == {0}


def test_a_twin_has_its_types_hardware_at_the_on_demand_price(shipped):
    expanded = with_on_demand(with_field(shipped, {"p3.2xlarge": 3}))
    assert expanded.type_names[:2] == ["p3.2xlarge", "p3.2xlarge:on-demand"]
    spot, twin = expanded.instance("p3.2xlarge"), expanded.instance("p3.2xlarge:on-demand")
    assert (twin.gpus, twin.batch_per_gpu, twin.compute_time_s) == (spot.gpus, spot.batch_per_gpu, spot.compute_time_s)
    assert (twin.spot_price, twin.on_demand_price, twin.quota) == (spot.on_demand_price, spot.on_demand_price, 3)
    assert spot.quota == shipped.instance("p3.2xlarge").quota
    assert len(expanded.instances) == len(shipped.instances) + 1


def test_an_override_wins_over_the_profile_field(shipped):
    profile = with_field(shipped, {"p3.2xlarge": 3, "g3.8xlarge": 2})
    quotas = on_demand_quotas(profile, {"p3.2xlarge": 1, "g4dn.4xlarge": 4})
    assert (quotas["p3.2xlarge"], quotas["g4dn.4xlarge"], quotas["g3.8xlarge"], quotas["p2.8xlarge"]) == (1, 4, 2, 0)
    expanded = with_on_demand(profile, {"g3.8xlarge": 0})
    assert "g3.8xlarge:on-demand" not in expanded.type_names and "p3.2xlarge:on-demand" in expanded.type_names


def test_twins_are_never_doubled_and_keep_their_quota_when_expanded_again(shipped):
    once = with_on_demand(shipped, {"p3.2xlarge": 2, "g3.8xlarge": 1})
    twice = with_on_demand(once)
    assert twice.type_names == once.type_names and twice.instance("p3.2xlarge").on_demand_quota == 2
    assert twice.instance("p3.2xlarge:on-demand").quota == 2  # from the override, not the profile's 0
    assert with_on_demand(once, {"g3.8xlarge": 4}).instance("g3.8xlarge:on-demand").quota == 4
    # a request solved once and rebuilt (the confidence path re-solves its own request) plans the same offers
    problem = build_problem(PlanRequest(shipped, 0.8, 3000, on_demand_quota={"p3.2xlarge": 2}))
    again = build_problem(problem.request)
    assert again.model.types.names == problem.model.types.names
    np.testing.assert_array_equal(again.upper, problem.upper)


def test_planning_at_the_intervals_upper_end_compares_with_the_central_plan_over_the_same_offers(shipped):
    """The confidence path re-solves its own (built) request for the central plan: that plan may
    use the on-demand workers the request allowed, as a fresh solve at the centre does."""
    profile = profile_from_dict(shipped.model_dump() | {"uncertainty": {"time_log_sd": 0.05}})
    short = {t: 0 for t in shipped.type_names} | {"p3.2xlarge": 1, "g4dn.4xlarge": 1}
    kw = dict(quota=short, on_demand_quota={"p3.2xlarge": 3})
    upper = solve(PlanRequest(profile, 0.8, 2500, confidence=0.9, **kw))
    central = solve(PlanRequest(profile, 0.8, 2500, **kw))
    assert split_counts(central.plan)["on-demand"]
    assert upper.confidence["central_cost_usd"] == pytest.approx(central.predicted_cost_usd, rel=1e-12)


@pytest.mark.parametrize("overrides, message", [
    ({"nope.large": 1}, r"^unknown instance type 'nope.large' \(profile 'resnet110-cifar100' has: p3.2xlarge, "),
    ({"p3.2xlarge:on-demand": 1}, r"^on-demand quota for 'p3.2xlarge:on-demand': name the spot type \(p3.2xlarge\)$"),
])
def test_an_override_must_name_a_spot_type(shipped, overrides, message):
    with pytest.raises(UserInputError, match=message):
        with_on_demand(shipped, overrides)
    with pytest.raises(UserInputError, match=message):
        solve(PlanRequest(shipped, 0.8, 3000, on_demand_quota=overrides))


@pytest.mark.parametrize("value, message", [
    (-1, r"^p: instances.0.on_demand_quota: Input should be greater than or equal to 0$"),
    (10**9, r"^p: instances.0.on_demand_quota: Value error, quota 1000000000 is more than \d+"),
    (True, r"^p: instances.0.on_demand_quota: Input should be a valid integer"),
])
def test_the_profile_field_is_checked_by_name(shipped, value, message):
    data = shipped.model_dump()
    data["instances"][0]["on_demand_quota"] = value
    with pytest.raises(UserInputError, match=message):
        profile_from_dict(data, source="p")


def test_existing_and_quota_may_name_twins_only_when_on_demand_is_allowed(shipped):
    with pytest.raises(UserInputError, match="^.p3.2xlarge:on-demand. is an on-demand worker, and p3.2xlarge has no on-demand quota"):
        solve(PlanRequest(shipped, 0.8, 3000, existing={"p3.2xlarge:on-demand": 1}))
    r = solve(PlanRequest(shipped, 0.8, 3000, existing={"p3.2xlarge:on-demand": 1},
                          on_demand_quota={"p3.2xlarge": 1}))
    assert r.plan["p3.2xlarge:on-demand"] == 1
    with pytest.raises(UserInputError, match=r"quota for p3.2xlarge:on-demand \(0\) is below its existing count \(1\)"):
        solve(PlanRequest(shipped, 0.8, 3000, existing={"p3.2xlarge:on-demand": 1},
                          quota={"p3.2xlarge:on-demand": 0}, on_demand_quota={"p3.2xlarge": 1}))


def test_on_demand_offers_are_used_only_when_spot_runs_out(shipped):
    """Twins are filled cheapest first: at a deadline the spot quotas meet, no on-demand worker is
    planned; at one they cannot, on-demand workers make it feasible, and cost more."""
    only_p3 = {t: 0 for t in shipped.type_names} | {"p3.2xlarge": 2}
    spot = solve(PlanRequest(shipped, 0.8, 1e5, quota=only_p3))
    allowed = solve(PlanRequest(shipped, 0.8, 1e5, quota=only_p3, on_demand_quota={"p3.2xlarge": 6}))
    assert allowed.plan == spot.plan and same_cost(allowed.predicted_cost_usd, spot.predicted_cost_usd)
    tight = spot.predicted_time_s * 0.5
    rescued = solve(PlanRequest(shipped, 0.8, tight, quota=only_p3, on_demand_quota={"p3.2xlarge": 6}))
    assert rescued.plan["p3.2xlarge"] == 2 and rescued.plan["p3.2xlarge:on-demand"] >= 1
    assert rescued.predicted_time_s <= tight and rescued.predicted_cost_usd > spot.predicted_cost_usd


def test_over_regions_a_types_on_demand_quota_applies_to_its_offer_in_every_region(shipped):
    regions = ("us-east-1", "ap-northeast-1")
    problem = build_problem(PlanRequest(shipped, 0.8, 3000, regions=regions,
                                        on_demand_quota={"p3.2xlarge": 2, "p3.2xlarge@ap-northeast-1": 1}))
    twins = {n: int(q) for n, q in zip(problem.model.types.names, problem.upper) if is_on_demand(n)}
    assert twins == {"p3.2xlarge@us-east-1:on-demand": 2, "p3.2xlarge@ap-northeast-1:on-demand": 1}
    spot = problem.model.profile.instance("p3.2xlarge@us-east-1")
    assert problem.model.profile.instance("p3.2xlarge@us-east-1:on-demand").spot_price == spot.on_demand_price
    r = solve(PlanRequest(shipped, 0.8, 3000, regions=regions, on_demand_quota={"p3.2xlarge": 2},
                          existing={"p3.2xlarge@us-east-1:on-demand": 1}))
    assert r.plan["p3.2xlarge@us-east-1:on-demand"] >= 1
    offer = r.offers["p3.2xlarge@us-east-1:on-demand"]
    assert (offer["type"], offer["region"], offer["market"]) == ("p3.2xlarge", "us-east-1", "on-demand")
    assert r.unit_usd_per_h["p3.2xlarge@us-east-1:on-demand"] == spot.on_demand_price


@st.composite
def on_demand_cases(draw):
    """A random small profile with on-demand prices at, above or (rarely in a market, still
    allowed) below the spot price, on-demand quotas from the profile field or the request, and
    existing counts that may name twins."""
    profile = draw(profiles(max_types=3, max_quota=3))
    data = profile.model_dump()
    for inst in data["instances"]:
        inst["on_demand_price"] = inst["spot_price"] * draw(st.sampled_from([1.0, 3.0, 0.8]))
        inst["on_demand_quota"] = draw(st.integers(0, 3))
    profile = profile_from_dict(data)
    overrides = draw(st.dictionaries(st.sampled_from(profile.type_names), st.integers(0, 3), max_size=2))
    expanded = with_on_demand(profile, overrides)
    existing = {i.type: draw(st.integers(0, min(i.quota, 1))) for i in expanded.instances}
    return profile, overrides, existing


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(on_demand_cases(), st.floats(0.6, 1.5), st.floats(1.0, 3.0), st.data())
def test_exact_equals_brute_force_over_spot_and_on_demand_offers(case, loss, slack, data):
    profile, overrides, existing = case
    current = data.draw(st.one_of(st.none(), st.floats(loss + 0.05, loss + 1.0)))
    kw = dict(existing=existing, on_demand_quota=overrides, current_loss=current)
    deadline = fastest(profile, loss, **kw) * slack
    problem = build_problem(PlanRequest(profile, loss, deadline, **kw))
    assert composition_count(problem) <= 5000
    brute = solve_brute_force(problem)[0]
    assert brute.counts is not None
    result = solve_problem(problem)
    assert result.feasible and same_cost(result.predicted_cost_usd, brute.cost)
    searched, _ = exact.search(problem, "cost", enumerate_below=0)  # branch and bound, not enumeration
    assert same_cost(searched.cost, brute.cost)
    assert list(searched.counts) == list(brute.counts)
    quotas = on_demand_quotas(profile, overrides)
    for name, n in result.plan.items():
        assert existing.get(name, 0) <= n <= (quotas[base_type(name)] if is_on_demand(name) else
                                              profile.instance(name).quota)
    # rebuilt from its own request (the twins already in its profile), it plans the same
    rebuilt = build_problem(dataclasses.replace(problem.request))
    assert same_cost(solve_problem(rebuilt).predicted_cost_usd, brute.cost)


# The risk-aware planner (risk.py): on-demand workers are never revoked.
STORM_PER_H = 60.0  # revocations per spot instance-hour: no spot plan of the shipped profile survives it


def stormy_problem(shipped, **kw):
    return build_problem(PlanRequest(shipped, 0.8, 3000.0, solver="risk", target_probability=0.9,
                                     hazards_per_h={t: STORM_PER_H for t in shipped.type_names}, **kw))


def test_on_demand_workers_are_never_revoked_and_spot_ones_are_replaced_at_the_spot_price(shipped):
    problem = stormy_problem(shipped, on_demand_quota={"p3.2xlarge": 4})
    frontier = Frontier.of(problem, [fastest_plan(problem)[0].counts])
    names = problem.model.types.names
    on_demand_only = problem.model.counts_vector({"p3.2xlarge:on-demand": 4})
    calm = assess(problem, on_demand_only, frontier)
    assert calm.meet_probability == 1.0 and calm.expected_cost_usd == pytest.approx(calm.predicted_cost_usd, rel=1e-12)
    mixed = problem.model.counts_vector({"p3.2xlarge": 2, "p3.2xlarge:on-demand": 2})
    hazard_per_s = np.array([problem.request.hazards_per_h.get(n, 0.0) for n in names]) / 3600.0
    draws = _draws(problem, mixed, hazard_per_s, problem.budget_s, SAMPLES, SEED)
    arrived = np.isfinite(draws.times_s)
    assert arrived.any()
    # every revocation is a spot p3.2xlarge's, its replacement paid at the spot price, not the on-demand one
    paid_per_arrival = np.diff(np.vstack([np.zeros(draws.paid_usd_per_h.shape[1]), draws.paid_usd_per_h]), axis=0)
    np.testing.assert_allclose(paid_per_arrival[arrived], shipped.instance("p3.2xlarge").spot_price, rtol=1e-12)


def test_in_a_storm_the_risk_planner_meets_its_level_with_on_demand_workers(shipped):
    spot_only = solve_problem(stormy_problem(shipped))
    assert spot_only.meet_probability < 0.9 and "no candidate meets the deadline" in spot_only.message
    allowed = solve_problem(stormy_problem(shipped, on_demand_quota={t: 5 for t in shipped.type_names}))
    assert allowed.meet_probability >= 0.9 and not allowed.message
    assert split_counts(allowed.plan)["on-demand"]


def test_a_hazard_for_an_on_demand_worker_is_refused(shipped):
    kw = dict(solver="risk", on_demand_quota={"p3.2xlarge": 1})
    with pytest.raises(UserInputError, match=r"^hazard for p3.2xlarge:on-demand: on-demand workers are never revoked"):
        build_problem(PlanRequest(shipped, 0.8, 3000.0, hazards_per_h={"p3.2xlarge:on-demand": 1.0}, **kw))
    build_problem(PlanRequest(shipped, 0.8, 3000.0, hazards_per_h={"p3.2xlarge:on-demand": 0.0}, **kw))
