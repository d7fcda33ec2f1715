"""Workload plug-ins for the profiling tests (imported by the worker processes by name)."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from tasks.runtime.workloads import Workload


def diverging() -> Workload:
    """Linear regression at a learning rate far too high: the loss explodes within a few updates."""
    torch.manual_seed(0)

    def batches(batch_size: int, seed: int):
        rng = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(batch_size, 8, generator=rng)
            yield x, x.sum(dim=1, keepdim=True)

    return Workload(name="diverging", model=nn.Linear(8, 1), batches=batches, loss_fn=F.mse_loss,
                    optimizer="sgd", base_lr=50.0, base_batch=8)
