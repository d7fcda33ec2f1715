import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tasks.core.errors import InfeasibleError, UserInputError
from tasks.core.profile import (BATCH_N_EXPONENT_BOUNDS, BATCH_NOISE_MAX, BATCH_STALENESS_MAX, OVERLAP_MAX, load_profile,
                                profile_from_dict)
from tasks.planner import PlanRequest, fastest_time_s, solve, solve_problem
from tasks.planner import exact
from tasks.planner.bounds import size_bounds
from tasks.planner.brute import solve_brute_force
from tasks.planner.exact import composition_count
from tasks.planner.heuristic import solve_heuristic
from tasks.planner.problem import COST_TIE_REL, build_problem
from tests.helpers import SHIPPED_PROFILE, fastest, profiles, same_cost

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(profiles(), st.floats(0.6, 1.5), st.floats(1.0, 4.0))
def test_exact_equals_brute_force_and_beats_heuristic(profile, loss, slack):
    deadline = fastest(profile, loss) * slack
    problem = build_problem(PlanRequest(profile, loss, deadline))
    result = solve_problem(problem)
    brute = solve_brute_force(problem)[0]
    assert result.feasible and brute.counts is not None
    assert same_cost(result.predicted_cost_usd, brute.cost)
    searched, _ = exact.search(problem, "cost", enumerate_below=0)  # branch and bound, not enumeration
    assert same_cost(searched.cost, brute.cost)
    heuristic, _ = solve_heuristic(problem)
    if heuristic.counts is not None:
        assert result.predicted_cost_usd <= heuristic.cost * (1 + COST_TIE_REL)
    assert result.predicted_time_s <= deadline * (1 + 1e-9)


@pytest.mark.parametrize("by", ["workers", "load"])
@pytest.mark.parametrize("kappa", [0.25, 0.5, 0.75, 1.0])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_exact_equals_brute_force_for_every_model_form(kappa, by, data):
    """The pruning bounds stay valid for every allowed n-shape and both contention forms
    (bounds.py), from scratch and when re-planning with survivors and a current loss."""
    profile = data.draw(profiles(kappa=st.just(kappa), by=st.just(by)))
    loss = data.draw(st.floats(0.6, 1.5))
    existing = {i.type: data.draw(st.integers(0, i.quota)) for i in profile.instances}
    current = data.draw(st.one_of(st.none(), st.floats(loss + 0.05, loss + 1.0)))
    deadline = fastest(profile, loss, existing=existing, current_loss=current) * data.draw(st.floats(1.0, 3.0))
    problem = build_problem(PlanRequest(profile, loss, deadline, existing=existing, current_loss=current))
    result = solve_problem(problem)
    brute = solve_brute_force(problem)[0]
    assert result.feasible and brute.counts is not None
    assert same_cost(result.predicted_cost_usd, brute.cost)
    searched, _ = exact.search(problem, "cost", enumerate_below=0)  # branch and bound, not enumeration
    assert same_cost(searched.cost, brute.cost)
    every = np.array(list(itertools.product(*(range(lo, hi + 1) for lo, hi in zip(problem.lower, problem.upper)))))
    quickest = float(np.nanmin(problem.evaluate(every)["time_s"]))
    assert fastest_time_s(problem) == pytest.approx(quickest, rel=1e-9)
    assert exact.search(problem, "time", deadline_s=np.inf, enumerate_below=0)[0].time_s == pytest.approx(quickest, rel=1e-9)


