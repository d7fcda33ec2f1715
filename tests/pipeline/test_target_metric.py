"""A run that targets a metric of the workload's evaluate(model) (`--target-metric`): the request,
the checks before launch, the plan and the verdict work on that metric's curve (docs/model.md)."""
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.core.profile import load_profile
from tasks.pipeline.params import SLO, TrainRequest, profiled_curve
from tasks.pipeline.setup import resolve_setup
from tests.helpers import LOCAL_QUICK_PROFILE, SHIPPED_PROFILE, observation

EVALUATED = "tests.plugins.evaluated:build"


def test_the_slo_targets_the_loss_or_a_metric_on_the_curves_scale():
    loss = SLO(target_loss=1.2)
    assert loss.metric is None and loss.curve_target == 1.2 and profiled_curve(loss) == {}
    assert loss.state_text(0.5) == "loss 0.5000 (target 1.2)" and loss.state_text(None) == "loss n/a (target 1.2)"
    acc = SLO(target_metric=" val_acc >= 0.9 ")
    assert acc.target_metric == "val_acc>=0.9" and acc.curve_target == pytest.approx(0.1)
    assert acc.as_reported(0.08) == pytest.approx(0.92) and profiled_curve(acc) == {"curve": "val_acc"}
    assert acc.state_text(0.08) == "val_acc 0.9200 (target val_acc>=0.9)"
    assert SLO(target_metric="val_loss<=0.3").curve_target == 0.3


@pytest.mark.parametrize("text, message", [
    ("val_acc>0.9", "the direction must be <= or >=, not >"),
    ("val_acc>=90", "between 0 and 1"),
    ("accuracy", "must be NAME<=X or NAME>=X"),
])
def test_a_bad_target_metric_is_a_validation_error(text, message):
    with pytest.raises(ValidationError, match=message):
        SLO(target_metric=text)


def _session(tmp_path, slo: dict):
    from tasks.pipeline.session import TrainingSession

    profile = load_profile(SHIPPED_PROFILE)
    request = TrainRequest.model_validate({"slo": {"deadline_s": 3000, **slo}, "candidates": {"types": profile.type_names}})
    return TrainingSession(resolve_setup(request), profile, "run-m", tmp_path / "run-m")


def test_plan_target_and_verdict_follow_the_metric(tmp_path):
    """The planner plans on the metric's target on the curve's scale; the run is met when the
    metric is; the verdict and summary speak of the metric."""
    from tasks.pipeline.report import metric_outcome, verdict

    session = _session(tmp_path, {"target_metric": "val_acc>=0.9"})
    assert session.plan_request(100.0).loss_target == pytest.approx(0.1)
    assert session.reached_target(observation(loss=0.08)) and not session.reached_target(observation(loss=0.12))
    result = {"met": True, "ended": "target", "final_loss": 0.08, "observed_time_s": 12.0,
              "spent_usd": 0.01, "ps_spent_usd": 0.001}
    said = verdict(session, result, {"offline_samples": 0, "online_requests": 0})
    assert said.startswith("SLO met: val_acc 0.9200 (target val_acc>=0.9) after 12.0 s")
    assert metric_outcome(session.request.slo, result) == {"target_metric": "val_acc>=0.9",
                                                            "final_metric": pytest.approx(0.92)}
    loss_session = _session(tmp_path, {"target_loss": 0.8})
    assert loss_session.plan_request(100.0).loss_target == 0.8 and metric_outcome(loss_session.request.slo, result) == {}


def test_the_timeline_plots_the_metric_as_it_reads(tmp_path, monkeypatch):
    """Observed and predicted lines and the target line are drawn in the metric's own terms."""
    import matplotlib.pyplot as plt

    from tasks.pipeline.report import plot_timeline

    session = _session(tmp_path, {"target_metric": "val_acc>=0.9"})
    session.observations = [observation(t_s=1.0, loss=0.5), observation(t_s=2.0, loss=0.25)]
    drawn = {}
    monkeypatch.setattr(plt, "close", lambda fig: drawn.setdefault("axes", fig.axes))
    plot_timeline(session, tmp_path / "timeline.png")
    ax = drawn["axes"][0]
    observed = next(line for line in ax.lines if line.get_label() == "observed (evaluations)")
    assert list(observed.get_ydata()) == pytest.approx([0.5, 0.75])
    target = next(line for line in ax.lines if line.get_label() == "target val_acc>=0.9")
    assert list(target.get_ydata()) == pytest.approx([0.9, 0.9]) and ax.get_ylabel() == "val_acc (held out)"
    assert (tmp_path / "timeline.png").stat().st_size > 0


@pytest.mark.parametrize("argv, fragment", [
    (["--target-metric", "val_acc>0.9"], "the direction must be <= or >=, not >"),
    (["--workload", "tests.plugins.regression:build", "--target-metric", "val_acc>=0.9"], "needs an evaluate(model)"),
    (["--workload", EVALUATED, "--target-metric", "val_f1>=0.5"], "target metric 'val_f1' is not reported"),
    (["--workload", "tests.plugins.broken:evaluate_nan", "--target-metric", "val_acc>=0.9"], "returned val_loss = nan"),
    (["--workload", "tests.plugins.broken:evaluate_raises", "--target-metric", "val_acc>=0.9"], "evaluate(model) failed"),
    (["--profile", str(LOCAL_QUICK_PROFILE), "--target-metric", "val_acc>=0.9"],
     "was fitted on the training loss, the run targets val_acc"),
])
def test_spotfill_run_refuses_a_bad_target_metric_in_one_line_before_anything_starts(argv, fragment, tmp_path, capsys):
    from tasks.cli.main import main

    status = main(["run", "--artifacts", str(tmp_path), "--types", "p3.2xlarge", *argv])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and fragment in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


@pytest.mark.integration
@pytest.mark.slow
def test_a_run_on_a_target_metric_is_profiled_planned_and_judged_on_it(prefect_harness, tmp_path, monkeypatch):
    """The whole flow on the local provider, profiling included: the clusters' curves are the
    metric's (1 - val_acc), the run tracks its evaluations and ends met on the metric."""
    import json

    from flows.train_with_slo import run_summary, train_with_slo
    from tasks.pipeline.plugin_policy import ENV

    monkeypatch.setenv(ENV, EVALUATED)  # what `spotfill run` allows for its local user
    request = TrainRequest.model_validate({
        "workload": EVALUATED, "slo": {"target_metric": "val_acc>=0.9", "deadline_s": 120},
        "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"], "quotas": {"p3.2xlarge": 2, "g3.8xlarge": 2}},
        "provider": {"name": "local"}, "artifacts_dir": str(tmp_path)})
    summary = run_summary(train_with_slo(request, return_state=True))
    assert summary["met"] and summary["verdict"].startswith("SLO met: val_acc "), summary["verdict"]
    assert summary["target_metric"] == "val_acc>=0.9" and summary["final_metric"] >= 0.9
    run_dir = Path(summary["report_dir"])
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if r["kind"] == "evaluation"]
    assert summary["final_metric"] in [pytest.approx(r["metrics"]["val_acc"]) for r in evaluations]
    (profile,) = tmp_path.glob("**/profile.json")
    assert json.loads(profile.read_text())["provenance"]["settings"]["curve"] == "val_acc"
