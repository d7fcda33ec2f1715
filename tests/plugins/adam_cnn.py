"""A small CNN on 16x16 synthetic images of 4 classes, trained with Adam: returns a Workload to
set the optimizer and its learning rate."""
import torch
from torch import nn
import torch.nn.functional as F

from tasks.runtime.workloads import Workload


def build(classes: int = 4, noise: float = 1.0):
    torch.manual_seed(0)
    prototypes = torch.randn(classes, 1, 16, 16, generator=torch.Generator().manual_seed(1))

    def batches(batch_size: int, seed: int):
        rng = torch.Generator().manual_seed(seed)
        while True:
            labels = torch.randint(0, classes, (batch_size,), generator=rng)
            yield prototypes[labels] + noise * torch.randn(batch_size, 1, 16, 16, generator=rng), labels

    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, classes))
    return Workload(name="adam-cnn", model=model, batches=batches, loss_fn=F.cross_entropy,
                    optimizer="adam", base_lr=1e-3, base_batch=32)