@pytest.mark.parametrize("by", ["workers", "load"])
@pytest.mark.parametrize("terms", [
    {"overlap": OVERLAP_MAX, "overlap_width": 1.0},  # the most overlap, between any two periods
    {"overlap": OVERLAP_MAX, "overlap_width": 0.05},  # ...only between near-equal periods
    {"batch_n_exponent": BATCH_N_EXPONENT_BOUNDS[0]},
    {"batch_n_exponent": BATCH_N_EXPONENT_BOUNDS[1]},
    {"overlap": OVERLAP_MAX, "overlap_width": 1.0, "batch_n_exponent": BATCH_N_EXPONENT_BOUNDS[0]},
    {"link_cap": True},
    {"link_cap": True, "overlap": OVERLAP_MAX, "overlap_width": 1.0, "batch_n_exponent": BATCH_N_EXPONENT_BOUNDS[1]},
    {"batch_staleness": 0.08},  # the batch slope changes sign between the sizes the quotas allow
    {"batch_staleness": BATCH_STALENESS_MAX},
    {"batch_staleness": 0.08, "batch_n_exponent": BATCH_N_EXPONENT_BOUNDS[0], "link_cap": True},
    {"batch_noise": BATCH_NOISE_MAX},  # j convex in the batch, falling over every batch
    {"batch_noise": 2e5, "batch_staleness": 0.08},  # ...turning inside the types' batch range at some sizes
    {"batch_noise": 2e5, "batch_staleness": 0.08, "overlap": OVERLAP_MAX, "overlap_width": 1.0, "link_cap": True},
])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_exact_equals_brute_force_with_the_further_terms_at_their_extremes(terms, by, data):
    """The overlap and the link cap only slow (rates without them are ceilings), the batch
    n-exponent and staleness cost keep j affine in the WA batch at each size, with a slope whose sign
    may change from size to size, and the gradient noise makes it convex, bounded below by its
    minimum over a batch interval and by a tangent (bounds.py), so branch and bound still finds
    brute force's optimum and the fastest plan, from scratch and re-planning with survivors."""
    narrow = st.floats(5, 100)  # the link cap binds only where the PS link is full
    profile = data.draw(profiles(by=st.just(by), further=st.just(terms),
                                 **({"ps_bandwidth": narrow} if terms.get("link_cap") else {})))
    loss = data.draw(st.floats(0.6, 1.5))
    existing = {i.type: data.draw(st.integers(0, i.quota)) for i in profile.instances}
    current = data.draw(st.one_of(st.none(), st.floats(loss + 0.05, loss + 1.0)))
    deadline = fastest(profile, loss, existing=existing, current_loss=current) * data.draw(st.floats(1.0, 3.0))
    problem = build_problem(PlanRequest(profile, loss, deadline, existing=existing, current_loss=current))
    brute = solve_brute_force(problem)[0]
    searched, _ = exact.search(problem, "cost", enumerate_below=0)
    assert brute.counts is not None and same_cost(searched.cost, brute.cost)
    every = np.array(list(itertools.product(*(range(lo, hi + 1) for lo, hi in zip(problem.lower, problem.upper)))))
    r = problem.evaluate(every)
    quickest = float(np.nanmin(r["time_s"]))
    assert exact.search(problem, "time", deadline_s=np.inf, enumerate_below=0)[0].time_s == pytest.approx(quickest, rel=1e-9)
    # every size's bounds hold for every cluster of that size (not only where they decided a prune)
    sizes = every.sum(axis=1)
    j_lo, x_max, ratio_min = size_bounds(problem, sizes)
    rate = 1.0 / r["iteration_time_s"]
    tol = 1 + 1e-9
    assert np.all(j_lo <= r["iterations"] * tol)
    assert np.all(rate <= x_max * tol)
    some = sizes > 0
    assert np.all(ratio_min[some] <= r["usd_per_h"][some] / rate[some] * tol)


@SETTINGS
@given(profiles(), st.floats(0.6, 1.5), st.floats(1.0, 3.0), st.floats(1.0, 2.0))
def test_cost_never_rises_with_a_later_deadline(profile, loss, slack, later):
    deadline = fastest(profile, loss) * slack
    early = solve(PlanRequest(profile, loss, deadline))
    late = solve(PlanRequest(profile, loss, deadline * later))
    assert late.predicted_cost_usd <= early.predicted_cost_usd * (1 + COST_TIE_REL)


@SETTINGS
@given(profiles(), st.floats(0.6, 1.5), st.floats(0.01, 0.3), st.floats(1.0, 3.0))
def test_cost_never_falls_with_a_lower_loss_target(profile, loss, lower_by, slack):
    hard_loss = max(0.5 + 1e-3, loss - lower_by)
    fastest(profile, loss)  # the easy target, too, needs training (one the curve starts below is refused)
    deadline = fastest(profile, hard_loss) * slack  # feasible for both targets
    easy = solve(PlanRequest(profile, loss, deadline))
    hard = solve(PlanRequest(profile, hard_loss, deadline))
    assert hard.predicted_cost_usd >= easy.predicted_cost_usd * (1 - COST_TIE_REL)


