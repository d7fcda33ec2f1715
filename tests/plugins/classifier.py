"""An MLP classifying points drawn around 10 random class centres in 32 dimensions (the tuple)."""
import torch
from torch import nn
import torch.nn.functional as F


def build(classes: int = 10, dims: int = 32, spread: float = 1.5):
    torch.manual_seed(0)
    centres = torch.randn(classes, dims, generator=torch.Generator().manual_seed(1))

    def batches(batch_size: int, seed: int):
        rng = torch.Generator().manual_seed(seed)
        while True:
            labels = torch.randint(0, classes, (batch_size,), generator=rng)
            yield centres[labels] + spread * torch.randn(batch_size, dims, generator=rng), labels

    model = nn.Sequential(nn.Linear(dims, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, classes))
    return model, batches, F.cross_entropy
