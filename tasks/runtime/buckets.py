"""A multi-GPU instance's gradient sum, bucket by bucket while backward still runs (as DDP does).

Each replica's push vector (flat.py) is cut into buckets: the gradients' region in pieces of at
most PIECE_MB and at least MIN_BUCKETS of them (a small model overlaps too), then the buffers'.
A bucket's sum over the instance's local group (replicas.py) starts once every parameter gradient
it holds is final (torch's post-accumulate-grad hook); the buffers' buckets, and buckets holding
no trainable parameter, start when compute ends. So most of the sum crosses the instance's link
while backward still computes the earlier layers' gradients, and what is left exposed after
compute is the last buckets' share.

A collective must be issued in the same order on every replica, so buckets start in one fixed
order: the gradients' from the end of the vector to its start (the order backward makes them),
then the buffers'; a bucket ready before an earlier one waits for it. A sender thread per replica
issues them one at a time (the link carries one at a time), each divided by g once summed (the
instance's mean gradient) and, when the link is emulated, paced to its share of the PCIe term
2 g S / Bpcie.

Emulated compute: a worker pads its step to the type's speed (worker.py), so its real backward is
a fraction of the step it stands for; its buckets would all be ready early and the whole sum would
hide behind the padding. So when the step is padded (`arm(step_s)`: the emulated step's seconds)
the k-th of K gradient buckets starts no earlier than where the emulated GPU would make it:
`FORWARD_SHARE` of the step is forward, backward makes the buckets evenly over the rest, the last
as compute ends. The same on every replica (not each one's real timing scaled up, which would
multiply a loaded host's jitter by the padding and have every collective wait for the slowest).

A parameter whose gradient accumulates more than once in one backward (shared weights across
reentrant checkpoint segments) would let its bucket start before its last contribution. As for
the push (push.py): the first iteration starts nothing early and counts accumulations; early
starts begin from the second only if none accumulated twice; should one accumulate twice later,
that iteration's sum is `dropped` (the worker tells the PS, which does not apply it) and later
buckets all start after backward.

On CUDA a hook records an event on the compute stream and on the stream autograd accumulated on;
the sender thread's stream waits for them before the collective, and for the collective before
the bucket counts as done.
"""
from __future__ import annotations

import queue
import sys
import threading
import time

import torch

from tasks.runtime.flat import FlatModel, synced_tensors
from tasks.runtime.pieces import PIECE_MB, pieces, piece_numel_for

MIN_BUCKETS = 8
FORWARD_SHARE = 1 / 3  # of an emulated step: backward takes about twice forward (two products per forward one)


