"""Peak training memory against batch size, for Eq. 10.

CUDA: torch.cuda.max_memory_allocated over one forward/backward step (what the caching allocator
handed out, the number that runs out first on a GPU).
CPU (no GPU to measure): the documented equivalent is the bytes a step must hold at its peak:
parameters + gradients + every tensor autograd saves for the backward pass (counted once per
storage, via torch.autograd.graph.saved_tensors_hooks). Like the CUDA number it grows linearly in
the batch size, so the same regression applies.
"""
from __future__ import annotations

from typing import Sequence

from tasks.profiling.measurements import MemoryPoint


def _cpu_peak_bytes(workload, batch: int) -> int:
    import torch

    model = workload.model
    model.zero_grad(set_to_none=True)
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    inputs, targets = next(workload.batches(batch, 0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = workload.loss_fn(model(inputs), targets)
    loss.backward()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return 2 * param_bytes + sum(seen.values())


def _cuda_peak_bytes(workload, batch: int) -> int:
    import torch

    model = workload.model.cuda()
    model.zero_grad(set_to_none=True)
    inputs, targets = next(workload.batches(batch, 0))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss = workload.loss_fn(model(inputs.cuda()), targets.cuda())
    loss.backward()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def measure_memory(workload_name: str, workload_options: dict | None, batches: Sequence[int],
                   device: str = "auto") -> tuple[str, list[MemoryPoint]]:
    """(device description, one point per batch size). `device`: auto, cpu or cuda."""
    import torch

    from tasks.runtime.workloads import build_workload  # deferred: torch (start-up cost)

    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    workload = build_workload(workload_name, workload_options or {})
    workload.model.train()
    points = []
    for batch in batches:
        peak = _cuda_peak_bytes(workload, batch) if use_cuda else _cpu_peak_bytes(workload, batch)
        points.append(MemoryPoint(batch_per_gpu=batch, peak_bytes=peak))
    described = f"cuda:{torch.cuda.get_device_name()}" if use_cuda else "cpu"
    return described, points
