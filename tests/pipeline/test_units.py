"""The pipeline's plain logic, without Prefect."""
import pytest
from pydantic import ValidationError

from tasks.core.profile import load_profile
from tasks.pipeline.alternatives import plan_alternatives
from tasks.pipeline.params import TrainRequest
from tasks.pipeline.session import capped_quotas
from tasks.pipeline.setup import resolve_setup
from tasks.pipeline.watch import CostMeter, DriftDetector, DriftHold, loss_progress
from tasks.planner import PlanRequest
from tests.helpers import LOCAL_QUICK_PROFILE, SHIPPED_PROFILE, observation

GOOD = {"slo": {"target_loss": 1.2, "deadline_s": 60}, "candidates": {"types": ["p3.2xlarge"]}}


def test_request_defaults_and_validation():
    r = TrainRequest.model_validate(GOOD)
    assert r.provider.name == "local" and r.filling.enabled and r.candidates.quota("p3.2xlarge") == 4
    bad = [
        ({"slo": {"target_loss": 1.2, "deadline_s": 0}}, "deadline_s"),
        ({"slo": {"target_loss": -1, "deadline_s": 10}}, "target_loss"),
        ({"candidates": {"types": []}}, "types"),
        ({"candidates": {"types": ["a", "a"]}}, "candidate types repeat"),
        ({"candidates": {"types": ["a"], "quotas": {"b": 1}}}, "not a candidate"),
        ({"provider": {"name": "gcp"}}, "provider.name"),
        ({"profile": "/no/such/profile.json"}, "profile not found"),
        ({"surprise": 1}, "surprise"),
        ({"confidence": 1.0}, "confidence"),
        ({"candidates": {"types": ["a"], "min_workers": 0}}, "min_workers"),
        ({"candidates": {"types": ["a", "b"], "quotas": {"a": 1}, "min_workers": 6}},
         "min_workers 6 is more than the quotas allow (5 in all)"),
        ({"candidates": {"types": ["a"], "min_workers": 3}, "budget": {"max_instances": 2}},
         "candidates.min_workers 3 is more than budget.max_instances (2)"),
        ({"slo": {"target_loss": True, "deadline_s": 60}}, "target_loss"),
        ({"slo": {"target_loss": 1.2, "deadline_s": 1e308}}, "deadline_s"),
        ({"slo": {"target_loss": 1.2, "deadline_s": 2}}, "leaves no time to train after overhead_s (3 s)"),
        ({"candidates": {"types": ["a"], "quotas": {"a": 10**30}}}, "quotas must be 0..1000 (SPOTFILL_MAX_COUNT)"),
        ({"budget": {"max_instances": 10**30}}, "max_instances"),
        ({"candidates": {"types": ["a", "b"], "quotas": {"a": 0, "b": 0}}}, "every candidate type's quota is 0"),
        ({"candidates": {"types": ["a"], "quotas": {"a": True}}}, "quotas.a"),
        ({"budget": {"max_usd_per_h": True}}, "max_usd_per_h"),
        ({"budget": {"max_instances": True}}, "max_instances"),
        ({"overhead_s": 1e308}, "overhead_s"),
        ({"provider": {"revocations": {"inject_at_s": [-5]}}}, "inject_at_s"),
        ({"provider": {"revocations": {"trace": "nonexistent.csv"}}}, "provider.revocations.trace not found"),
        ({"provider": {"revocations": {"trace": "../../README.md"}}}, "is neither a file nor a trace name under profiles/traces/"),
        ({"profile": str(SHIPPED_PROFILE)}, "was measured for workload 'resnet110-cifar100', not 'transformer-lm'"),
        ({"provider": {"revocations": {"trace_type": "p3.2xlarge"}}}, "but no trace is given"),
        ({"provider": {"name": "aws", "revocations": {"inject_at_s": [5]}}}, "replayed on the local provider only"),
        ({"provider": {"revocations": {"inject_at_s": [60]}}}, "inject_at_s 60 s is not before slo.deadline_s (60 s)"),
        ({"provider": {"capacity": {"z9.huge": 3}}}, "provider.capacity given for a type that is not a candidate: z9.huge"),
        ({"provider": {"region": "mars-1"}}, "unknown region 'mars-1'"),
        ({"candidates": {"types": ["a"], "on_demand_quota": {"b": 1}}},
         "on_demand_quota given for a type that is not a candidate: b"),
        ({"candidates": {"types": ["a"], "on_demand_quota": {"a": -1}}}, "on_demand_quota must be 0..1000"),
        ({"candidates": {"types": ["a"], "spot_probe_s": 0}}, "spot_probe_s"),
        ({"provider": {"droughts_s": {"p3.2xlarge": 0}}}, "each drought must last more than 0 s"),
        ({"provider": {"droughts_s": {"z9.huge": 20}}}, "provider.droughts_s given for a type that is not a candidate"),
        ({"provider": {"name": "aws", "droughts_s": {"p3.2xlarge": 20}}}, "provider.droughts_s is emulated on the local"),
        ({"artifacts_dir": ""}, "empty output folder"),
        ({"artifacts_dir": "/dev/null"}, "/dev/null is not a folder"),
        ({"artifacts_dir": "/dev/null/runs"}, "/dev/null is not a folder"),
        ({"workload": "resnet110-cifar100", "profile": str(SHIPPED_PROFILE), "profiling": "full"},
         "profiling 'full' does nothing with a profile given"),
        ({"workload": "resnet110-cifar100", "profile": str(SHIPPED_PROFILE), "profile_budget_s": 60},
         "profile_budget_s does nothing with a profile given"),
    ]
    for patch, needle in bad:
        with pytest.raises(ValidationError) as err:
            TrainRequest.model_validate(GOOD | patch)
        assert needle in str(err.value)