def bucket_ranges(param_numel: int, numel: int, piece_mb: float = PIECE_MB) -> list[tuple[int, int]]:
    """[lo, hi) buckets of a push vector of `numel` elements whose first `param_numel` are
    gradients, in the order they start: the gradients' from the end, then the buffers'. Every
    replica cuts the same (one layout)."""
    size = max(1, min(piece_numel_for(piece_mb), -(-param_numel // MIN_BUCKETS)))
    grads = pieces(param_numel, size)[::-1]
    return grads + [(param_numel + lo, param_numel + hi) for lo, hi in pieces(numel - param_numel, size)]


def emulated_ready_s(j: int, grad_buckets: int, step_s: float) -> float:
    """Seconds into an emulated step of `step_s` at which its backward makes gradient bucket `j`
    (of `grad_buckets`, in start order): forward first, then the buckets evenly."""
    return step_s * (FORWARD_SHARE + (1 - FORWARD_SHARE) * (j + 1) / grad_buckets)


class BucketSum:
    """One replica's end of the bucketed sum. Per iteration: `arm(step_s)` before its forward,
    backward (the hooks start buckets), `compute_done()` once its push vector is complete (the
    rest start), then `wait()`: the seconds the link was busy with them.

    `bound`: the replica's flat model (None: a stand-in push of the layout's size, for a replica
    that could not build its model: it joins every collective with zeros). `early=False` starts
    every bucket after backward (the sum not overlapped: the benchmark's before, where the caller
    leaves `compute_done` to the sum itself, after the padded compute)."""

    def __init__(self, group, gpus: int, push: torch.Tensor, param_numel: int, bound: FlatModel | None,
                 link_s_per_numel: float, early: bool = True):
        self.group, self.gpus, self.push = group, gpus, push
        self.link_s_per_numel = link_s_per_numel
        self.buckets = bucket_ranges(param_numel, push.numel())
        self._grad_buckets = sum(1 for _, hi in self.buckets if hi <= param_numel)
        self.on_cuda = push.device.type == "cuda"
        # which buckets each trainable parameter's gradient lies in, and how many such gradients
        # each bucket waits for; a bucket of none waits for compute_done (1)
        self._buckets_of: dict[int, list[int]] = {}
        counts = [0] * len(self.buckets)
        params = synced_tensors(bound.model)[0] if bound is not None else []
        for index, (param, lo) in enumerate(zip(params, bound.layout.offsets if bound is not None else ())):
            if not param.requires_grad:
                continue
            hi = lo + param.numel()
            inside = [j for j, (a, b) in enumerate(self.buckets) if a < hi and lo < b]
            self._buckets_of[index] = inside
            for j in inside:
                counts[j] += 1
            param.register_post_accumulate_grad_hook(self._hook(index))
        self._waits_for = [n or 1 for n in counts]
        self.early: bool | None = None if early else False  # None until the first backward has shown whether it is safe
        self.dropped = False  # this iteration started a bucket that took a later contribution
        self._armed = False
        self._waiting: list[int] = []
        self._accumulated: dict[int, int] = {}
        self._next = len(self.buckets)  # the next bucket to start; all started: nothing pending
        self._t0, self._step_s = 0.0, None
        self._busy_s = 0.0
        self._error: BaseException | None = None
        if self.on_cuda:
            self._device = push.device
            self._compute_stream = torch.cuda.current_stream(push.device)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._send_ready_buckets, daemon=True, name="replica-sum")
        self._thread.start()

    def arm(self, step_s: float | None = None) -> None:
        """A new iteration, its compute starting: nothing started yet. `step_s`: the emulated step's
        seconds when the replica pads its compute (None: buckets start as they are ready)."""
        self._waiting = list(self._waits_for)
        self._accumulated = {}
        self.dropped = False
        self._next = 0
        self._t0, self._step_s = time.monotonic(), step_s
        self._busy_s = 0.0
        self._armed = True

    def _hook(self, index: int):
        def on_accumulated(_param: torch.Tensor) -> None:
            if not self._armed:
                return
            count = self._accumulated[index] = self._accumulated.get(index, 0) + 1
            if count != 1 or not self.early:
                return
            for j in self._buckets_of[index]:
                self._waiting[j] -= 1
            self._start_ready()
        return on_accumulated

    def _start_ready(self) -> None:
        """Start every bucket from the next one on that is ready, in the fixed order."""
        while self._next < len(self.buckets) and self._waiting[self._next] <= 0:
            events = []
            if self.on_cuda:  # final once the compute stream and autograd's current stream reach here
                streams = {self._compute_stream, torch.cuda.current_stream(self._device)}
                events = [torch.cuda.Event() for _ in streams]
                for event, stream in zip(events, streams):
                    event.record(stream)
            self._queue.put((self._next, time.monotonic(), events))
            self._next += 1

    def compute_done(self) -> None:
        """The push vector is complete (gradients and buffers): every bucket not yet started starts.
        Called again (a failure between compute and the sum), it starts nothing twice."""
        if not self._armed:
            return
        self._armed = False
        once = all(n == 1 for n in self._accumulated.values())
        if self.early and not once:
            self.dropped, self.early = True, False
            sys.stderr.write("spotfill worker: a parameter's gradient accumulated twice in one backward after its "
                             "bucket's sum had started; this iteration is dropped, and later sums start after backward\n")
        elif self.early is None:
            self.early = once
        self._waiting = [0] * len(self.buckets)
        self._start_ready()

    def _send_ready_buckets(self) -> None:
        """The sender thread: each bucket, at its emulated start, summed over the group and paced."""
        if self.on_cuda:
            torch.cuda.set_device(self._device)
        while True:
            item = self._queue.get()
            if item is None:  # close()
                return
            j, ready_s, events = item
            try:
                if self._error is None:
                    self._sum_bucket(j, ready_s, events)
            except BaseException as err:  # raised by wait()
                self._error = err
            finally:
                self._queue.task_done()

    def _start_s(self, j: int, ready_s: float) -> float:
        """When bucket `j`, ready at `ready_s`, starts: on an emulated step, not before the emulated
        GPU would have made it (the buffers' as its compute ends)."""
        if self._step_s is None:
            return ready_s
        offset_s = emulated_ready_s(j, self._grad_buckets, self._step_s) if j < self._grad_buckets else self._step_s
        return max(ready_s, self._t0 + offset_s)

    def _sum_bucket(self, j: int, ready_s: float, events: list) -> None:
        start_s = self._start_s(j, ready_s)
        now_s = time.monotonic()
        if start_s > now_s:
            time.sleep(start_s - now_s)
        t0 = time.monotonic()
        lo, hi = self.buckets[j]
        bucket = self.push[lo:hi]
        if self.on_cuda:
            stream = torch.cuda.current_stream(self._device)
            for event in events:
                stream.wait_event(event)
        self.group.allreduce([bucket]).wait()
        bucket.div_(self.gpus)
        if self.on_cuda:
            torch.cuda.current_stream(self._device).synchronize()
        floor_s = self.link_s_per_numel * (hi - lo)
        elapsed_s = time.monotonic() - t0
        if floor_s > elapsed_s:
            time.sleep(floor_s - elapsed_s)
        self._busy_s += time.monotonic() - t0

    def wait(self) -> float:
        """Every started bucket summed: the seconds the link was busy with this iteration's
        buckets. A bucket's failure is raised here."""
        self._queue.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._busy_s

    def close(self) -> None:
        """End the sender thread (after the last wait)."""
        self._queue.put(None)
        self._thread.join()
