"""A plug-in's own metric: the optional evaluate(model) and a target on one of its metrics, both
checked before anything starts (tasks/runtime/evaluation.py)."""
from __future__ import annotations

import json

import pytest
import torch

from tasks.core.errors import UserInputError
from tasks.runtime.evaluation import (
    TargetMetric, check_target_metric, evaluate_model, metric_curve, metric_evaluation, parse_target_metric, tracked_value,
)
from tasks.runtime.telemetry import ClusterProgress
from tasks.runtime.workloads import check_workload

SPEC = "tests.plugins.evaluated:build"


@pytest.mark.parametrize("text,expected", [
    ("val_acc>=0.9", TargetMetric("val_acc", ">=", 0.9)),
    (" val_loss <= 0.3 ", TargetMetric("val_loss", "<=", 0.3)),
])
def test_a_target_metric_is_a_name_a_direction_and_a_number(text, expected):
    target = parse_target_metric(text)
    assert target == expected and str(target) == text.replace(" ", "")
    assert target.met(expected.value) and target.met(expected.value + (0.1 if target.direction == ">=" else -0.1))
    assert not target.met(expected.value + (-0.1 if target.direction == ">=" else 0.1))


@pytest.mark.parametrize("text,message", [
    ("val_acc>0.9", "the direction must be <= or >=, not >"),
    ("val_acc=0.9", "the direction must be <= or >=, not ="),
    ("val_acc>=nan", "must be a finite number"),
    ("val_acc>=high", "'high' is not a number"),
    ("0.9", "must be NAME<=X or NAME>=X"),
    ("val_acc>=90", "a higher-is-better metric is a fraction .* between 0 and 1"),
    ("val_acc>=1", "between 0 and 1"),
    ("val_loss<=0", "needs a target above 0"),
])
def test_a_bad_target_metric_is_one_line(text, message):
    with pytest.raises(UserInputError, match=message) as err:
        parse_target_metric(text)
    assert "\n" not in str(err.value)


def test_a_workload_with_an_evaluation_passes_the_checks_and_reports_its_metrics():
    workload = check_workload(SPEC, target_metric=parse_target_metric("val_acc>=0.9"))
    metrics = evaluate_model(SPEC, workload.evaluate, workload.model)
    assert set(metrics) == {"val_acc", "val_loss"} and 0 <= metrics["val_acc"] <= 1
    assert workload.model.training  # evaluated in eval mode, left as it was
    plain = workload.plain_steps(32)
    for _ in range(200):
        next(plain)
    trained = evaluate_model(SPEC, workload.evaluate, workload.model)
    assert trained["val_acc"] > metrics["val_acc"] and trained["val_loss"] < metrics["val_loss"]


@pytest.mark.parametrize("spec,target,message", [
    (SPEC, "val_f1>=0.5", "target metric 'val_f1' is not reported by workload .* reports val_acc, val_loss"),
    ("tests.plugins.broken:evaluate_raises", None, r"evaluate\(model\) failed: ValueError: no held-out data"),
    ("tests.plugins.broken:evaluate_nan", None, r"evaluate\(model\) returned val_loss = nan \(not finite\)"),
    ("tests.plugins.broken:evaluate_list", None, r"must return a non-empty dict of metric names to numbers, got list"),
])
def test_a_bad_evaluation_or_target_is_refused_before_anything_starts(spec, target, message):
    with pytest.raises(UserInputError, match=message) as err:
        check_workload(spec, target_metric=target and parse_target_metric(target))
    assert "\n" not in str(err.value)


def test_a_target_metric_needs_an_evaluation():
    with pytest.raises(UserInputError, match="target metric 'val_acc' needs an evaluate"):
        check_workload("tests.plugins.regression:build", target_metric=parse_target_metric("val_acc>=0.9"))


def test_tensor_metrics_become_numbers():
    model = torch.nn.Linear(2, 1)
    assert evaluate_model("x", lambda m: {"val_loss": torch.tensor(0.5)}, model) == {"val_loss": 0.5}