@SETTINGS
@given(profiles(max_quota=5), st.floats(0.6, 1.5), st.floats(1.0, 3.0), st.data())
def test_plan_respects_quotas_and_keeps_existing(profile, loss, slack, data):
    existing, quota = {}, {}
    for inst in profile.instances:
        q = data.draw(st.integers(0, 5))
        quota[inst.type] = q
        existing[inst.type] = data.draw(st.integers(0, min(q, 2)))
    if sum(quota.values()) == 0:
        quota[profile.instances[0].type] = 1
    deadline = fastest(profile, loss, existing=existing, quota=quota) * slack
    for solver in ("exact", "heuristic"):
        try:
            r = solve(PlanRequest(profile, loss, deadline, existing=existing, quota=quota, solver=solver))
        except InfeasibleError:
            assert solver == "heuristic"  # the exact solver always finds a plan when one exists
            continue
        for name in quota:
            assert existing[name] <= r.plan.get(name, 0) <= quota[name]


@SETTINGS
@given(profiles(), st.floats(0.6, 1.5), st.floats(1.0, 3.0), st.randoms(use_true_random=False))
def test_reordering_types_changes_nothing(profile, loss, slack, rnd):
    deadline = fastest(profile, loss) * slack
    data = profile.model_dump()
    rnd.shuffle(data["instances"])
    shuffled = profile_from_dict(data)
    for solver in ("exact", "heuristic"):
        try:
            a = solve(PlanRequest(profile, loss, deadline, solver=solver))
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve(PlanRequest(shuffled, loss, deadline, solver=solver))
            continue
        b = solve(PlanRequest(shuffled, loss, deadline, solver=solver))
        assert a.plan == b.plan
        assert a.predicted_cost_usd == pytest.approx(b.predicted_cost_usd, rel=1e-12)


@st.composite
def profiles_with_twins(draw):
    """Profiles where some types are twins: the same hardware at other prices (like one type's
    offers in several regions), some at exactly the same price, some with existing instances."""
    profile = draw(profiles(max_types=3, max_quota=3))
    data = profile.model_dump()
    for inst in list(data["instances"]):
        for copy in range(draw(st.integers(0, 2))):
            price = draw(st.sampled_from([inst["spot_price"], inst["spot_price"] * 0.7, inst["spot_price"] * 1.3]))
            data["instances"].append(inst | {"type": f"{inst['type']}-r{copy}", "spot_price": price,
                                             "quota": draw(st.integers(0, 3))})
    return profile_from_dict(data)


@SETTINGS
@given(profiles_with_twins(), st.floats(0.6, 1.5), st.floats(1.0, 3.0), st.data())
def test_exact_equals_brute_force_with_twin_offers(profile, loss, slack, data):
    existing = {i.type: data.draw(st.integers(0, min(i.quota, 1))) for i in profile.instances}
    deadline = fastest(profile, loss, existing=existing) * slack
    problem = build_problem(PlanRequest(profile, loss, deadline, existing=existing))
    assume(composition_count(problem) <= 200_000)
    brute = solve_brute_force(problem)[0]
    searched, _ = exact.search(problem, "cost", enumerate_below=0)  # branch and bound, not enumeration
    assert same_cost(searched.cost, brute.cost)
    assert list(searched.counts) == list(brute.counts)


@SETTINGS
@given(profiles(), st.floats(0.6, 1.5))
def test_fastest_plan_equals_brute_force(profile, loss):
    problem = build_problem(PlanRequest(profile, loss, 1e12))
    best = exact.search(problem, "time", deadline_s=np.inf, enumerate_below=0)[0].time_s
    lower, radix = problem.lower, problem.upper - problem.lower + 1
    grid = np.stack(np.meshgrid(*[np.arange(r) for r in radix], indexing="ij"), axis=-1).reshape(-1, len(radix))
    times = problem.evaluate(grid + lower)["time_s"]
    assert best == pytest.approx(times.min(), rel=1e-9) or (math.isinf(best) and math.isinf(times.min()))


def test_exact_matches_brute_force_on_the_shipped_profile_with_existing_and_current_loss():
    profile = load_profile(SHIPPED_PROFILE)
    for existing, current, overhead, deadline in [({}, None, 0, 2000), ({"g3.8xlarge": 2}, 1.4, 30, 2500),
                                                   ({"p2.8xlarge": 1}, None, 60, 4000)]:
        problem = build_problem(PlanRequest(profile, 0.8, deadline, existing=existing, overhead_s=overhead,
                                            current_loss=current))
        r = solve_problem(problem)
        brute = solve_brute_force(problem)[0]
        assert same_cost(r.predicted_cost_usd, brute.cost)
        assert r.status == "optimal"
        assert same_cost(exact.search(problem, "cost", enumerate_below=0)[0].cost, brute.cost)


