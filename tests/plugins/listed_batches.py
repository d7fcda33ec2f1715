"""A valid plug-in whose batches() returns a list, as a small dataset often is, not a generator."""
import torch
import torch.nn.functional as F
from torch import nn


def build(batches_held: int = 64):
    weights = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))

    def batches(batch_size: int, seed: int):
        rng = torch.Generator().manual_seed(seed)
        inputs = [torch.randn(batch_size, 16, generator=rng) for _ in range(batches_held)]
        return [(x, x @ weights) for x in inputs]

    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1)), batches, F.mse_loss