@pytest.mark.parametrize("text, needle", [
    ("seconds,available\n0,2\n30,-1\n60,0\n", "g3.csv:3: negative available count -1"),
    ("# zone: eu-west-1a\n0,2\n60,0\n", "g3.csv:1: zone eu-west-1a is not in region us-east-1"),
])
def test_a_bad_capacity_trace_is_refused_naming_its_file_and_line(tmp_path, text, needle):
    path = tmp_path / "g3.csv"
    path.write_text(text)
    with pytest.raises(ValidationError) as err:
        TrainRequest.model_validate(GOOD | {"provider": {"capacity_traces": {"p3.2xlarge": str(path)}}})
    assert needle in str(err.value)


def test_alternatives_a_floor_rules_out_are_listed_as_infeasible():
    """A homogeneous alternative whose type cannot reach the request's min_workers is a row that
    says so, not an error that stops the run."""
    request = PlanRequest(load_profile(SHIPPED_PROFILE), 0.8, 3000, quota={"p3.2xlarge": 2}, min_workers=3)
    rows = {r["name"].split(" (")[0]: r for r in plan_alternatives(request)}
    assert rows["chosen"]["status"] == "optimal" and sum(rows["chosen"]["plan"].values()) >= 3
    assert rows["homogeneous fast"]["status"] == "infeasible"
    assert "min_workers 3 is more than the quotas allow (2 in all)" in rows["homogeneous fast"]["message"]


def test_capped_quotas_fit_the_instance_cap():
    assert capped_quotas({"a": 4, "b": 4, "c": 1}, 12) == {"a": 4, "b": 4, "c": 1}
    capped = capped_quotas({"a": 8, "b": 4, "c": 1}, 6)
    assert sum(capped.values()) == 6 and capped["c"] == 1


def test_loss_progress_and_cost_meter():
    assert loss_progress(None, 2.0, 1.0) == 0.0
    assert loss_progress(2.0, 1.5, 1.0) == pytest.approx(0.5)
    assert loss_progress(2.0, 0.5, 1.0) == 1.0
    meter = CostMeter()
    meter.advance(100.0, 3.6)
    assert meter.advance(110.0, 3.6) == pytest.approx(0.01)