def test_replanning_remaining_work_is_less_than_from_scratch():
    profile = load_profile(SHIPPED_PROFILE)
    fresh = solve(PlanRequest(profile, 0.8, 2500, existing={"g3.8xlarge": 2}))
    midway = solve(PlanRequest(profile, 0.8, 2500, existing={"g3.8xlarge": 2}, current_loss=1.0))
    assert midway.predicted_cost_usd < fresh.predicted_cost_usd
    assert midway.plan.get("g3.8xlarge", 0) >= 2


def test_overhead_and_margin_tighten_the_plan():
    profile = load_profile(SHIPPED_PROFILE)
    base = solve(PlanRequest(profile, 0.8, 2100))
    assert solve(PlanRequest(profile, 0.8, 2100, overhead_s=120)).predicted_time_s <= 1980
    assert solve(PlanRequest(profile, 0.8, 2100, bandwidth_margin=0.05)).predicted_cost_usd >= base.predicted_cost_usd


def test_infeasible_deadline_reports_the_fastest_time():
    profile = load_profile(SHIPPED_PROFILE)
    best = fastest_time_s(build_problem(PlanRequest(profile, 0.8, 1e12)))
    with pytest.raises(InfeasibleError) as err:
        solve(PlanRequest(profile, 0.8, best * 0.9))
    assert err.value.fastest_time_s == pytest.approx(best)
    assert f"{best:.1f} s" in str(err.value)
    assert solve(PlanRequest(profile, 0.8, best * 1.0001)).predicted_time_s <= best * 1.0001


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"deadline_s": 0}, "deadline must be a positive"),
        ({"deadline_s": -10}, "deadline must be a positive"),
        ({"loss_target": 0.5}, "unreachable"),
        ({"loss_target": 0.3}, "unreachable"),
        ({"existing": {"nope.large": 1}}, "unknown instance type 'nope.large'"),
        ({"quota": {"p3.2xlarge": 1}, "existing": {"p3.2xlarge": 2}}, "below its existing count"),
        ({"current_loss": 0.7}, "already meets the target"),
        ({"overhead_s": 5000}, "leaves no time"),
        ({"bandwidth_margin": 1.0}, "bandwidth margin"),
        ({"quota": {t: 0 for t in ["p3.2xlarge", "g4dn.4xlarge", "g3.8xlarge", "g3.16xlarge", "p2.8xlarge"]}},
         "every quota is 0"),
        ({"min_workers": 0}, "min_workers must be a positive whole number"),
        ({"min_workers": 2.5}, "min_workers must be a positive whole number"),
        ({"min_workers": 40}, r"min_workers 40 is more than the quotas allow \(25 in all\)"),
    ],
)
def test_bad_requests(kwargs, message):
    args = {"profile": load_profile(SHIPPED_PROFILE), "loss_target": 0.8, "deadline_s": 3000} | kwargs
    with pytest.raises(UserInputError, match=message):
        solve(PlanRequest(**args))


def test_result_json_has_the_contract_keys():
    r = solve(PlanRequest(load_profile(SHIPPED_PROFILE), 0.8, 3000))
    assert set(r.to_json()) == {"plan", "predicted_time_s", "predicted_cost_usd", "iterations", "wa_batch",
                                "cc", "solver", "solve_seconds"}
    assert all(isinstance(v, int) and v > 0 for v in r.plan.values())
    assert math.isfinite(r.predicted_cost_usd) and np.isfinite(r.iterations)


def test_scored_compositions_rescale_to_a_fresh_scoring():
    """A re-plan with the same survivors reuses the first one's scores, scaled by the remaining
    progress: they must equal the model's own scores at the new loss."""
    profile = load_profile(SHIPPED_PROFILE)
    existing = {"p3.2xlarge": 1, "g3.8xlarge": 2}
    first = build_problem(PlanRequest(profile, 0.8, 2000.0, existing=existing, current_loss=1.3))
    exact.scored_compositions(first)
    later = build_problem(PlanRequest(profile, 0.8, 900.0, existing=existing, current_loss=0.95))
    counts, scored = exact.scored_compositions(later)
    fresh = later.evaluate(counts)
    assert len(counts) == composition_count(later)
    for name in ("time_s", "cost_usd", "iterations", "workers", "usd_per_h"):
        np.testing.assert_allclose(scored[name], fresh[name], rtol=1e-12)


