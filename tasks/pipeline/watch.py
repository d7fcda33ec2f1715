"""What the watch loop computes from telemetry: progress towards the SLO, money spent, and
whether the run has drifted from the prediction, in update rate or in progress to the target."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


def loss_progress(initial_loss: float | None, current_loss: float | None, target_loss: float) -> float:
    """Fraction of the way from the first observed loss to the target, in [0, 1]."""
    if initial_loss is None or current_loss is None:
        return 0.0
    if initial_loss <= target_loss:
        return 1.0
    return min(1.0, max(0.0, (initial_loss - current_loss) / (initial_loss - target_loss)))


@dataclass(frozen=True)
class LossCurve:
    """The model's loss after j updates, loss(j) = a / (j + gamma1) + gamma5 (Eq. 3 for one
    cluster), read both ways: progress in loss is progress in updates."""

    a: float
    gamma1: float
    gamma5: float

    def loss_at(self, updates):
        return self.a / (updates + self.gamma1) + self.gamma5

    def updates_to(self, loss: float) -> float:
        """The updates the curve needs to reach `loss` (infinite at or below its floor gamma5)."""
        return float("inf") if loss <= self.gamma5 else self.a / (loss - self.gamma5) - self.gamma1


def progress_ratio(curve: LossCurve, iteration_time_s: float, since_s: float, start_loss: float | None,
                   loss: float | None) -> float | None:
    """Observed progress to the target over what the plan predicted, both in the curve's
    updates: from the plan's start (`start_loss`, None: the start of training) to `loss`, against
    `since_s` seconds of the plan's iteration time. None until there is a loss and a prediction."""
    if loss is None or since_s <= 0 or iteration_time_s <= 0:
        return None
    start = 0.0 if start_loss is None else curve.updates_to(start_loss)
    return (curve.updates_to(loss) - start) / (since_s / iteration_time_s)


@dataclass
class CostMeter:
    """Integrates the hourly price of whatever is running, poll by poll."""

    spent_usd: float = 0.0
    last_t: float | None = None

    def advance(self, now_s: float, usd_per_h: float) -> float:
        if self.last_t is not None and now_s > self.last_t:
            self.spent_usd += usd_per_h * (now_s - self.last_t) / 3600.0
        self.last_t = now_s
        return self.spent_usd


@dataclass
class DriftDetector:
    """Flags drift when the observed update rate, or the progress to the target loss, stays below
    the predicted one by more than `threshold` (relative) for `window_s` seconds; `reset()` after
    a re-plan."""

    threshold: float
    window_s: float
    samples: deque = field(default_factory=deque)  # (t, updates_total)
    below_since: float | None = None

    def reset(self) -> None:
        self.samples.clear()
        self.below_since = None

    def observe(self, now_s: float, updates_total: int, predicted_updates_per_s: float,
                progress: float | None = None) -> float | None:
        """Record one poll; returns the observed/predicted ratio (the lower of update rate and
        `progress`, see progress_ratio) once drift has lasted the whole window (else None)."""
        self.samples.append((now_s, updates_total))
        while len(self.samples) > 2 and now_s - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        t0, u0 = self.samples[0]
        if now_s - t0 < self.window_s / 2 or predicted_updates_per_s <= 0:
            return None
        ratio = (updates_total - u0) / (now_s - t0) / predicted_updates_per_s
        if progress is not None:
            ratio = min(ratio, progress)
        if ratio >= 1.0 - self.threshold:
            self.below_since = None
            return None
        self.below_since = self.below_since if self.below_since is not None else now_s
        return ratio if now_s - self.below_since >= self.window_s else None


@dataclass
class DriftHold:
    """Drift acts once per plan: announced once and then held (however many polls still see it)
    until a re-plan answers it; the next plan starts a new hold. `plan` names the plan drift is
    judged against (0 the first, then the run's re-plan count), so a re-plan request that answers
    an earlier plan is recognised as stale. `newest_ratio` is the latest observed/predicted ratio
    against this plan's model: what a refit uses, whatever ratio an announcement carried."""

    plan: int = 0
    announced: bool = False
    newest_ratio: float | None = None

    def announce(self) -> int:
        """Mark this plan's drift announced; the plan a re-plan request must name to answer it."""
        self.announced = True
        return self.plan

    def saw(self, ratio: float | None) -> None:
        if ratio is not None:
            self.newest_ratio = ratio

    def answers(self, asked: dict) -> bool:
        """Whether a re-plan request is for the plan in effect (not one an earlier re-plan answered)."""
        return asked.get("plan") == self.plan


def refit_ratio(ratio: float | None) -> float | None:
    """A speed ratio a refit may scale the model by: in (0, 1]. None, zero (no update in the
    window: workers still starting, or all revoked), negative (the loss rose), above 1 (not
    drift) or not finite gives no speed to refit to: None."""
    return ratio if ratio is not None and math.isfinite(ratio) and 0 < ratio <= 1 else None
