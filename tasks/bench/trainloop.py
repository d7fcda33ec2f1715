"""A stand-alone training loop with real bubbles, for the bench and tests (the runtime has its own).

Compute phase: forward/backward/optimizer step, on seeded synthetic data: a small CNN on the CPU
(torch's intra-op threads), or one of the runtime's workloads at a realistic size
(`TrainingJob.from_workload`, e.g. resnet110-cifar100 at batch 128 on a GPU). Communication phase:
the gradients are flattened and copied to the host (real work: the push's first half), then the
worker waits until the shaped transfer time of push + pull, 2 * S / B, has passed since the phase
began. The local provider's network emulation is time-based too, so a timed wait is a faithful
stand-in for a worker blocked on its parameter server.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

import torch
from torch import nn

from tasks.core.phases import PhaseListener
from tasks.filling.executor import training_stream
from tasks.runtime.workloads import build_workload

BATCHES_KEPT = 8  # distinct batches, made before the loop and cycled (data generation is not compute)


def small_cnn(width: int = 32, classes: int = 100) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 8 * 8, classes),
    )


class TrainingJob:
    """On CUDA the step runs on a highest-priority stream, timed by CUDA events around it, and
    compute_end is marked after that stream has finished, so the phase edges are the device's,
    not the launch's; the listener gets the device's compute time."""

    def __init__(self, batch: int = 64, width: int = 32, seed: int = 0, device: str = "cpu", *,
                 model: nn.Module | None = None, batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 loss_fn: Callable = nn.functional.cross_entropy, name: str = "small-cnn"):
        torch.manual_seed(seed)
        self.device = device
        self.batch = batch
        self.name = name
        self.model = model if model is not None else small_cnn(width)
        if batches is None:
            gen = torch.Generator().manual_seed(seed)
            batches = [(torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 100, (batch,), generator=gen))
                       for _ in range(BATCHES_KEPT)]
        self.loss_fn = loss_fn
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.send_buffer = torch.empty(sum(p.numel() for p in self.model.parameters()))
        self.stream = None
        if device != "cpu":
            self.stream = training_stream(device)  # first: it refuses cleanly without CUDA
            self.model.to(device)
            batches = [(x.to(device), y.to(device)) for x, y in batches]
            self.stream.wait_stream(torch.cuda.current_stream())  # the copies above come first
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self.batches = batches
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.bandwidth_mbps = 1000.0

    @classmethod
    def from_workload(cls, spec: str, options: dict | None, batch: int, device: str = "cpu",
                      seed: int = 0) -> "TrainingJob":
        """One of the runtime's workloads (tasks.runtime.workloads), e.g. resnet110-cifar100."""
        workload = build_workload(spec, options or {})
        made = list(itertools.islice(workload.batches(batch, seed), BATCHES_KEPT))
        return cls(batch, seed=seed, device=device, model=workload.model.train(), batches=made,
                   loss_fn=workload.loss_fn, name=workload.name)

    @property
    def param_mb(self) -> float:
        """S in MB (10^6 bytes, the profiles' unit)."""
        return self.param_bytes / 1e6

    def transfer_s(self) -> float:
        """Push gradients + pull parameters over the shaped link: 2 * S / B."""
        return 2 * self.param_bytes * 8 / (self.bandwidth_mbps * 1e6)

    def set_bubble(self, comm_s: float) -> None:
        """Pick the link bandwidth that makes one step's communication last `comm_s`."""
        self.bandwidth_mbps = 2 * self.param_bytes * 8 / (comm_s * 1e6)

    def compute(self, step: int) -> float | None:
        """One step; on CUDA returns its time on the device (s), else None (the host's clock)."""
        if self.stream is None:
            self._compute(step)
            return None
        with torch.cuda.stream(self.stream):
            self._start.record(self.stream)
            self._compute(step)
            self._end.record(self.stream)
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1e3

    def _compute(self, step: int) -> None:
        inputs, labels = self.batches[step % len(self.batches)]
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(inputs), labels)
        loss.backward()
        self.optimizer.step()

    def communicate(self) -> None:
        start = time.perf_counter()
        grads = [p.grad.flatten() for p in self.model.parameters()]
        if self.stream is None:
            torch.cat(grads, out=self.send_buffer)
        else:
            with torch.cuda.stream(self.stream):
                self.send_buffer.copy_(torch.cat(grads))  # to the host: waits for the copy
        remaining_s = self.transfer_s() - (time.perf_counter() - start)
        if remaining_s > 0:
            time.sleep(remaining_s)

    def run(self, steps: int, listener: PhaseListener, first_step: int = 0) -> list[float]:
        """Run `steps` steps, marking phase edges; returns each step's wall time (s)."""
        times = []
        for step in range(first_step, first_step + steps):
            t0 = time.perf_counter()
            listener.compute_start(step)
            device_s = self.compute(step)
            if device_s is None:
                listener.compute_end(step)
            else:
                listener.compute_end(step, device_s)
            listener.comm_start(step)
            self.communicate()
            listener.comm_end(step)
            times.append(time.perf_counter() - t0)
        return times