@SETTINGS
@given(profiles(by=st.sampled_from([None, "workers"]), further=st.sampled_from(
           [{}, {"batch_noise": 2e5, "batch_staleness": 0.08}, {"batch_noise": BATCH_NOISE_MAX}])),
       st.floats(0.6, 1.5), st.floats(1.0, 3.0), st.data())
def test_one_class_completion_bounds_hold_for_every_cluster_of_their_size(profile, loss, slack, data):
    """bounds.VertexBound at the root: no cluster of a size is quicker than its time bound, and
    none meeting the deadline is cheaper than its cost bound (the bound weighs iterations and
    price together, so it must hold cluster by cluster, not just for the optimum), also where the
    gradient noise makes j convex in the batch and the bound takes its tangent."""
    existing = {i.type: data.draw(st.integers(0, min(i.quota, 1))) for i in profile.instances}
    current = data.draw(st.one_of(st.none(), st.floats(loss + 0.05, loss + 1.0)))
    deadline = fastest(profile, loss, existing=existing, current_loss=current) * slack
    problem = build_problem(PlanRequest(profile, loss, deadline, existing=existing, current_loss=current))
    every = np.array(list(itertools.product(*(range(lo, hi + 1) for lo, hi in zip(problem.lower, problem.upper)))))
    every = every[every.sum(axis=1) > 0]
    r = problem.evaluate(every)
    sizes = np.unique(every.sum(axis=1))
    bnb = exact.BranchAndBound(problem, "cost", problem.budget_s, exact.Incumbent())
    zero = np.zeros(len(sizes))
    time_lb, cost_lb = bnb.vertex_bound(sizes).bounds(0, sizes, zero, zero, zero, problem.budget_s)
    for n, t_lb, c_lb in zip(sizes, time_lb, cost_lb):
        mine = every.sum(axis=1) == n
        assert t_lb <= r["time_s"][mine].min() * (1 + 1e-9)
        on_time = mine & (r["time_s"] <= problem.budget_s)
        if on_time.any():
            assert c_lb <= r["cost_usd"][on_time].min() * (1 + 1e-9)


@SETTINGS
@given(profiles(max_quota=6), st.floats(0.6, 1.5), st.floats(1.0, 3.0), st.floats(1.0, 3.0), st.data())
def test_heuristic_answers_the_same_from_remembered_windows(profile, loss, slack, other, data):
    """The heuristic's windows are scored once per set of survivors (exact.scored_rows); a
    re-plan at another deadline and loss finds what a fresh solve finds."""
    existing = {i.type: data.draw(st.integers(0, min(i.quota, 1))) for i in profile.instances}
    current = data.draw(st.floats(loss + 0.05, loss + 1.0))
    deadline = fastest(profile, loss, existing=existing, current_loss=current) * slack
    first = build_problem(PlanRequest(profile, loss, deadline * other, existing=existing, current_loss=current + 0.3))
    later = build_problem(PlanRequest(profile, loss, deadline, existing=existing, current_loss=current))
    exact.forget_scored()
    fresh, fresh_scored = solve_heuristic(later)
    exact.forget_scored()
    solve_heuristic(first)
    again, again_scored = solve_heuristic(later)
    assert again_scored == fresh_scored
    assert (fresh.counts is None and again.counts is None) or list(fresh.counts) == list(again.counts)