def test_drift_needs_a_sustained_shortfall():
    d = DriftDetector(threshold=0.25, window_s=10)
    # On prediction (10 updates/s): never drift.
    assert all(d.observe(t, 10 * t, 10.0) is None for t in range(0, 30))
    d.reset()
    # At half speed: flagged once the shortfall has lasted the window, with the ratio.
    flags = [d.observe(t, 5 * t, 10.0) for t in range(0, 40)]
    first = next(i for i, f in enumerate(flags) if f is not None)
    assert 10 <= first <= 20 and flags[first] == pytest.approx(0.5)


def test_alternatives_include_the_baselines():
    profile = load_profile(SHIPPED_PROFILE)
    rows = plan_alternatives(PlanRequest(profile, 0.8, 2500))
    names = [r["name"] for r in rows]
    assert names[0] == "chosen (exact)" and "paper heuristic" in names and "all on-demand" in names
    assert any(n.startswith("homogeneous fast") for n in names) and any(n.startswith("homogeneous slow") for n in names)
    chosen = rows[0]["predicted_cost_usd"]
    assert all(r["predicted_cost_usd"] is None or r["predicted_cost_usd"] >= chosen * (1 - 1e-9) for r in rows)
    on_demand = next(r for r in rows if r["name"] == "all on-demand")
    assert on_demand["predicted_cost_usd"] > chosen


def test_refit_for_drift_slows_the_model_by_the_observed_ratio(tmp_path):
    from tasks.pipeline.session import TrainingSession

    profile = load_profile(SHIPPED_PROFILE)
    request = TrainRequest.model_validate(GOOD | {"candidates": {"types": profile.type_names}})
    session = TrainingSession(resolve_setup(request), profile, "run-x", tmp_path / "run-x")
    before = session.solve_or_fastest(session.plan_request(3000))
    session.refit_for_drift(0.5)
    assert [i.compute_time_s for i in session.profile.instances] == pytest.approx(
        [2 * i.compute_time_s for i in profile.instances])
    after = session.solve_or_fastest(session.plan_request(3000))
    assert after.predicted_cost_usd > before.predicted_cost_usd


def test_progress_drift_is_judged_on_the_loss_curve():
    from tasks.pipeline.watch import LossCurve, progress_ratio

    curve = LossCurve(a=10.0, gamma1=5.0, gamma5=1.0)
    assert curve.updates_to(float(curve.loss_at(20.0))) == pytest.approx(20.0)
    assert curve.updates_to(1.0) == float("inf")
    # 10 s at 0.5 s per update predicts 20 updates of progress; the loss shows 20, then 10.
    assert progress_ratio(curve, 0.5, 10.0, None, float(curve.loss_at(20.0))) == pytest.approx(1.0)
    assert progress_ratio(curve, 0.5, 10.0, None, float(curve.loss_at(10.0))) == pytest.approx(0.5)
    # after a re-plan, progress counts from the loss where the plan began
    assert progress_ratio(curve, 0.5, 10.0, float(curve.loss_at(30.0)), float(curve.loss_at(40.0))) == pytest.approx(0.5)
    assert progress_ratio(curve, 0.5, 0.0, None, 2.0) is None and progress_ratio(curve, 0.5, 5.0, None, None) is None
    # update rate on prediction, progress at half: drift, at the progress ratio
    d = DriftDetector(threshold=0.25, window_s=10)
    flags = [d.observe(t, 10 * t, 10.0, progress=0.5) for t in range(0, 40)]
    assert next(f for f in flags if f is not None) == pytest.approx(0.5)


