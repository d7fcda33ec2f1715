"""A stand-alone training loop with real bubbles, for the bench and tests (the runtime has its own).

Compute phase: forward/backward/SGD step of a small CNN on seeded synthetic data, with torch's
intra-op threads. Communication phase: the gradients are copied into a send buffer (real work),
then the worker waits until the shaped transfer time of push + pull, 2 * S / B, has passed since
the phase began. The local provider's network emulation is time-based too, so a timed wait is a
faithful stand-in for a worker blocked on its parameter server.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from tasks.phases import PhaseListener


class TrainingJob:
    """On CUDA the step runs on a highest-priority stream and compute_end is marked after that
    stream has finished, so the phase edges are the device's, not the launch's."""

    def __init__(self, batch: int = 64, width: int = 32, seed: int = 0, device: str = "cpu"):
        torch.manual_seed(seed)
        self.device = device
        self.batch = batch
        self.model = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * width * 8 * 8, 100),
        )
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(8 * batch, 3, 32, 32, generator=gen)
        self.labels = torch.randint(0, 100, (8 * batch,), generator=gen)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.send_buffer = torch.empty(sum(p.numel() for p in self.model.parameters()))
        self.stream = None
        if device != "cpu":
            from tasks.filling.executor import training_stream

            self.model.to(device)
            self.inputs, self.labels = self.inputs.to(device), self.labels.to(device)
            self.send_buffer = self.send_buffer.to(device)
            self.stream = training_stream(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.bandwidth_mbps = 1000.0

    def transfer_s(self) -> float:
        """Push gradients + pull parameters over the shaped link: 2 * S / B."""
        return 2 * self.param_bytes * 8 / (self.bandwidth_mbps * 1e6)

    def set_bubble(self, comm_s: float) -> None:
        """Pick the link bandwidth that makes one step's communication last `comm_s`."""
        self.bandwidth_mbps = 2 * self.param_bytes * 8 / (comm_s * 1e6)

    def compute(self, step: int) -> None:
        if self.stream is None:
            self._compute(step)
            return
        with torch.cuda.stream(self.stream):
            self._compute(step)
        self.stream.synchronize()

    def _compute(self, step: int) -> None:
        i = (step % 8) * self.batch
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(self.inputs[i:i + self.batch]),
                                           self.labels[i:i + self.batch])
        loss.backward()
        self.optimizer.step()

    def communicate(self) -> None:
        start = time.perf_counter()
        torch.cat([p.grad.flatten() for p in self.model.parameters()], out=self.send_buffer)
        remaining_s = self.transfer_s() - (time.perf_counter() - start)
        if remaining_s > 0:
            time.sleep(remaining_s)

    def run(self, steps: int, listener: PhaseListener, first_step: int = 0) -> list[float]:
        """Run `steps` steps, marking phase edges; returns each step's wall time (s)."""
        times = []
        for step in range(first_step, first_step + steps):
            t0 = time.perf_counter()
            listener.compute_start(step)
            self.compute(step)
            listener.compute_end(step)
            listener.comm_start(step)
            self.communicate()
            listener.comm_end(step)
            times.append(time.perf_counter() - t0)
        return times
