"""Where chunks run. Each lane thread calls `lane_setup(lane)` once, then `run(chunk)` per chunk;
`run` returns when the chunk's work is complete, so the caller's timing is the chunk's busy time.
`run` returns the chunk's duration as the device measured it (CUDA events), or None when the
caller's host clock is the measure (CPU); the cost models learn from it.

CPU: inference runs in lane threads of the training process, on the same cores. torch's intra-op
thread count is per calling thread with the OpenMP backend (measured: set_num_threads(1) in a lane
leaves the training thread at its own count), so each lane pins its own count without touching
training's: `intra_op_threads` for offline and shared lanes, one for an online lane (its chunks
are a few requests: 0.65 ms for one CNN request on one thread here, 0.49 ms on two, so a second
thread buys little and would take the other core from training when it runs outside a bubble).
Keep offline lanes at one thread where training's threads fill the cores: a lane on two starts a
second OpenMP team, and once the teams' threads outnumber the cores libgomp shortens every team's
spin-wait, so training's own threads sleep and wake between its parallel regions (its compute
phase ran 1.2-1.3x slower next to such a lane, and 2-2.6x while the lane sat paused).
With `online_priority="realtime"` the online lane's thread runs SCHED_FIFO: during training's
compute a request then preempts training's threads (1.3-1.6 ms at the median, measured) instead of
sharing the cores with them (5-8 ms); the gate's online reserve bounds how much of training's time
that takes. CUDA: each lane owns a lowest-priority stream; the training side should run on
`training_stream()` (highest priority). Completion is tracked with an event the lane polls, so
only the lane waits, and timed by a pair of events (enable_timing) around the chunk, so a chunk's
cost is the GPU's time, not the launch's. Priorities do not preempt running kernels: the gate is
what isolates.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import torch

from tasks.filling.models import InferenceWorkload
from tasks.filling.scheduler import Chunk


ONLINE_FIFO_PRIORITY = 1  # the lowest real-time priority: above every normal thread, below the kernel's


class CpuExecutor:
    device = "cpu"

    def __init__(self, workload: InferenceWorkload, intra_op_threads: int, online_priority: str = "normal"):
        self.workload = workload
        self.intra_op_threads = intra_op_threads
        self.online_priority_wanted = online_priority
        self.online_priority: str | None = None  # what the online lane got (None: no online lane yet)
        self.online_priority_refused: str | None = None

    def lane_setup(self, lane: str) -> None:
        torch.set_num_threads(1 if lane == "online" else self.intra_op_threads)
        if lane == "online":
            self.online_priority = "normal"
            if self.online_priority_wanted == "realtime":
                self._make_realtime()

    def _make_realtime(self) -> None:
        """SCHED_FIFO for the calling thread (Linux applies it per thread). Refused without
        CAP_SYS_NICE: the lane then runs at normal priority and metrics report why."""
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(ONLINE_FIFO_PRIORITY))
        except (OSError, AttributeError) as err:
            self.online_priority_refused = f"SCHED_FIFO refused: {err}"
        else:
            self.online_priority = "realtime"

    def run(self, chunk: Chunk) -> None:
        with torch.inference_mode():
            self.workload.model(self.workload.batch(chunk.offline_start, chunk.batch))
        return None


def training_stream(device: str = "cuda") -> "torch.cuda.Stream":
    """A highest-priority CUDA stream for the training step, above the inference lanes' streams
    (priority_range() is (least, greatest); the greatest priority is the numerically smallest)."""
    require_cuda("the training stream")
    _least, greatest = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(device=device, priority=greatest)


def training_stream_scope(device: str):
    """A context in which a training loop on `device` runs on training_stream() (CUDA), so that
    its kernels go ahead of the inference lanes' queued ones; a no-op context on the CPU. CUDA's
    current stream is per thread: the lanes keep their own."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(training_stream(device))


def lowest_priority_stream(device) -> "torch.cuda.Stream":
    """A CUDA stream at the least priority (the numerically largest value of priority_range())."""
    require_cuda("an inference stream")
    least, _greatest = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(device=device, priority=least)


def require_cuda(what: str) -> None:
    """RuntimeError (one line) when torch sees no CUDA device: every CUDA entry point checks."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs CUDA, but torch sees no CUDA device")


class CudaExecutor:
    device = "cuda"

    def __init__(self, workload: InferenceWorkload, device: str = "cuda", poll_s: float = 1e-4):
        require_cuda("the CUDA executor")
        self.workload = workload.to(device)
        self.poll_s = poll_s
        self._lane = threading.local()

    def lane_setup(self, lane: str) -> None:
        self._lane.stream = lowest_priority_stream(self.workload.dataset.device)
        # The model and the dataset were copied on the stream current then: this lane's chunks
        # come after those copies.
        self._lane.stream.wait_stream(torch.cuda.current_stream(self.workload.dataset.device))
        self._lane.start = torch.cuda.Event(enable_timing=True)
        self._lane.done = torch.cuda.Event(enable_timing=True)

    def run(self, chunk: Chunk) -> float:
        lane = self._lane
        with torch.cuda.stream(lane.stream), torch.inference_mode():
            lane.start.record(lane.stream)
            self.workload.model(self.workload.batch(chunk.offline_start, chunk.batch))
            lane.done.record(lane.stream)
        while not lane.done.query():  # poll: only this lane waits, and it holds one chunk at most
            time.sleep(self.poll_s)
        return lane.start.elapsed_time(lane.done) / 1e3