def test_controller_decides_done_revocation_and_drift_once():
    from tasks.pipeline.controller import Action, decide
    from tasks.providers.base import ProviderEvent

    args = dict(target_loss=1.5, deadline_s=60.0, drift_action="inline", drift_ratio=None, drift=DriftHold(),
                asked=None, plan_empty=False)
    assert decide(observation(), **args) == []
    assert decide(observation(loss=1.4), **args) == [Action("done", "target")]
    assert decide(observation(t_s=61.0), **args) == [Action("done", "deadline")]
    assert decide(observation(stopped="max updates"), **args) == [Action("done", "stopped")]
    assert decide(observation(workers={}), **args | {"plan_empty": True}) == [Action("done", "no workers")]
    notice = ProviderEvent("revocation_notice", "i-1", 0.0, 2.0)
    assert decide(observation(events=[notice]), **args) == [Action("replan", "revocation", ("i-1",))]
    # the instance taken at the end of its notice was re-planned around already; one taken without one was not
    taken = ProviderEvent("revoked", "i-1", 2.0)
    assert decide(observation(events=[taken]), **args | {"known_leaving": frozenset({"i-1"})}) == []
    assert decide(observation(events=[taken]), **args) == [Action("replan", "revocation", ("i-1",))]
    # inline drift: refit then one re-plan (merged with a revocation's); a request from the automation is ignored
    assert decide(observation(events=[notice]), **args | {"drift_ratio": 0.5, "asked": {"plan": 0}}) == [
        Action("refit", "drift", speed_ratio=0.5), Action("replan", "revocation+drift", ("i-1",))]
    # automation: the run announces drift once for the plan, and acts only on a request naming
    # that plan, refitting to its newest observation
    auto = args | {"drift_action": "automation"}
    assert decide(observation(), **auto | {"drift_ratio": 0.5}) == [Action("announce-drift", "drift", speed_ratio=0.5)]
    held = DriftHold(plan=2, announced=True, newest_ratio=0.6)
    assert decide(observation(), **auto | {"drift_ratio": 0.4, "drift": held}) == []
    assert decide(observation(), **auto | {"drift": held, "asked": {"plan": 2}}) == [
        Action("refit", "requested", speed_ratio=0.6), Action("replan", "requested")]
    assert decide(observation(), **auto | {"drift": held, "asked": {"plan": 1}}) == []  # stale: plan 1 was re-planned
    assert decide(observation(), **auto | {"drift": held, "asked": {"reason": "drift"}}) == []  # names no plan


@pytest.mark.parametrize("ratio", [0.0, -1.54e21, 1.5, float("nan")])
def test_a_ratio_outside_0_1_is_never_refit_to(ratio, tmp_path):
    """The flood's payloads (0.0, -1.5e21) gave no speed to refit to: the re-plan acts alone."""
    from tasks.pipeline.controller import Action, decide
    from tasks.pipeline.session import TrainingSession

    args = dict(target_loss=1.5, deadline_s=60.0, asked=None, plan_empty=False)
    assert decide(observation(), **args, drift_action="inline", drift_ratio=ratio, drift=DriftHold()) == [
        Action("replan", "drift")]
    held = DriftHold(announced=True, newest_ratio=ratio)
    assert decide(observation(), **args | {"asked": {"plan": 0}}, drift_action="automation", drift_ratio=None,
                  drift=held) == [Action("replan", "requested")]
    profile = load_profile(SHIPPED_PROFILE)
    request = TrainRequest.model_validate(GOOD | {"candidates": {"types": profile.type_names}})
    session = TrainingSession(resolve_setup(request), profile, "run-x", tmp_path / "run-x")
    with pytest.raises(ValueError, match="speed ratio in \\(0, 1\\]"):
        session.refit_for_drift(ratio)
    assert session.profile == profile


