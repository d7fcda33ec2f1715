"""Evaluation during training (tasks/runtime/periodic_eval.py): every N updates the PS's state is
copied, under its lock, into a model of the evaluation thread's own, evaluated there, and the
metrics go to telemetry; a target met stops the PS; a failing evaluate fails it."""
from __future__ import annotations

import json
import math
import os
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tasks.core.errors import UserInputError
from tasks.runtime import flat
from tasks.runtime.evaluation import parse_target_metric
from tasks.runtime.periodic_eval import PeriodicEvaluation
from tasks.runtime.ps import ParameterServer, PsConfig
from tasks.runtime.workloads import Workload, build_workload

WAIT_S = 60.0


class Records:
    """A telemetry writer that keeps the records and signals each one."""

    def __init__(self):
        self.records: list[dict] = []
        self.written = threading.Semaphore(0)

    def write(self, kind: str, **fields) -> None:
        self.records.append({"kind": kind, **fields})
        self.written.release()

    def next(self) -> dict:
        assert self.written.acquire(timeout=WAIT_S), "no evaluation record"
        return self.records[-1]


def weight_sum_workload(gate: threading.Event | None = None, value: float | None = None) -> Workload:
    """A linear model whose 'metric' is the sum of its weights: which parameters were evaluated.
    With `gate`, evaluate waits for it; with `value`, it reports that instead (NaN: a failure)."""
    def evaluate(model):
        if gate is not None:
            assert gate.wait(WAIT_S)
        return {"weight_sum": model.weight.sum().item() if value is None else value}

    model = nn.Linear(4, 1, bias=False)
    return Workload(name="sum", model=model, batches=lambda b, s: iter(()), loss_fn=F.mse_loss, evaluate=evaluate)


def state_of(value: float, workload: Workload) -> torch.Tensor:
    """A flat PS state whose 4 weights are each `value`."""
    state = torch.zeros(flat.layout_of(workload.model).numel)
    state[:4] = value
    return state


def test_every_nth_update_is_evaluated_on_the_parameters_of_that_update():
    workload, telemetry = weight_sum_workload(), Records()
    built = workload.model.weight.detach().clone()
    evaluation = PeriodicEvaluation("sum", workload, 3, telemetry)
    evaluation.start()
    try:
        state = torch.zeros(flat.layout_of(workload.model).numel)
        for update in range(1, 7):
            state[:4] = update  # the PS's parameters after this update
            evaluation.offer(state, update, version=update)
            if update % 3 == 0:
                record = telemetry.next()
                state[:4] = -1.0  # later updates do not reach the snapshot
                assert record["kind"] == "evaluation" and record["updates_total"] == update
                assert record["metrics"] == {"weight_sum": 4.0 * update} and record["skipped"] == 0
                assert evaluation._idle.wait(WAIT_S)
    finally:
        evaluation.close()
    assert [r["updates_total"] for r in telemetry.records] == [3, 6]
    assert torch.equal(workload.model.weight, built)  # the evaluation's model is a copy of its own


def test_a_due_update_while_the_evaluation_runs_is_skipped_and_counted():
    gate, telemetry = threading.Event(), Records()
    workload = weight_sum_workload(gate)
    evaluation = PeriodicEvaluation("sum", workload, 2, telemetry)
    evaluation.start()
    try:
        evaluation.offer(state_of(1.0, workload), 2, 2)
        evaluation.offer(state_of(2.0, workload), 4, 4)  # the first is still being evaluated
        gate.set()
        first = telemetry.next()
        assert evaluation._idle.wait(WAIT_S)
        evaluation.offer(state_of(3.0, workload), 6, 6)
        second = telemetry.next()
    finally:
        evaluation.close()
    assert (first["updates_total"], first["metrics"]["weight_sum"], first["skipped"]) == (2, 4.0, 1)
    assert (second["updates_total"], second["metrics"]["weight_sum"], second["skipped"]) == (6, 12.0, 0)


def test_a_target_met_calls_the_stop_and_a_failing_evaluate_the_failure():
    met, failed = threading.Event(), []
    telemetry = Records()
    workload = weight_sum_workload()
    evaluation = PeriodicEvaluation("sum", workload, 1, telemetry, parse_target_metric("weight_sum>=0.8"),
                                     on_met=met.set)
    evaluation.start()
    try:
        evaluation.offer(state_of(0.1, workload), 1, 1)
        assert telemetry.next()["met"] is False and not met.is_set()
        assert evaluation._idle.wait(WAIT_S)
        evaluation.offer(state_of(0.2, workload), 2, 2)
        assert telemetry.next()["met"] is True and met.wait(WAIT_S)
    finally:
        evaluation.close()

    done = threading.Event()
    broken = PeriodicEvaluation("sum", weight_sum_workload(value=math.nan), 1, Records(),
                                on_error=lambda err: (failed.append(err), done.set()))
    broken.start()
    broken.offer(state_of(1.0, workload), 1, 1)
    assert done.wait(WAIT_S)
    broken.close()
    assert isinstance(failed[0], UserInputError) and "weight_sum = nan (not finite)" in str(failed[0])


