"""A GRU telling whether a sequence's sum is positive (binary classification, the tuple)."""
import torch
from torch import nn
import torch.nn.functional as F


class SignOfSum(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, last = self.gru(x)
        return self.head(last[-1])


def build(length: int = 20, hidden: int = 32):
    torch.manual_seed(0)

    def batches(batch_size: int, seed: int):
        rng = torch.Generator().manual_seed(seed)
        while True:
            x = torch.randn(batch_size, length, 1, generator=rng)
            yield x, (x.sum(dim=(1, 2)) > 0).long()

    return SignOfSum(hidden), batches, F.cross_entropy