@SETTINGS
@given(profiles(max_quota=5), st.floats(0.6, 1.5), st.floats(1.0, 3.0), st.data())
def test_exact_equals_brute_force_with_a_workers_floor(profile, loss, slack, data):
    """A floor on the cluster size (PlanRequest.min_workers) keeps the search exact: every solver
    path (enumeration, branch and bound, fastest plan, heuristic) against a plain enumeration of
    the clusters of at least that size, from scratch and when re-planning around survivors."""
    most = sum(i.quota for i in profile.instances)
    floor = data.draw(st.integers(1, most))
    existing = {i.type: data.draw(st.integers(0, i.quota)) for i in profile.instances}
    current = data.draw(st.one_of(st.none(), st.floats(loss + 0.05, loss + 1.0)))
    kw = dict(existing=existing, current_loss=current, min_workers=floor)
    deadline = fastest(profile, loss, **kw) * slack
    problem = build_problem(PlanRequest(profile, loss, deadline, **kw))
    every = np.array(list(itertools.product(*(range(lo, hi + 1) for lo, hi in zip(problem.lower, problem.upper)))))
    every = every[every.sum(axis=1) >= floor]
    r = problem.evaluate(every)
    assert fastest_time_s(problem) == pytest.approx(float(np.nanmin(r["time_s"])), rel=1e-9)
    cheapest = float(r["cost_usd"][r["time_s"] <= deadline * (1 + COST_TIE_REL)].min())
    result = solve_problem(problem)
    assert result.feasible and sum(result.plan.values()) >= floor and same_cost(result.predicted_cost_usd, cheapest)
    searched, _ = exact.search(problem, "cost", enumerate_below=0)  # branch and bound, not enumeration
    assert searched.counts.sum() >= floor and same_cost(searched.cost, cheapest)
    quickest, _ = exact.search(problem, "time", deadline_s=np.inf, enumerate_below=0)
    assert quickest.counts.sum() >= floor
    heuristic, _ = solve_heuristic(problem)
    assert heuristic.counts is None or heuristic.counts.sum() >= floor


def fitted_on(profile, smallest, largest):
    """The profile as a fit would write it: the loss curve's cluster sizes in its fit report."""
    return profile_from_dict({**profile.model_dump(), "fit_quality": {"loss-curve": {"workers": [smallest, largest]}}})


def test_the_floor_defaults_to_the_smallest_fitted_cluster():
    """A fitted profile never gets a plan smaller than the clusters its loss curve was measured on
    (below them the n-shape is extrapolated); the shipped profile, with no fit report, plans as
    the paper's model does."""
    shipped = load_profile(SHIPPED_PROFILE)
    assert shipped.fitted_workers is None
    quota = {"p3.2xlarge": 2, "g4dn.4xlarge": 2, "g3.8xlarge": 2, "g3.16xlarge": 2, "p2.8xlarge": 2}
    plain = solve(PlanRequest(shipped, 0.8, 1e6, quota=quota))
    assert sum(plain.plan.values()) == 1 and "min_workers" not in plain.to_json()
    fitted = fitted_on(shipped, 3, 7)
    floored = solve(PlanRequest(fitted, 0.8, 1e6, quota=quota))
    assert sum(floored.plan.values()) == 3 and floored.to_json()["min_workers"] == 3
    assert floored.predicted_cost_usd > plain.predicted_cost_usd
    # an explicit floor wins over the fitted one, either way
    assert sum(solve(PlanRequest(fitted, 0.8, 1e6, quota=quota, min_workers=1)).plan.values()) == 1
    assert sum(solve(PlanRequest(fitted, 0.8, 1e6, quota=quota, min_workers=5)).plan.values()) == 5
    # a re-plan whose quotas fell below the fitted floor runs what it can
    short = solve(PlanRequest(fitted, 0.8, 1e6, quota={t: 0 for t in quota} | {"p3.2xlarge": 2}))
    assert short.plan == {"p3.2xlarge": 2}


def test_an_infeasible_floor_says_so():
    profile = load_profile(SHIPPED_PROFILE)
    quick = fastest_time_s(build_problem(PlanRequest(profile, 0.8, 1e12, min_workers=9)))
    with pytest.raises(InfeasibleError, match="the fastest plan within the quotas of at least 9 workers"):
        solve(PlanRequest(profile, 0.8, quick * 0.99, min_workers=9))


@pytest.mark.parametrize("span", [[0, 4], [3, 2], [2], "2-7", [2.0, 7]])
def test_a_malformed_fitted_range_is_refused_at_load(span):
    data = load_profile(SHIPPED_PROFILE).model_dump() | {"fit_quality": {"loss-curve": {"workers": span}}}
    with pytest.raises(UserInputError, match=r"^p: fit_quality.loss-curve.workers must be"):
        profile_from_dict(data, source="p")


@pytest.mark.parametrize("quality", [[1], "x", {"loss-curve": 5}, {"loss-curve": [2, 7]}])
def test_a_fit_report_of_the_wrong_shape_is_refused_at_load(quality):
    data = load_profile(SHIPPED_PROFILE).model_dump() | {"fit_quality": quality}
    with pytest.raises(UserInputError, match=r"^p: fit_quality must be an object whose loss-curve is an object"):
        profile_from_dict(data, source="p")
