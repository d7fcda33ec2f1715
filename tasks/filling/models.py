"""Inference models built here (random init, seeded; no downloaded weights) and their datasets.

- "cnn": a small image classifier (3x32x32 -> 10 classes), the shape of CIFAR scoring.
- "transformer": a small encoder classifier over 64-token sequences (vocab 1000 -> 4 classes).
- "resnet50": ResNet-50-shaped (bottleneck stages 3, 4, 6, 3; 25.6M parameters), 3x224x224 ->
  1000 classes: the image model a GPU serves.
- "bert": a BERT-base-shaped encoder (12 layers, 768 wide, 12 heads, 3072 feed-forward; 110M
  parameters) over 128-token sequences (vocab 30522 -> 2 classes).
Each comes with a seeded synthetic dataset the offline job scores and online requests draw from.
The two large ones are sized for a GPU (tens of ms per batch of 16 there; seconds on a CPU).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MODEL_NAMES = ("cnn", "transformer", "resnet50", "bert")


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


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 reduce, 3x3, 1x1 expand (x4), with a projected shortcut when the
    shape changes."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = (nn.Identity() if stride == 1 and cin == cout else
                         nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000, blocks: tuple[int, ...] = (3, 4, 6, 3)):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                   nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for stage, count in enumerate(blocks):
            width = 64 * 2 ** stage
            for i in range(count):
                layers.append(Bottleneck(cin, width, 2 if i == 0 and stage > 0 else 1))
                cin = 4 * width
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class SmallTransformer(nn.Module):
    """An encoder classifier; the defaults are small, `bert` builds it BERT-base-shaped."""

    def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2, classes: int = 4,
                 seq_len: int = 64, heads: int = 4, ff: int | None = None,
                 activation: str = "relu"):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(1, seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=heads, dim_feedforward=ff or 2 * dim,
                                           batch_first=True, activation=activation)
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
    elif name == "resnet50":
        model = ResNet50()
        data = torch.randn(dataset_size, 3, 224, 224, generator=gen)
    elif name == "bert":
        model = SmallTransformer(vocab=30522, dim=768, layers=12, classes=2, seq_len=128, heads=12,
                                 ff=3072, activation="gelu")
        data = torch.randint(0, 30522, (dataset_size, 128), generator=gen)
    else:
        raise ValueError(f"unknown inference model {name!r}")
    return InferenceWorkload(name, model.eval(), data)


ALLOCATOR_SLACK = 1.5  # a GPU's caching allocator rounds blocks up; convolutions take workspace


class _LiveBytes(TorchDispatchMode):
    """The peak, over one forward, of the bytes held by tensors its operators made: each storage
    counted once, for as long as a tensor made on it is alive (inputs and parameters not counted)."""

    def __init__(self):
        super().__init__()
        self._alive: dict[tuple[int, int], list] = {}  # (storage address, bytes) -> weakrefs to its tensors
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self._alive.setdefault((storage.data_ptr(), storage.nbytes()), []).append(weakref.ref(t))
        live_bytes = 0
        for key, refs in list(self._alive.items()):
            refs = [r for r in refs if r() is not None]
            if refs:
                self._alive[key] = refs
                live_bytes += key[1]
            else:
                del self._alive[key]
        self.peak_bytes = max(self.peak_bytes, live_bytes)
        return out


class _Unfused(TorchFunctionMode):
    """Any function mode turns off fused fast paths (nn.TransformerEncoderLayer's), whose
    temporaries no dispatch mode sees; the unfused path holds at least as much."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def forward_peak_bytes(workload: InferenceWorkload, batch: int) -> int:
    """What one forward pass at `batch` holds at its peak beyond its input and parameters."""
    live = _LiveBytes()
    with torch.inference_mode(), _Unfused(), live:
        workload.model(workload.batch(0, batch).to(next(workload.model.parameters()).device))
    return live.peak_bytes


def memory_needed_mb(workload: InferenceWorkload, max_batch: int) -> float:
    """Parameters + the dataset + one input batch + a forward pass's peak at max_batch, times
    ALLOCATOR_SLACK. The peak is measured at batch 1 and 2 and extrapolated linearly (it grows
    with the batch like the activations it holds). Run it while the workload is still on the CPU,
    before anything is moved to a GPU."""
    one, two = forward_peak_bytes(workload, 1), forward_peak_bytes(workload, 2)
    peak_bytes = max(one, two) + max(0, two - one) * (max_batch - 2)
    param_bytes = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    data_bytes = workload.dataset.numel() * workload.dataset.element_size()
    input_bytes = data_bytes / max(1, len(workload.dataset)) * max_batch
    return (param_bytes + data_bytes + ALLOCATOR_SLACK * (input_bytes + peak_bytes)) / 2**20