def test_automation_drift_at_an_aggressive_threshold_replans_once_per_episode():
    """The flood case (threshold 0.05, window 3 s, a poll every 0.5 s) with an automation that
    answers every announcement late and twice over, plus a stray request for an old plan: one
    announcement and one re-plan per drift episode, each refit to a ratio in (0, 1]."""
    from tasks.pipeline.controller import decide

    predicted_per_s, poll_s = 10.0, 0.5
    speed = lambda t: 4.0 if t < 40 else 2.0  # noqa: E731 - slow from the start, slower again at 40 s
    detector, hold, replans = DriftDetector(threshold=0.05, window_s=3.0), DriftHold(), []
    announced, inbox, updates = [], [], 0.0
    for step in range(int(80 / poll_s)):
        t = step * poll_s
        updates += speed(t) * poll_s
        ratio = detector.observe(t, int(updates), predicted_per_s)
        hold.saw(ratio)
        due = next((item for item in inbox if item[0] <= t), None)  # the run takes one request a poll
        if due:
            inbox.remove(due)
        actions = decide(observation(t_s=t), target_loss=1.5, deadline_s=100.0, drift_action="automation",
                         drift_ratio=ratio, drift=hold, asked=due and due[1], plan_empty=False)
        for action in actions:
            if action.kind == "announce-drift":
                plan = hold.announce()
                announced.append((t, plan))
                # the automation: the request 3 s later, a duplicate, and one for the plan before
                inbox += [(t + 3.0, {"plan": plan}), (t + 3.5, {"plan": plan}), (t + 4.0, {"plan": plan - 1})]
            elif action.kind == "refit":
                assert 0 < action.speed_ratio <= 1
            elif action.kind == "replan":
                replans.append(t)
                detector.reset()
                hold = DriftHold(plan=len(replans))
                predicted_per_s = speed(t)  # the refit model predicts what is observed
    assert [plan for _, plan in announced] == [0, 1] and len(replans) == 2
    assert announced[0][0] < replans[0] < 40 <= announced[1][0] < replans[1] < 50


@pytest.mark.integration  # importing Prefect's schedules runs `file` (platform.architecture)
def test_served_deployments_are_prefect_yaml_and_its_defaults_are_the_demo():
    import yaml

    from flows.serve import PREFECT_YAML, deployments
    from tasks.cli.run import demo_request

    spec = yaml.safe_load(PREFECT_YAML.read_text())
    served = {d.name: d for d in deployments()}
    assert list(served) == [d["name"] for d in spec["deployments"]]
    for d in spec["deployments"]:
        assert served[d["name"]].parameters == (d.get("parameters") or {})
    for name in ("train-with-slo", "nightly-retrain", "profile-workload"):
        assert TrainRequest.model_validate(served[name].parameters["request"]) == demo_request()
    assert [s.schedule.cron for s in served["catalog-refresh"].schedules] == ["0 */6 * * *"]
    # the nightly retrain ships with its schedule off; every deployment is tagged and has job
    # variables in prefect.yaml (for a work pool), which a served deployment leaves out
    assert [(s.schedule.cron, s.active) for s in served["nightly-retrain"].schedules] == [("0 2 * * *", False)]
    assert served["nightly-retrain"].concurrency_limit == served["catalog-refresh"].concurrency_limit == 1
    assert served["train-with-slo"].concurrency_limit == 4
    assert all("spotfill" in d.tags and not d.job_variables for d in served.values())
    assert all(d.get("job_variables") for d in spec["deployments"])
    trigger = served["replan-on-drift"].triggers[0]
    assert trigger.match["spotfill.drift-action"] in ("automation", ["automation"]) and trigger.expect == {"spotfill.run.drift"}
    # de-duplicated per run and plan; runs for several training runs side by side (one run's
    # requests take turns in its folder: ask_for_replan)
    assert trigger.for_each == {"prefect.resource.id", "spotfill.plan"} and trigger.threshold == 1 and trigger.within.total_seconds() >= 30
    assert served["replan-on-drift"].concurrency_limit == 8


