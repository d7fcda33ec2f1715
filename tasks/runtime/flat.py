"""Flat buffers: a model's parameters and floating-point buffers living in one contiguous tensor.

The wire moves one flat float32 vector each way (wire.py): [parameters | floating-point buffers]
down (a pull), [gradients | buffers] up (a push). When the model's tensors are views into such a
vector, a pull lands directly in the model and a push is the gradient buffer itself: no per-tensor
packing, no extra pass over the bytes. `bind` does that once, at start-up.

Each tensor starts on a 64-byte boundary of the vector (ALIGN_NUMEL; the gaps are zeros and stay
zero under every optimizer the runtime uses): on a GPU a view at an odd offset can keep vectorized
kernels (and some of cuBLAS's fastest) off its tensor, where a plain model's tensors each start on
an allocator block.

Sharded parameter servers (`num_ps` = k) each own one contiguous range of that vector; `shard_ranges`
cuts it into k ranges of (nearly) equal bytes. The cut may fall inside a tensor: every optimizer
the runtime uses is elementwise, so a range of a tensor is updated exactly as the whole tensor.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn


ALIGN_NUMEL = 16  # float32 elements: 64 bytes


def _aligned(numel: int) -> int:
    return -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL


@dataclass(frozen=True)
class Layout:
    """Where things are in the flat vector: the parameters' region (`param_numel` elements, gaps
    included), then the buffers'; `offsets`: where each synced tensor starts, parameters first."""

    param_numel: int
    buffer_numel: int
    offsets: tuple[int, ...]

    @property
    def numel(self) -> int:
        return self.param_numel + self.buffer_numel


def synced_tensors(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What the PS owns and workers pull: the parameters, and the floating-point buffers
    (BatchNorm statistics; integer counters stay local)."""
    return list(model.parameters()), [b for b in model.buffers() if b.is_floating_point()]


def layout_of(model: nn.Module) -> Layout:
    params, buffers = synced_tensors(model)
    sizes = [_aligned(t.numel()) for t in params + buffers]
    offsets = tuple(itertools.accumulate([0] + sizes[:-1])) if sizes else ()
    param_numel = sum(sizes[:len(params)])
    return Layout(param_numel, sum(sizes) - param_numel, offsets)


@dataclass
class FlatModel:
    """A model whose parameters and floating-point buffers are views into `state`, and whose
    gradients are views into `push[:layout.param_numel]` (push = the message a worker sends)."""

    model: nn.Module
    layout: Layout
    state: torch.Tensor  # [parameters | buffers], on the model's device
    push: torch.Tensor  # [gradients | buffers], on the model's device

    def zero_grad(self) -> None:
        self.push[:self.layout.param_numel].zero_()

    def fill_push_buffers(self) -> torch.Tensor:
        """The push message: gradients (already in place) and the buffers as they are now."""
        self.push[self.layout.param_numel:].copy_(self.state[self.layout.param_numel:])
        return self.push


def bind(model: nn.Module, with_grads: bool = True) -> FlatModel:
    """Move the model's parameters and floating-point buffers into one flat tensor on their
    device (they become views of it, values kept); gradients likewise into `push`. Autograd then
    accumulates each gradient in place, into the flat push buffer."""
    params, buffers = synced_tensors(model)
    tensors = params + buffers
    device = tensors[0].device if tensors else torch.device("cpu")
    layout = layout_of(model)
    state = torch.zeros(layout.numel, device=device)  # the gaps between tensors stay zero
    push = torch.zeros(layout.numel if with_grads else 0, device=device)
    with torch.no_grad():
        for t, offset in zip(tensors, layout.offsets):
            n = t.numel()
            view = state[offset:offset + n].view_as(t)
            view.copy_(t)
            t.data = view
            if with_grads and offset < layout.param_numel:
                t.grad = push[offset:offset + n].view_as(t)
    return FlatModel(model, layout, state, push)


def shard_ranges(numel: int, shards: int) -> list[tuple[int, int]]:
    """`shards` contiguous [lo, hi) ranges covering 0..numel, sizes differing by at most one
    element (equal bytes: every element is float32)."""
    if shards <= 0:
        raise ValueError(f"number of shards must be positive, got {shards}")
    base, extra = divmod(numel, shards)
    ranges, lo = [], 0
    for i in range(shards):
        hi = lo + base + (1 if i < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges
