"""Compute phases timed by the GPU: CUDA events around the training step, for the guard.

On a GPU the host's clock between compute_start and compute_end measures kernel launches plus
whatever the host waited for; the step's time on the device is the pair of events recorded on the
training stream around it (enable_timing). `DeviceTimedPhases` wraps a filler (a PhaseListener):
it records the events at the edges and hands the filler the device's compute time, which the
guard then compares with its rolling clean baseline. compute_end waits for the end event; a loop
that calls it after its step has finished (the worker copies the gradients to the host first, the
bench's loop synchronizes its stream) never waits there. In a runtime worker the phase starts
before the pull has landed (forward waits for each piece on the device), so its device time holds
what forward waited for the link too; the guard's clean baseline is timed the same way.
"""
from __future__ import annotations

import torch

from tasks.filling.executor import require_cuda


class DeviceTimedPhases:
    def __init__(self, filler, stream: "torch.cuda.Stream | None" = None):
        require_cuda("device-timed compute phases")
        self.filler = filler
        self.stream = stream  # None: the stream current at each edge (the worker's default one)
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def _stream(self) -> "torch.cuda.Stream":
        return self.stream or torch.cuda.current_stream()

    def compute_start(self, step: int) -> None:
        self._start.record(self._stream())
        self.filler.compute_start(step)

    def compute_end(self, step: int, compute_s: float | None = None) -> None:
        self._end.record(self._stream())
        self._end.synchronize()
        self.filler.compute_end(step, self._start.elapsed_time(self._end) / 1e3)

    def comm_start(self, step: int) -> None:
        self.filler.comm_start(step)

    def comm_end(self, step: int) -> None:
        self.filler.comm_end(step)

    def metrics(self) -> dict:
        return self.filler.metrics()

    def pause(self) -> None:
        self.filler.pause()

    def resume(self) -> None:
        self.filler.resume()

    def close(self) -> None:
        self.filler.close()
