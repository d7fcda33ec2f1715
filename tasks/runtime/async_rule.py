"""How the parameter server turns one stale gradient into an update: the asynchronous update rule.

A gradient computed on parameters s versions old (its staleness) is applied after s other updates.
Two effects follow, and each rule answers them differently:
- asynchrony acts as momentum (Mitliagkas et al., "Asynchrony begets momentum", 2016): with n
  workers the implicit momentum is about 1 - 1/n, on top of the optimizer's own (SGD's momentum,
  Adam's beta1), so the total nears 1 and the run stalls or diverges;
- a stale gradient points where the parameters were, so its step may shrink as s grows
  (staleness-aware ASGD, Zhang et al. 2016: lr / s).

Rules (by name: `PsConfig.async_rule`, `spotfill train|run --async-rule`, `TrainRequest.async_rule`):
- `momentum` (the default): the explicit momentum lowered so that explicit and implicit momentum
  together equal the configured one, (1 - mu') (1 - 1/n) = 1 - mu, i.e. mu' = max(0, 1 - n (1 - mu)),
  with n = 1 + the running mean staleness (measured, so it follows the cluster as workers join and
  leave); the learning rate undamped. One worker (s = 0) trains exactly as configured;
- `sqrt`: lr / sqrt(1 + s), momentum as configured (the rule the built-in workloads were first
  tuned with);
- `inverse`: lr / (1 + s) (Zhang et al.), momentum as configured.
Chosen by measurement on user-style plug-ins and the built-ins (BENCHMARKS.md, "Bring your own
model"). Each rule sets the learning rate and momentum of the optimizer's parameter groups just
before its step, so it works the same whether the PS holds per-tensor or flat parameters.
"""
from __future__ import annotations

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


RULES: dict[str, type[AsyncRule]] = {"momentum": MomentumRule, "sqrt": SqrtRule, "inverse": InverseRule}
DEFAULT_RULE = "momentum"


def make_rule(name: str, optimizer: torch.optim.Optimizer, lr_power: float | None = None) -> AsyncRule:
    """The rule `name` driving `optimizer` (lr_power: the damping exponent, default the rule's own);
    an unknown name is a ValueError listing the known ones."""
    if name not in RULES:
        raise ValueError(f"unknown async rule {name!r}; known: {', '.join(RULES)}")
    return RULES[name](optimizer, lr_power)
