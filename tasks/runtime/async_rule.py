"""How the parameter server turns one stale gradient into an update: the asynchronous update rule.

A gradient computed on parameters s versions old (its staleness) is applied after s other updates.
Two effects follow, and each rule answers them differently:
- asynchrony acts as momentum (Mitliagkas et al., "Asynchrony begets momentum", 2016): with n
  workers the implicit momentum is about 1 - 1/n, on top of the optimizer's own (SGD's momentum,
  Adam's beta1), so the total nears 1 and the run stalls or diverges;
- a stale gradient points where the parameters were, so its step may shrink as s grows
  (staleness-aware ASGD, Zhang et al. 2016: lr / s).

Rules (by name: `PsConfig.async_rule`, `spotfill train|run --async-rule`, `TrainRequest.async_rule`):
- `guarded` (the default): the momentum lowered as `momentum` does, and, for SGD, the learning rate
  raised back towards lr (1 - mu) / (1 - mu') while the loss falls, so that slow directions (a
  plateau a recurrent model must leave) move by the configured lr / (1 - mu) a step as on one
  worker; when the loss rises (a stiff direction oscillating under the delay), the raise is
  halved and never again grows past that half. Adam's step does not scale with beta1: it is
  `momentum` there. One worker (s = 0) trains exactly as configured;
- `momentum`: the explicit momentum lowered so that explicit and implicit momentum together equal
  the configured one, (1 - mu') (1 - 1/n) = 1 - mu, i.e. mu' = max(0, 1 - n (1 - mu)), with n = 1 +
  the running mean staleness (measured, so it follows the cluster as workers join and leave); the
  learning rate undamped. Lowering SGD's momentum also shrinks its step on slow directions,
  lr / (1 - mu'), five times on five workers: what `guarded` gives back;
- `sqrt`: lr / sqrt(1 + s), momentum as configured (the rule the built-in workloads were first
  tuned with);
- `inverse`: lr / (1 + s) (Zhang et al.), momentum as configured.
Chosen by measurement on user-style plug-ins and the built-ins (BENCHMARKS.md, "Bring your own
model"). Each rule sets the learning rate and momentum of the optimizer's parameter groups just
before its step, so it works the same whether the PS holds per-tensor or flat parameters.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the CLI lists the rules without loading torch
    import torch

STALENESS_SMOOTHING = 0.05  # EMA factor of the running mean staleness (about the last 20 updates)


def implicit_momentum(mean_staleness: float) -> float:
    """1 - 1/n with n = 1 + mean staleness: the momentum asynchrony adds (Mitliagkas et al.)."""
    return 1.0 - 1.0 / (1.0 + max(0.0, mean_staleness))


class AsyncRule:
    """The base: a staleness-damped learning rate, lr / (1 + s) ** lr_power, and the optimizer's
    momentum as configured; subclasses also lower the momentum."""

    default_lr_power = 0.5

    def __init__(self, optimizer: torch.optim.Optimizer, lr_power: float | None = None):
        self.optimizer = optimizer
        self.lr_power = self.default_lr_power if lr_power is None else lr_power
        self.mean_staleness = 0.0
        # each group's configured momentum, read before a checkpoint can load a lowered one
        self.configured = [group["betas"][0] if "betas" in group else group.get("momentum", 0.0)
                           for group in optimizer.param_groups]

    def momentum(self, configured: float) -> float:
        return configured

    def observe(self, loss: float) -> None:
        """The loss a worker reported with the gradient about to be applied."""

    def prepare(self, lr: float, staleness: int) -> float:
        """Set the groups' learning rate and momentum for the next step; returns the lr used."""
        staleness = max(0, staleness)
        self.mean_staleness += STALENESS_SMOOTHING * (staleness - self.mean_staleness)
        lr = lr / (1 + staleness) ** self.lr_power
        for group, configured in zip(self.optimizer.param_groups, self.configured):
            group["lr"] = lr
            if "betas" in group:  # Adam: beta1 is its momentum
                group["betas"] = (self.momentum(configured), group["betas"][1])
            elif "momentum" in group:
                group["momentum"] = self.momentum(configured)
        return lr


class SqrtRule(AsyncRule):
    pass


class InverseRule(AsyncRule):
    default_lr_power = 1.0


class MomentumRule(AsyncRule):
    default_lr_power = 0.0

    def momentum(self, configured: float) -> float:
        return max(0.0, 1.0 - (1.0 - configured) / (1.0 - implicit_momentum(self.mean_staleness)))


class GuardedRule(MomentumRule):
    """`momentum`, and SGD's learning rate raised by a factor that grows while the loss falls, up
    to (1 - mu) / (1 - mu'); a rise of the loss halves it and caps it there for good."""

    growth = 1.02  # per update: the raise can go from 1 to 5 in about 80 updates
    fast_smoothing, slow_smoothing = 0.1, 0.02  # EMAs of the reported loss compared for a rise
    rise = 1.05  # the fast EMA this much above the slow one: the loss rises

    def __init__(self, optimizer, lr_power=None):
        super().__init__(optimizer, lr_power)
        self.raise_by = 1.0
        self.ceiling = math.inf
        self.fast_loss: float | None = None
        self.slow_loss: float | None = None

    def observe(self, loss: float) -> None:
        if self.fast_loss is None:
            self.fast_loss = self.slow_loss = loss
        self.fast_loss += self.fast_smoothing * (loss - self.fast_loss)
        self.slow_loss += self.slow_smoothing * (loss - self.slow_loss)
        if self.fast_loss <= self.rise * self.slow_loss:  # also False for a NaN loss
            self.raise_by = min(self.ceiling, self.raise_by * self.growth)
        else:
            self.raise_by = self.ceiling = max(1.0, self.raise_by / 2)
            self.slow_loss = self.fast_loss

    def prepare(self, lr: float, staleness: int) -> float:
        lr = super().prepare(lr, staleness)
        group = self.optimizer.param_groups[0]
        if "betas" in group or not self.configured[0] < 1:
            return lr
        self.raise_by = min(self.raise_by, (1 - group["momentum"]) / (1 - self.configured[0]))
        for group in self.optimizer.param_groups:
            group["lr"] = lr * self.raise_by
        return lr * self.raise_by


RULES: dict[str, type[AsyncRule]] = {"guarded": GuardedRule, "momentum": MomentumRule, "sqrt": SqrtRule,
                                     "inverse": InverseRule}
DEFAULT_RULE = "guarded"


def make_rule(name: str, optimizer: torch.optim.Optimizer, lr_power: float | None = None) -> AsyncRule:
    """The rule `name` driving `optimizer` (lr_power: the damping exponent, default the rule's own);
    an unknown name is a ValueError listing the known ones."""
    if name not in RULES:
        raise ValueError(f"unknown async rule {name!r}; known: {', '.join(RULES)}")
    return RULES[name](optimizer, lr_power)
