"""Inference models built here (random init, seeded; no downloaded weights) and their datasets.

- "cnn": a small image classifier (3x32x32 -> 10 classes), the shape of CIFAR scoring.
- "transformer": a small encoder classifier over 64-token sequences (vocab 1000 -> 4 classes).
Each comes with a seeded synthetic dataset the offline job scores and online requests draw from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MODEL_NAMES = ("cnn", "transformer")


class SmallCNN(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class SmallTransformer(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2, classes: int = 4,
                 seq_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(1, seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens) + self.position).mean(1))


@dataclass
class InferenceWorkload:
    """A model in eval mode plus the samples it scores (dataset[i] is one sample)."""
    name: str
    model: nn.Module
    dataset: torch.Tensor

    def batch(self, start: int, n: int) -> torch.Tensor:
        idx = torch.arange(start, start + n) % len(self.dataset)
        return self.dataset[idx]

    def to(self, device: str) -> "InferenceWorkload":
        return InferenceWorkload(self.name, self.model.to(device), self.dataset.to(device))


def build_workload(name: str, dataset_size: int = 1024, seed: int = 0) -> InferenceWorkload:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "cnn":
        model = SmallCNN()
        data = torch.randn(dataset_size, 3, 32, 32, generator=gen)
    elif name == "transformer":
        model = SmallTransformer()
        data = torch.randint(0, 1000, (dataset_size, 64), generator=gen)
    else:
        raise ValueError(f"unknown inference model {name!r}")
    return InferenceWorkload(name, model.eval(), data)


def memory_needed_mb(workload: InferenceWorkload, max_batch: int) -> float:
    """Parameters + the activations of one forward pass at max_batch (measured at batch 1 with
    forward hooks on every module, scaled linearly), doubled for allocator slack."""
    activation_bytes = 0

    def count(_module, _inputs, output):
        nonlocal activation_bytes
        if isinstance(output, torch.Tensor):
            activation_bytes += output.numel() * output.element_size()

    hooks = [m.register_forward_hook(count) for m in workload.model.modules()]
    try:
        with torch.inference_mode():
            workload.model(workload.batch(0, 1).to(next(workload.model.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    param_bytes = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    return (param_bytes + 2 * activation_bytes * max_batch) / 2**20
