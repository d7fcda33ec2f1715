"""A 16-input MLP fitting a noisy linear regression."""
import torch
from torch import nn
import torch.nn.functional as F


def build(inputs: int = 16, noise: float = 0.1):
    weights = torch.randn(inputs, 1, generator=torch.Generator().manual_seed(1))

    def batches(batch_size: int, seed: int):
        rng = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(batch_size, inputs, generator=rng)
            yield x, x @ weights + noise * torch.randn(batch_size, 1, generator=rng)

    model = nn.Sequential(nn.Linear(inputs, 64), nn.ReLU(), nn.Linear(64, 1))
    return model, batches, F.mse_loss