def test_a_late_replan_request_never_replaces_one_for_a_newer_plan(tmp_path):
    """Re-plan requests arrive in any order (queued flow runs start when they can): the newest
    plan's request is the one left waiting, whoever writes last."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from tasks.pipeline.stages import REPLAN_REQUEST, ask_for_replan

    assert ask_for_replan(tmp_path, 2)[1] == 2
    assert ask_for_replan(tmp_path, 1)[1] == 2  # late: plan 2's request stays
    assert json.loads((tmp_path / REPLAN_REQUEST).read_text()) == {"reason": "drift", "plan": 2}
    assert ask_for_replan(tmp_path, 3)[1] == 3
    (tmp_path / REPLAN_REQUEST).unlink()  # the run took it
    assert ask_for_replan(tmp_path, 1)[1] == 1  # nothing newer waits: the run will drop it as stale
    with ThreadPoolExecutor(8) as pool:  # writers racing in every order
        list(pool.map(lambda plan: ask_for_replan(tmp_path, plan), [5, 9, 4, 8, 6, 7, 2, 3] * 4))
    assert json.loads((tmp_path / REPLAN_REQUEST).read_text())["plan"] == 9


def test_plan_and_replan_can_be_asked_for_a_confidence(tmp_path):
    from tasks.pipeline.session import TrainingSession
    from tasks.planner import solve
    from tasks.core.profile import Uncertainty

    profile = load_profile(SHIPPED_PROFILE).model_copy(update={"uncertainty": Uncertainty(time_log_sd=0.05)})
    request = TrainRequest.model_validate(GOOD | {"candidates": {"types": profile.type_names}, "confidence": 0.9})
    session = TrainingSession(resolve_setup(request), profile, "run-x", tmp_path / "run-x")
    for plan_request in (session.plan_request(3000), session.plan_request(3000, {"p3.2xlarge": 1}, current_loss=1.5)):
        assert plan_request.confidence == 0.9
        result = solve(plan_request)
        assert result.confidence["level"] == 0.9 and result.confidence["upper_time_s"] <= 3000


def test_regions_are_refused_before_anything_starts():
    """Offers TYPE@REGION may name what no provider of the run can start: a clear refusal."""
    with pytest.raises(ValidationError, match="launches the profile's types in provider.region"):
        TrainRequest.model_validate(GOOD | {"regions": ["us-east-1", "us-west-2"]})


def test_the_trace_type_must_be_a_candidate():
    rev = {"provider": {"revocations": {"trace": "parcae_p3trace.csv", "trace_type": "g3.8xlarge"}}}
    with pytest.raises(ValidationError, match="trace_type 'g3.8xlarge' is not a candidate"):
        TrainRequest.model_validate(GOOD | rev)

@pytest.mark.parametrize("argv, quotas, floor, trace_type", [
    ([], {"p3.2xlarge": 2, "g3.8xlarge": 2}, 3, "p3.2xlarge"),  # the demo's market
    (["--quota", "p3.2xlarge=1"], {"p3.2xlarge": 1}, None, "p3.2xlarge"),  # your quotas, the fitted floor
    (["--quota", "p3.2xlarge=1", "--min-workers", "2"], {"p3.2xlarge": 1}, 2, "p3.2xlarge"),
    (["--types", "p3.2xlarge"], {}, None, None),  # not the demo's types: none of its market
    (["--trace-type", ""], {"p3.2xlarge": 2, "g3.8xlarge": 2}, 3, None),  # '' replays against every worker
    (["--trace", "other.csv"], {"p3.2xlarge": 2, "g3.8xlarge": 2}, 3, None),
])
def test_run_takes_the_demo_market_only_where_the_run_is_the_demo(argv, quotas, floor, trace_type):
    from tasks.cli.main import build_parser
    from tasks.cli.run import market_defaults

    args = build_parser().parse_args(["run", *argv])
    got = market_defaults(args, [t for t in args.types.split(",") if t])
    assert got == {"quotas": quotas, "min_workers": floor, "trace_type": trace_type}


@pytest.mark.parametrize("kappa, gamma4", [(None, None), (0.75, None), (0.3, 0.5), (None, 0.5)])
def test_the_watched_loss_curve_is_the_planners(tmp_path, kappa, gamma4):
    """The curve a run is watched against (drift, the report's predicted line) needs the updates
    the planner predicted, whatever the profile's n-shape."""
    from tasks.core.model import Model
    from tasks.pipeline.session import TrainingSession
    from tasks.core.profile import profile_from_dict

    data = load_profile(SHIPPED_PROFILE).model_dump()
    data["loss"] |= {"kappa": kappa, "gamma4": gamma4}
    profile = profile_from_dict(data)
    request = TrainRequest.model_validate({"slo": {"target_loss": 0.8, "deadline_s": 3000},
                                           "candidates": {"types": profile.type_names}})
    session = TrainingSession(resolve_setup(request), profile, "run", tmp_path)
    plan = {"p3.2xlarge": 2, "g3.8xlarge": 3}
    curve, texp_s = session.loss_curve(plan)
    model = Model.from_profile(profile)
    r = model.evaluate(model.counts_vector(plan), 0.8)
    assert curve.updates_to(0.8) == pytest.approx(float(r["iterations"][0]), rel=1e-12)
    assert texp_s == pytest.approx(float(r["iteration_time_s"][0]), rel=1e-12)


def test_the_verdict_says_why_training_stopped_early(tmp_path):
    from tasks.pipeline.report import verdict
    from tasks.pipeline.session import TrainingSession

    profile = load_profile(SHIPPED_PROFILE)
    request = TrainRequest.model_validate(GOOD | {"candidates": {"types": profile.type_names}})
    session = TrainingSession(resolve_setup(request), profile, "run-x", tmp_path / "run-x")
    result = {"met": False, "ended": "stopped", "stopped": "diverged", "final_loss": 2.5, "observed_time_s": 12.0,
              "spent_usd": 0.01, "ps_spent_usd": 0.001}
    harvested = {"offline_samples": 0, "online_requests": 0}
    said = verdict(session, result, harvested)
    assert said.startswith("SLO missed") and "training stopped early: the loss became NaN or infinite (diverged)" in said
    assert "stopped early" not in verdict(session, {**result, "ended": "deadline"}, harvested)
    assert "stopped early: stop_file" in verdict(session, {**result, "stopped": "stop_file"}, harvested)


@pytest.mark.parametrize("argv, fragment", [
    (["--loss", "1.0"], "is unreachable: the fitted loss curve never goes below gamma5"),
    (["--quota", "p3.2xlarge=0,g3.8xlarge=0"], "every candidate type's quota is 0"),
    (["--confidence", "0.9"], "gives no interval for confidence 0.9"),
])
def test_run_with_a_profile_makes_its_first_plan_before_starting_anything(argv, fragment, tmp_path, capsys):
    """What the flow's plan task would refuse is refused before a Prefect server or a process starts."""
    from tasks.cli.main import main

    status = main(["run", "--profile", str(LOCAL_QUICK_PROFILE), "--artifacts", str(tmp_path), *argv])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and fragment in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["abc", "1_0", "nan", "-5", "0"])
