"""A worker's push leaves in pieces while backward is still running.

Autograd fills the gradient part of the flat push vector (flat.py) from the last layer to the
first. The vector is cut into pieces (pieces.py), each inside one PS shard's range; a piece is
sent the moment every parameter gradient it holds is final (torch's post-accumulate-grad hook),
so most of the push crosses the link while backward still computes the earlier layers'
gradients. What is left (the last pieces, the buffers' part, the pieces of parameters that got no
gradient) leaves when compute ends.

Per push and shard the link carries: a header (gloo tag 0) as compute starts, so the PS posts its
receives at once; piece i of the shard's range on tag i + 1; then the trailer, the header again
with the loss and the compute and communication times (tag 0), after which the PS applies.

A parameter whose gradient accumulates more than once in one backward (a weight shared across
reentrant activation-checkpoint segments) would let its piece leave before its last
contribution. So the first push sends nothing early and counts each parameter's accumulations;
early sending starts from the second push only if none accumulated twice. Should one accumulate
twice later on (data-dependent control flow), that push is dropped (`dropped`: the worker tells
the PS, which does not apply it) and every later push leaves after backward.

On CUDA the hook only records an event on the compute stream (and on the stream autograd
accumulated on, where that differs); a sender thread waits for it on a
copy stream, copies the piece to pinned host memory and sends it: neither the autograd thread nor
the compute stream waits on the bus or the link.
"""
from __future__ import annotations

import queue
import sys
import threading

import torch

from tasks.runtime.flat import FlatModel, synced_tensors
from tasks.runtime.pieces import holding, shard_pieces


class BusCopyFailed(Exception):
    """A piece's copy over the bus failed (a CUDA error), to host memory (the push) or from it (the
    pull): the worker's own failure, not a lost link (not a RuntimeError, which the worker takes
    for one)."""


