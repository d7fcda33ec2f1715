"""Evaluation during training: the plug-in's `evaluate(model)` every N updates, on a snapshot of
the parameter server's state, in a thread beside the PS with its own copy of the model.

The update path pays one copy of the flat vector per evaluation (taken under the PS's lock, at
exactly the N-th update); the forward passes run in the thread, off the lock, at the lowest CPU
priority (EVAL_NICE, per thread on Linux), so that on a PS short of cores the updates come first. An N-th update that
comes while the previous evaluation still runs is skipped (counted in the next record), so a slow
evaluate never queues up behind training. Each evaluation is a telemetry record `evaluation`
(updates_total, version, snapshot_t, eval_s, metrics, skipped: due ones skipped since the
previous record, and with a target `met`); the first observation at the target stops the run (the
PS's stop rule, reason `target_metric`). An evaluate that fails or returns NaN is the PS's
failure, in one line (evaluation.py's checks).
"""
from __future__ import annotations

import copy
import os
import threading
import time
from typing import Callable

import torch

from tasks.core.errors import UserInputError
from tasks.runtime import flat
from tasks.runtime.evaluation import TargetMetric, check_target_metric, evaluate_model
from tasks.runtime.telemetry import TelemetryWriter
from tasks.runtime.workloads import Workload

CLOSE_WAIT_S = 10.0  # how long closing waits for an evaluation under way
EVAL_NICE = 19  # the evaluation thread's CPU priority (lowest): on a PS short of cores, updates come first


class PeriodicEvaluation:
    """Evaluates snapshots offered by the PS (`offer`, under its lock) in a thread of its own."""

    def __init__(self, spec: str, workload: Workload, every_updates: int, telemetry: TelemetryWriter,
                 target: TargetMetric | None = None, on_met: Callable[[], None] = lambda: None,
                 on_error: Callable[[BaseException], None] = lambda err: None):
        if every_updates <= 0:
            raise UserInputError(f"evaluation every {every_updates} updates: must be a positive count")
        self.spec, self.evaluate, self.every_updates = spec, workload.evaluate, every_updates
        self.telemetry, self.target, self.on_met, self.on_error = telemetry, target, on_met, on_error
        self.model = copy.deepcopy(workload.model)
        self.state = flat.bind(self.model, with_grads=False).state  # the copy's parameters, one vector
        self.skipped = 0
        self._taken: tuple[int, int, float] = (0, 0, 0.0)  # (updates_total, version, t) of the snapshot
        self._idle = threading.Event()  # the copy is free: no evaluation under way or waiting
        self._idle.set()
        self._due = threading.Event()  # a snapshot waits to be evaluated (or closing)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="evaluation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def offer(self, state: torch.Tensor, updates_total: int, version: int) -> None:
        """After each update, under the PS's lock: at every N-th, copy `state` into the model's copy,
        unless the previous evaluation is still under way (then this one is skipped)."""
        if updates_total % self.every_updates or self._closed:
            return
        if not self._idle.is_set():
            self.skipped += 1
            return
        self._idle.clear()
        self.state.copy_(state)
        self._taken = (updates_total, version, time.time())
        self._due.set()

    def close(self) -> None:
        """Stop the thread, letting an evaluation under way finish (up to CLOSE_WAIT_S)."""
        self._closed = True
        self._due.set()
        if self._thread.is_alive():
            self._thread.join(CLOSE_WAIT_S)

    def _run(self) -> None:
        lower_priority()
        while True:
            self._due.wait()
            self._due.clear()
            if self._closed:
                return
            try:
                self._evaluate_snapshot()
            except BaseException as err:  # noqa: BLE001 - the plug-in's failure is the PS's, in one line
                self.on_error(err)
                return
            self._idle.set()

    def _evaluate_snapshot(self) -> None:
        updates_total, version, snapshot_t = self._taken
        start_s = time.perf_counter()
        metrics = evaluate_model(self.spec, self.evaluate, self.model)
        eval_s = time.perf_counter() - start_s
        met = None
        if self.target is not None:
            check_target_metric(self.spec, metrics, self.target)
            met = self.target.met(metrics[self.target.name])
        skipped, self.skipped = self.skipped, 0
        self.telemetry.write("evaluation", updates_total=updates_total, version=version, snapshot_t=snapshot_t,
                             eval_s=eval_s, metrics=metrics, skipped=skipped,
                             **({"target": str(self.target), "met": met} if self.target is not None else {}))
        if met:
            self.on_met()


def lower_priority() -> None:
    """The calling thread to EVAL_NICE, where the OS sets priorities per thread (Linux); elsewhere,
    or where it is refused, the thread keeps the process's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), EVAL_NICE)
    except (AttributeError, OSError):
        return
