"""A plug-in's own metric: the optional evaluate(model) and a target on one of its metrics, both
checked before anything starts (tasks/runtime/evaluation.py)."""
from __future__ import annotations

import json

import pytest
import torch

from tasks.core.errors import UserInputError
from tasks.runtime.evaluation import TargetMetric, evaluate_model, parse_target_metric
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