class Pusher:
    """Sends a worker's pushes to its PS shards, piece by piece as backward finishes them.

    `start(links, headers)` as compute starts, then backward (the hooks send), `compute_done()`
    once the push vector is complete on its device, and `finish(trailers)` in the communication
    phase: it sends what is left and the trailers and returns when every send is done. A failed
    transfer raises RuntimeError from `finish` (the worker takes it for a lost link), a failed
    bus copy BusCopyFailed.

    `threaded` (default: on CUDA) sends from `host_push` through the sender thread, which copies
    each piece there first; otherwise the hooks send straight from the push vector (CPU:
    `host_push` is the push vector).

    `overlap=False` sends nothing during backward: a multi-GPU worker's push is the sum of its
    replicas' gradients (replicas.py), complete only after that sum; `compute_done()` then comes
    after it."""

    def __init__(self, bound: FlatModel, ranges: list[tuple[int, int]], host_push: torch.Tensor, piece_numel: int,
                 threaded: bool | None = None, overlap: bool = True):
        params, param_numel = synced_tensors(bound.model)[0], bound.layout.param_numel
        self.push, self.host_push = bound.push, host_push
        self.on_cuda = self.push.device.type == "cuda"
        self.threaded = self.on_cuda if threaded is None else threaded
        if self.threaded and host_push.data_ptr() == self.push.data_ptr():
            raise ValueError("a threaded push sends from a host buffer of its own, not from the push vector")
        self.pieces = shard_pieces(ranges, piece_numel)
        # which pieces each trainable parameter's gradient lies in, and how many such gradients
        # each piece waits for (+1 for a piece holding buffers, which are filled after backward)
        self._pieces_of: dict[int, list[int]] = {}
        self._waits_for = [1 if p.hi > param_numel else 0 for p in self.pieces]
        for index, (param, lo) in enumerate(zip(params, bound.layout.offsets)):
            hi = lo + param.numel()
            if not param.requires_grad:
                continue
            inside = holding(self.pieces, lo, hi)
            self._pieces_of[index] = inside
            for j in inside:
                self._waits_for[j] += 1
            param.register_post_accumulate_grad_hook(self._hook(index))
        self.early: bool | None = None if overlap else False  # None until the first push has shown whether it is safe
        self._armed = False
        self._accumulated: dict[int, int] = {}
        self.dropped = False  # this push sent a piece early that took a later contribution
        self._waiting: list[int] = []
        self._sent: list[bool] = []
        self._links: list = []
        self._works: list = []
        self._error: Exception | None = None  # a send's or copy's failure, raised by finish()
        if self.on_cuda:
            self._compute_stream = torch.cuda.current_stream(self.push.device)
            self._copy_stream = torch.cuda.Stream(self.push.device)
        if self.threaded:
            self._queue: queue.Queue = queue.Queue()
            threading.Thread(target=self._send_ready_pieces, daemon=True, name="push").start()

    def start(self, links: list, headers: list[torch.Tensor]) -> None:
        self._links = links
        self._works = [link.start_send(h) for link, h in zip(links, headers)]
        self._waiting = list(self._waits_for)
        self._sent = [False] * len(self.pieces)
        self._accumulated = {}
        self.dropped = False
        self._armed = True

    def _hook(self, index: int):
        def on_accumulated(_param: torch.Tensor) -> None:
            if not self._armed:
                return
            count = self._accumulated[index] = self._accumulated.get(index, 0) + 1
            if count != 1 or not self.early:
                return
            for j in self._pieces_of[index]:
                self._waiting[j] -= 1
                if self._waiting[j] == 0:
                    self._send(j)
        return on_accumulated

    def _send(self, j: int) -> None:
        self._sent[j] = True
        if self.threaded:
            ready = []
            if self.on_cuda:
                # the piece is final once the compute stream and the stream autograd accumulated on
                # (current in the hook: the forward's, which a plug-in may have switched) reach here
                streams = {self._compute_stream, torch.cuda.current_stream(self.push.device)}
                ready = [torch.cuda.Event() for _ in streams]
                for event, stream in zip(ready, streams):
                    event.record(stream)
            self._queue.put((j, ready))
        elif self._error is None:
            piece = self.pieces[j]
            try:
                self._works.append(self._links[piece.shard].start_send(self.host_push[piece.lo:piece.hi], piece.tag))
            except RuntimeError as err:  # inside backward: raised by finish(), as a lost link
                self._error = err

    def _send_ready_pieces(self) -> None:
        """CUDA: the sender thread. Each piece, once the compute stream has made it: copied over
        the bus on the copy stream, then handed to the link."""
        while True:
            item = self._queue.get()
            if item is None:  # close()
                return
            j, ready = item
            try:
                if self._error is None:
                    piece = self.pieces[j]
                    try:
                        self._copy_out(piece, ready)
                    except RuntimeError as err:
                        raise BusCopyFailed(str(err)) from err
                    self._works.append(self._links[piece.shard].start_send(self.host_push[piece.lo:piece.hi], piece.tag))
            except BaseException as err:  # raised by finish(): a failed copy as itself, a failed send as a RuntimeError
                self._error = err
            finally:
                self._queue.task_done()

    def _copy_out(self, piece, ready: list) -> None:
        """The piece into host_push: over the bus on the copy stream once `ready` has passed (CUDA)."""
        if not self.on_cuda:
            self.host_push[piece.lo:piece.hi].copy_(self.push[piece.lo:piece.hi])
            return
        with torch.cuda.stream(self._copy_stream):
            for event in ready:
                self._copy_stream.wait_event(event)
            self.host_push[piece.lo:piece.hi].copy_(self.push[piece.lo:piece.hi], non_blocking=True)
            self._copy_stream.synchronize()

    def compute_done(self) -> None:
        """The push vector is complete (backward and the buffers' copy are queued): every piece not
        yet sent goes now (queued to the sender thread on CUDA, sent by `finish` on CPU)."""
        self._armed = False
        once = all(n == 1 for n in self._accumulated.values())
        if self.early and not once:
            self.dropped, self.early = True, False
            sys.stderr.write("spotfill worker: a parameter's gradient accumulated twice in one backward after its "
                             "piece had left; this push is dropped, and later pushes leave after backward\n")
        elif self.early is None:
            self.early = once
            if not once:
                sys.stderr.write("spotfill worker: a parameter's gradient accumulates more than once per "
                                 "backward; the push leaves after backward, not during it\n")
        if self.threaded:
            self._send_rest()

    def _send_rest(self) -> None:
        for j, sent in enumerate(self._sent):
            if not sent:
                self._send(j)

    def close(self) -> None:
        """End the sender thread (CUDA): a process may run several workers in turn (the bench)."""
        if self.threaded:
            self._queue.put(None)

    def finish(self, trailers: list[torch.Tensor]) -> None:
        """Send what is left and the trailers; return once every send of this push is done."""
        if self.threaded:
            self._queue.join()
        else:
            self._send_rest()
        if self._error is not None:
            err, self._error, self._works = self._error, None, []
            raise err
        self._works += [link.start_send(t) for link, t in zip(self._links, trailers)]
        works, self._works = self._works, []
        for work in works:
            work.wait()