def _push(ps: ParameterServer) -> bool:
    """Apply one zero-gradient push."""
    header = torch.tensor([1.0, 0, 8, 2.0, ps.version, 0.1, 0.05, 0, 0, 0, -1], dtype=torch.float64)
    return ps.apply(0, "t", header, torch.zeros(ps.flat_size), batch_size=8)


def test_the_ps_evaluates_every_n_updates_and_stops_at_the_target_metric(tmp_path):
    ps = ParameterServer(PsConfig(run_dir=tmp_path, port=0, workload="tests.plugins.evaluated:build",
                                  eval_every_updates=2, target_metric=parse_target_metric("val_loss<=1e9")))
    stopped = threading.Event()
    on_met = ps.evaluation.on_met
    ps.evaluation.on_met = lambda: (on_met(), stopped.set())
    ps.evaluation.start()
    try:
        assert _push(ps) and _push(ps)
        assert stopped.wait(WAIT_S)
        assert ps.stopping == "target_metric" and not _push(ps)
    finally:
        ps.evaluation.close()
        ps.telemetry.close()
    records = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if r["kind"] == "evaluation"]
    assert len(evaluations) == 1 and evaluations[0]["updates_total"] == 2 and evaluations[0]["met"] is True
    assert set(evaluations[0]["metrics"]) == {"val_acc", "val_loss"} and evaluations[0]["target"] == "val_loss<=1e+09"


def test_an_evaluate_that_returns_nan_during_training_fails_the_ps_in_one_line(tmp_path):
    ps = ParameterServer(PsConfig(run_dir=tmp_path, port=0, workload="tests.plugins.broken:evaluate_nan_later",
                                  eval_every_updates=1))
    failed = threading.Event()
    on_error = ps.evaluation.on_error
    ps.evaluation.on_error = lambda err: (on_error(err), failed.set())
    ps.evaluation.start()
    try:
        assert _push(ps) and ps.evaluation._idle.wait(WAIT_S)  # its first evaluation is a good one
        assert _push(ps) and failed.wait(WAIT_S)
    finally:
        ps.evaluation.close()
        ps.telemetry.close()
    assert ps.stopping == "failed" and not _push(ps)
    assert "evaluate(model) returned val_loss = nan (not finite)" in ps.error and "\n" not in ps.error


@pytest.mark.parametrize("workload,options,message", [
    ("tests.plugins.regression:build", {}, "needs one unsharded PS evaluating"),
    ("tests.plugins.evaluated:build", {"eval_every_updates": None}, "needs one unsharded PS evaluating"),
    ("tests.plugins.evaluated:build", {"num_shards": 2}, "needs one unsharded PS evaluating"),
])
def test_a_ps_that_cannot_evaluate_refuses_a_target_metric(tmp_path, workload, options, message):
    with pytest.raises(UserInputError, match=message):
        ParameterServer(PsConfig(run_dir=tmp_path, port=0, workload=workload,
                                 target_metric=parse_target_metric("val_acc>=0.9"), **options))


@pytest.mark.parametrize("spec,options,metrics", [
    ("resnet20", {"width": 2}, {"val_loss", "val_acc"}),
    ("transformer-lm", {"d_model": 16, "layers": 1}, {"val_loss", "val_acc"}),
])
def test_built_in_workloads_evaluate_on_the_same_held_out_batches(spec, options, metrics):
    from tasks.runtime.evaluation import evaluate_model

    first, second = build_workload(spec, options), build_workload(spec, options)
    observed = evaluate_model(spec, first.evaluate, first.model)
    assert set(observed) == metrics and 0 <= observed["val_acc"] <= 1 and observed["val_loss"] > 0
    assert evaluate_model(spec, second.evaluate, second.model) == observed  # same start, same held-out data


@pytest.mark.integration
@pytest.mark.slow
def test_spotfill_train_stops_once_an_evaluation_meets_the_target_metric(tmp_path):
    from tests.helpers import spotfill

    done = spotfill("train", "--workload", "tests.plugins.evaluated:build", "--workers", "p3.2xlarge=2",
                    "--batch-size", "32", "--max-updates", "3000", "--eval-every-updates", "10",
                    "--target-metric", "val_acc>=0.9", "--artifacts", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["stopped"] == "target_metric" and result["updates"] < 3000
    records = [json.loads(line) for line in (tmp_path / result["run_id"] / "telemetry.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if r["kind"] == "evaluation"]
    assert [r["updates_total"] % 10 for r in evaluations] == [0] * len(evaluations)
    assert [r["met"] for r in evaluations] == [False] * (len(evaluations) - 1) + [True]
    assert evaluations[-1]["metrics"]["val_acc"] >= 0.9 and evaluations[-1]["updates_total"] <= result["updates"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_the_evaluation_thread_runs_at_the_lowest_priority_and_the_ps_thread_keeps_its_own():
    from tasks.runtime.periodic_eval import EVAL_NICE, lower_priority

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []

    def evaluation_thread():
        lower_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=evaluation_thread)
    thread.start()
    thread.join(WAIT_S)
    assert seen == [EVAL_NICE] and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