@pytest.mark.parametrize("spec,extra,message", [
    (SPEC, ["--target-metric", "val_acc>0.9"], "argument --target-metric: target metric 'val_acc>0.9': the direction must be"),
    (SPEC, ["--target-metric", "val_f1>=0.5"], "target metric 'val_f1' is not reported by workload"),
    ("tests.plugins.broken:evaluate_nan", ["--target-metric", "val_acc>=0.9"], "returned val_loss = nan"),
    ("tests.plugins.broken:evaluate_raises", ["--target-metric", "val_acc>=0.9"], "evaluate(model) failed"),
    (SPEC, ["--target-metric", "val_acc>=0.9", "--num-ps", "2"], "use --num-ps 1"),
])
def test_spotfill_train_refuses_a_bad_target_metric_in_one_line_before_launch(spec, extra, message, capsys, monkeypatch):
    from tasks.cli.main import main
    from tasks.providers.local import LocalProvider

    launched = []
    monkeypatch.setattr(LocalProvider, "launch", lambda *a, **k: launched.append(a))
    status = main(["train", "--workload", spec, "--workers", "p3.2xlarge=1", "--batch-size", "8",
                   "--max-updates", "5", *extra])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and launched == []
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.integration
@pytest.mark.slow
def test_spotfill_train_judges_the_trained_model_on_the_target_metric(tmp_path):
    from tests.helpers import spotfill

    done = spotfill("train", "--workload", SPEC, "--workers", "p3.2xlarge=1,g3.8xlarge=1", "--batch-size", "32",
                    "--max-updates", "200", "--target-metric", "val_acc>=0.9", "--artifacts", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert set(result["metrics"]) == {"val_acc", "val_loss"}
    assert result["target_metric"] == {"target": "val_acc>=0.9", "met": result["metrics"]["val_acc"] >= 0.9}
    assert result["metrics"]["val_acc"] >= 0.9  # this easy task is learned in 200 updates


def test_a_metric_maps_onto_the_loss_curves_scale_and_back():
    """The curve falls toward a floor: a lower-is-better metric is on it as it is, a
    higher-is-better one as its shortfall 1 - value; the mapping is its own inverse."""
    loss, acc = parse_target_metric("val_loss<=0.3"), parse_target_metric("val_acc>=0.9")
    assert loss.on_curve(0.5) == 0.5 and loss.curve_target == 0.3
    assert acc.on_curve(0.75) == 0.25 and acc.on_curve(acc.on_curve(0.75)) == 0.75
    assert acc.curve_target == pytest.approx(0.1)
    for observed in (0.89, 0.9, 0.91):  # met on the metric exactly when met on the curve's scale
        assert acc.met(observed) == (acc.on_curve(observed) <= acc.curve_target)


@pytest.mark.parametrize("target,metrics,message", [
    ("val_acc>=0.9", {"val_acc": 87.5}, r"reports val_acc = 87.5, outside \[0, 1\]"),
    ("val_loss<=0.3", {"val_loss": -1.0}, "must not be negative"),
])
def test_a_metric_off_its_curves_scale_is_refused(target, metrics, message):
    with pytest.raises(UserInputError, match=message):
        check_target_metric("x", metrics, parse_target_metric(target))


def test_a_runs_tracked_value_is_its_smoothed_loss_or_its_newest_evaluation_of_the_target_metric():
    acc = parse_target_metric("val_acc>=0.9")
    records = [{"kind": "update", "updates_total": 10, "loss": 2.0},
               {"kind": "evaluation", "updates_total": 10, "metrics": {"val_acc": 0.5, "val_loss": 1.0}},
               {"kind": "evaluation", "updates_total": 20, "metrics": {"val_acc": 0.75, "val_loss": 0.5}}]
    assert metric_curve(records, acc) == [(10, 0.5), (20, 0.25)]
    assert metric_curve(records, parse_target_metric("val_loss<=0.3")) == [(10, 1.0), (20, 0.5)]
    progress = ClusterProgress(smoothed_loss=1.5)
    assert tracked_value(progress, None) == 1.5 and tracked_value(progress, acc) is None  # no evaluation yet
    progress.metrics = {"val_acc": 0.75}
    assert tracked_value(progress, acc) == 0.25 and tracked_value(progress, None) == 1.5
    assert metric_evaluation(None) == {"eval_every_updates": None}  # the loss path: nothing else on the PS
    assert metric_evaluation(acc)["eval_every_updates"] > 0


def test_the_telemetry_reader_keeps_the_newest_evaluation(tmp_path):
    from tasks.runtime.telemetry import FILE_NAME, TelemetryReader

    lines = [{"t": 1.0, "kind": "evaluation", "updates_total": 10, "metrics": {"val_acc": 0.5}},
             {"t": 2.0, "kind": "evaluation", "updates_total": 20, "metrics": {"val_acc": 0.75}}]
    (tmp_path / FILE_NAME).write_text("".join(json.dumps(r) + "\n" for r in lines))
    progress = TelemetryReader(tmp_path).poll()
    assert (progress.metrics, progress.metrics_updates) == ({"val_acc": 0.75}, 20)