def test_a_bad_prefect_startup_timeout_is_named_before_anything_starts(value, tmp_path, capsys, monkeypatch):
    from tasks.cli.main import main

    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", value)
    assert main(["run", "--artifacts", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"spotfill: error: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS={value!r}: ")
    assert len(err.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


def test_one_field_of_the_request_is_overridden_alone_the_way_prefect_merges_parameters():
    """The server merges a run's parameters over the deployment's one top-level name at a time
    (dict.update): `--params '{"request": {"slo": {"deadline_s": 300}}}'` replaces `request`
    whole, so what it leaves out must take the model's defaults. The form's schema requires no
    field inside the request (the deployment gives `request` itself), and titles them as people
    read them."""
    from prefect.utilities.callables import parameter_schema

    from flows.train_with_slo import train_with_slo
    from tasks.cli.run import demo_request

    deployment = {"request": demo_request().model_dump(mode="json")}
    merged = dict(deployment)
    merged.update({"request": {"slo": {"deadline_s": 300}}})
    request = train_with_slo.validate_parameters(merged)["request"]
    assert request.slo.deadline_s == 300 and request.slo.target_loss == demo_request().slo.target_loss
    assert request.candidates.types == demo_request().candidates.types and request.workload == "transformer-lm"
    schema = parameter_schema(train_with_slo).model_dump_for_openapi()
    models = schema["definitions"]
    assert not any(m.get("required") for m in models.values())
    assert models["SLO"]["properties"]["deadline_s"]["title"] == "Deadline (s)"
    assert models["SLO"]["properties"]["deadline_s"]["default"] == 60.0
    seconds = {(name, field): p.get("title") for name, m in models.items()
               for field, p in m.get("properties", {}).items() if field.endswith("_s") and not field.endswith("_per_s")}
    assert len(seconds) >= 7 and all(title.endswith("(s)") for title in seconds.values()), seconds


def test_the_report_lists_each_worker_with_its_gpus_and_its_instances_inference(tmp_path):
    import json

    from tasks.filling.attach import SUMMED, WORST_HIGH, instance_metrics
    from tasks.pipeline.report import instance_inference, workers_markdown

    (tmp_path / "filling").mkdir()
    replicas = [{**dict.fromkeys(SUMMED, 0), **dict.fromkeys(WORST_HIGH), "error": None, "guard_budget": 1.0,
                 "inference_samples": n} for n in (300, 120)]
    (tmp_path / "filling" / "i-1.json").write_text(json.dumps(instance_metrics(replicas)))
    assert instance_inference(tmp_path, "i-1") == 420  # both GPUs' harvest
    assert instance_inference(tmp_path, "i-gone") is None and instance_inference(tmp_path, "") is None

    lines = workers_markdown({"trained_workers": [
        {"worker": 1, "instance_type": "g3.8xlarge", "gpus": 2, "updates": 40, "samples": 1280,
         "inference_samples": 420, "left": None},
        {"worker": 2, "instance_type": "p3.2xlarge", "gpus": 1, "updates": 9, "samples": 144,
         "inference_samples": None, "left": "notice"}]})
    assert "| 1 | g3.8xlarge | 2 | 40 | 1280 | 420 | - |" in lines
    assert "| 2 | p3.2xlarge | 1 | 9 | 144 | - | notice |" in lines
    assert workers_markdown({"trained_workers": []}) == []


def test_an_aws_run_with_a_checkpoint_bucket_gives_its_ps_a_durable_url(tmp_path):
    from tasks.pipeline.session import TrainingSession
    from tasks.runtime.driver import ps_startup

    profile = load_profile(SHIPPED_PROFILE)
    request = TrainRequest.model_validate(GOOD | {"candidates": {"types": profile.type_names},
                                                  "provider": {"name": "aws", "aws": {"checkpoint_bucket": "ckpts"}}})
    assert TrainingSession(resolve_setup(request), profile, "run-x", tmp_path).durable_url == "s3://ckpts/run-x"
    local = TrainRequest.model_validate(GOOD | {"candidates": {"types": profile.type_names}})
    assert TrainingSession(resolve_setup(local), profile, "run-x", tmp_path).durable_url is None
    argv = ps_startup(tmp_path, 5000, "resnet20", {}, durable_url="s3://ckpts/run-x", leased=True).argv
    assert argv[argv.index("--durable-url") + 1] == "s3://ckpts/run-x"
    assert argv[argv.index("--lease") + 1] == "s3://ckpts/run-x/lease.json"  # where the PS, on AWS, reads it
    argv = ps_startup(tmp_path, 5000, "resnet20", {}, leased=True).argv
    assert argv[argv.index("--lease") + 1] == str(tmp_path / "lease.json")
