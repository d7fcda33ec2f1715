"""A plug-in's own metric: the optional `evaluate(model) -> {name: value}` of the workload contract,
and a target on one of its metrics (`NAME<=X` or `NAME>=X`).

Both are checked before anything starts (check_workload): an evaluate that raises, returns
something other than a dict of numbers, or a NaN or infinite value, and a target metric the
plug-in does not report or a direction that is neither <= nor >=, are one line naming the cause.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tasks.core.errors import UserInputError, one_line
from tasks.core.limits import strict_float

if TYPE_CHECKING:  # torch is imported where a model is evaluated: the CLI parses targets without it
    from torch import nn

DIRECTIONS = ("<=", ">=")
DEFAULT_EVAL_EVERY_UPDATES = 50  # the PS evaluates during training this often (periodic_eval.py)
TRACKED_EVAL_EVERY_UPDATES = 10  # ... and this often where a target metric is profiled and tracked (its curve's points)
_TARGET = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.\-]*)\s*(<=|>=|=<|=>|<|>|==|=)\s*(\S+)\s*$")


@dataclass(frozen=True)
class TargetMetric:
    """A promise on one metric: `name` at or below (`<=`) or at or above (`>=`) `value`."""

    name: str
    direction: str  # one of DIRECTIONS
    value: float

    def met(self, observed: float) -> bool:
        return observed <= self.value if self.direction == "<=" else observed >= self.value

    def on_curve(self, observed: float) -> float:
        """`observed` on the loss curve's scale, which falls toward a floor as training goes on
        (docs/model.md): a lower-is-better metric as it is, a higher-is-better one (a fraction,
        such as accuracy) as its shortfall 1 - value."""
        return observed if self.direction == "<=" else 1.0 - observed

    @property
    def curve_target(self) -> float:
        """The target on the loss curve's scale: the profile is fitted, the plan made and drift
        judged on that scale."""
        return self.on_curve(self.value)

    def __str__(self) -> str:
        """As given, and parsed back to the same target (it travels to the PS as text)."""
        short = f"{self.value:g}"
        return f"{self.name}{self.direction}{short if float(short) == self.value else repr(self.value)}"


def parse_target_metric(text: str) -> TargetMetric:
    """`val_acc>=0.9` or `val_loss<=0.3` into a TargetMetric; anything else is one line."""
    match = _TARGET.match(text)
    if match is None:
        raise UserInputError(f"target metric must be NAME<=X or NAME>=X, got {text!r}")
    name, direction, number = match.groups()
    if direction not in DIRECTIONS:
        raise UserInputError(f"target metric {text!r}: the direction must be <= or >=, not {direction}")
    try:
        value = strict_float(number)
    except UserInputError:
        raise UserInputError(f"target metric {text!r}: {number!r} is not a number") from None
    if not math.isfinite(value):
        raise UserInputError(f"target metric {text!r}: the value must be a finite number")
    if direction == ">=" and not 0 < value < 1:
        raise UserInputError(f"target metric {text!r}: a higher-is-better metric is a fraction (accuracy, F1): "
                             f"its target must lie between 0 and 1")
    if direction == "<=" and value <= 0:
        raise UserInputError(f"target metric {text!r}: a lower-is-better metric (a loss) needs a target above 0")
    return TargetMetric(name, direction, value)


def evaluate_model(spec: str, evaluate, model: nn.Module) -> dict[str, float]:
    """The plug-in's metrics of `model` (in eval mode, without gradients; its mode is restored),
    checked: a dict of metric names to finite numbers."""
    import torch

    where = f"workload {spec!r}: evaluate(model)"
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            metrics = evaluate(model)
    except Exception as err:  # noqa: BLE001 - the plug-in's own failure, in one line
        raise UserInputError(f"{where} failed: {type(err).__name__}: {one_line(err)}") from None
    finally:
        model.train(was_training)
    if not isinstance(metrics, dict) or not metrics:
        raise UserInputError(f"{where} must return a non-empty dict of metric names to numbers, "
                             f"got {type(metrics).__name__}")
    checked = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserInputError(f"{where} returned {name!r}: {type(value).__name__}; metric values must be numbers")
        if not math.isfinite(value):
            raise UserInputError(f"{where} returned {name} = {value} (not finite)")
        checked[name] = float(value)
    return checked


def check_target_metric(spec: str, metrics: dict[str, float], target: TargetMetric) -> None:
    """The target's metric must be one the plug-in reports, on the scale its curve is fitted on
    (a fraction for >=, not negative for <=)."""
    if target.name not in metrics:
        raise UserInputError(f"target metric {target.name!r} is not reported by workload {spec!r} "
                             f"(its evaluate reports {', '.join(sorted(metrics))})")
    observed = metrics[target.name]
    if target.direction == ">=" and not 0 <= observed <= 1:
        raise UserInputError(f"target metric {target}: workload {spec!r} reports {target.name} = {observed:g}, "
                             f"outside [0, 1]; a higher-is-better metric must be a fraction (accuracy, F1)")
    if target.direction == "<=" and observed < 0:
        raise UserInputError(f"target metric {target}: workload {spec!r} reports {target.name} = {observed:g}; "
                             f"a lower-is-better metric (a loss) must not be negative")


def metric_curve(records: list[dict], target: TargetMetric) -> list[tuple[int, float]]:
    """(update count, the target's metric on the loss curve's scale) of each evaluation in a run's
    telemetry records: the curve profiling fits and the pipeline tracks for a target metric."""
    return [(r["updates_total"], target.on_curve(r["metrics"][target.name]))
            for r in records if r["kind"] == "evaluation" and target.name in r["metrics"]]


def tracked_value(progress, target: TargetMetric | None) -> float | None:
    """What a run is judged on, on the loss curve's scale: the PS's smoothed training loss, or with
    a target metric its newest evaluation (None before the first)."""
    if target is None:
        return progress.smoothed_loss
    if progress.metrics is None or target.name not in progress.metrics:
        return None
    return target.on_curve(progress.metrics[target.name])


def metric_evaluation(target: TargetMetric | None) -> dict:
    """start_run's evaluation for a run the pipeline profiles or tracks: with a target metric, every
    TRACKED_EVAL_EVERY_UPDATES updates (the points of its curve); on the training loss none, so
    nothing but training shares the PS with the measured updates."""
    return {"eval_every_updates": None if target is None else TRACKED_EVAL_EVERY_UPDATES}
