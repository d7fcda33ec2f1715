"""One instance, g GPUs: g replicas of the model, one per GPU, behind one PS worker.

spotDNN's model treats an instance with g GPUs as one worker that computes g x batch_per_gpu
samples per iteration and sums its GPUs' gradients over PCIe before one push (the 2 g S / Bpcie
term of Eq. 8). So a worker with `gpus` > 1 runs g replicas: the worker's own loop is replica 0
(the only one linked to the PS, which sees one worker per instance), replicas 1..g-1 are threads
of the same process, each with its own copy of the model on its own device, at batch_per_gpu.
A revocation, a crash or SIGKILL ends the process, so it ends every replica together.

Per iteration, on a local process group inside the instance (gloo on CPU, NCCL on CUDA, one rank
per replica on an in-process store):
- hand-out: replica 0 receives the pull once, then broadcasts a go signal and the state vector;
- every replica computes forward and backward on its own batch (padded to the type's speed);
- the sum: the flat push vectors (gradients + BatchNorm buffers) are summed and divided by g (the
  mean over the instance's g x batch_per_gpu samples, as one batch of that size) bucket by bucket
  while backward runs (buckets.py), then the losses; replica 0 then pushes the result once to
  every PS shard.
The sum is paced to the emulated PCIe link when `pcie_mbps` is given (the local provider passes
the type's PCIe bandwidth): its buckets hold the link for at least 2 g S / Bpcie in all, the
model's term. The push trailer carries the part of it left exposed after compute (`intra_sum_s`,
what the iteration waits for: the model's PCIe term as measured) and the link's busy time
(`intra_sum_link_s`) (telemetry). `early=False` starts every bucket after backward (the
benchmark's "before"). A replica that fails still joins the collectives with a flag, so replica 0
raises its error instead of waiting on a peer that is gone.

Each replica has its own phase edges (inference filling fills every GPU's bubbles): `scope(rank)`
is entered in replica `rank`'s thread for its whole life and yields its PhaseListener. A replica's
compute phase is its step; its communication phase runs from the end of its step (the sum, replica
0's push and pull) to the next hand-out.
"""
from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
from torch.distributed import HashStore, ProcessGroupGloo

from tasks.core.phases import NoListener, PhaseListener
from tasks.runtime.buckets import BucketSum
from tasks.runtime.flat import FlatModel

GO, STOP = 1.0, 0.0


def local_group(store: HashStore, rank: int, size: int, device: torch.device, timeout_s: float):
    """A process group of the instance's replicas: NCCL between GPUs, gloo on the CPU."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL  # deferred: only CUDA builds have it

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, size, options)
    return ProcessGroupGloo(store, rank, size, timeout)


def pcie_floor_s(gpus: int, numel: int, pcie_mbps: float | None) -> float:
    """The model's PCIe term for one iteration, 2 g S / Bpcie (S the push vector's bytes, Bpcie in
    megabits/s); 0 when the link is not emulated."""
    if not pcie_mbps:
        return 0.0
    return 2.0 * gpus * numel * 4 * 8 / (pcie_mbps * 1e6)


class InstanceSum(NamedTuple):
    """One iteration's sum, as replica 0 sees it."""

    loss: float  # the replicas' mean loss
    exposed_s: float  # what replica 0 waited for after its compute (intra_sum_s)
    link_s: float  # the seconds the link was busy with the buckets (intra_sum_link_s)
    dropped: bool  # a replica started a bucket before a gradient in it was final (buckets.py)


class IntraLink:
    """Replica `rank`'s end of the instance's local group: hand-out of the state, the bucketed
    sum of the push (`buckets`, armed at each hand-out), the sum of the losses."""

    def __init__(self, group, rank: int, gpus: int, device: torch.device, buckets: BucketSum):
        self.group, self.rank, self.gpus, self.buckets = group, rank, gpus, buckets
        self._control = torch.zeros(1, device=device)
        self._totals = torch.zeros(3, device=device)  # [loss, replicas that failed, replicas that dropped]

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()

    def hand_out(self, state: torch.Tensor, go: bool, step_s: float | None = None) -> bool:
        """Replica 0: send the go (or stop) signal and, on go, the state; the others receive them.
        Returns whether to compute this iteration (the buckets then armed: `step_s`, buckets.py)."""
        if self.rank == 0:
            self._control.fill_(GO if go else STOP)
        self._broadcast(self._control)
        if self._control.item() != GO:
            return False
        self._broadcast(state)
        self.buckets.arm(step_s)
        return True

    def sum(self, loss: float, failed: bool) -> tuple[InstanceSum, int]:
        """Every bucket of the push summed (those not started yet start now: a failed replica's
        zeros or stand-ins; the result is not used then), then the losses: (the sum, replicas
        that failed)."""
        t0 = time.monotonic()
        self.buckets.compute_done()
        link_s = self.buckets.wait()
        self._totals[0], self._totals[1] = 0.0 if failed else loss, 1.0 if failed else 0.0
        self._totals[2] = 1.0 if self.buckets.dropped else 0.0
        self.group.allreduce([self._totals]).wait()
        failures = int(round(self._totals[1].item()))
        ok = self.gpus - failures
        mean_loss = self._totals[0].item() / ok if ok else float("nan")
        return InstanceSum(mean_loss, time.monotonic() - t0, link_s, self._totals[2].item() > 0), failures


class Replicas:
    """Replica 0's handle on the others: starts their threads, hands out each pull, sums each push,
    and ends them (`close`) however the worker's loop ends.

    `bound` is replica 0's flat model (its push is what the sum fills). `build(rank)` returns
    (flat model, step) for replica `rank`: `step(push_complete)` computes one forward/backward on
    the replica's own batch, calls `push_complete()` once its push vector is filled, pads to the
    type's speed and returns (loss, the padded step's seconds or None). `scope(rank)` (default: no
    listener) wraps replica `rank`'s thread and yields its PhaseListener.
    """

    def __init__(self, gpus: int, devices: list[torch.device], bound: FlatModel, pcie_mbps: float | None,
                 timeout_s: float, build: Callable[[int], tuple],
                 scope: Callable[[int], AbstractContextManager[PhaseListener]] | None = None, early: bool = True):
        store = HashStore()
        self.gpus, self.devices = gpus, devices
        self.numel, self.param_numel = bound.layout.numel, bound.layout.param_numel
        self.link_s_per_numel = pcie_floor_s(gpus, 1, pcie_mbps)
        self.early = early
        self.errors: dict[int, BaseException] = {}
        self._handed = False  # the replicas compute and will join a sum next
        self._closed = False
        self._scope = scope or (lambda rank: contextlib.nullcontext(NoListener()))
        groups: dict[int, object] = {}

        def make_group(rank: int) -> None:
            if devices[rank].type == "cuda":
                torch.cuda.set_device(devices[rank])
            groups[rank] = local_group(store, rank, gpus, devices[rank], timeout_s)

        # every rank's group is built at once: each waits in the store for the others
        makers = [threading.Thread(target=make_group, args=(r,), daemon=True) for r in range(1, gpus)]
        for maker in makers:
            maker.start()
        make_group(0)
        for maker in makers:
            maker.join()
        self.link = IntraLink(groups[0], 0, gpus, devices[0], self._bucket_sum(groups[0], bound.push, bound))
        self._threads = []
        for rank in range(1, gpus):
            thread = threading.Thread(target=self._serve, args=(rank, groups[rank], devices[rank], build), daemon=True,
                                      name=f"replica-{rank}")
            thread.start()
            self._threads.append(thread)

    def _bucket_sum(self, group, push: torch.Tensor, bound: FlatModel | None) -> BucketSum:
        return BucketSum(group, self.gpus, push, self.param_numel, bound, self.link_s_per_numel, self.early)

    def _serve(self, rank: int, group, device: torch.device, build) -> None:
        """Replicas 1..g-1: wait for the state, compute, join the sum; until told to stop. A failure
        (its own batch, its GPU, its scope) is kept for replica 0 to raise; this replica goes on
        joining the collectives with a flag, so nobody waits for it."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with contextlib.ExitStack() as stack:
            listener: PhaseListener = NoListener()
            bound = None
            try:
                listener = stack.enter_context(self._scope(rank))
                bound, step = build(rank)
            except BaseException as err:  # no model: stand-ins of the right size keep the collectives going
                self.errors[rank] = err
            state = bound.state if bound is not None else torch.zeros(self.numel, device=device)
            push = bound.push if bound is not None else torch.zeros(self.numel, device=device)
            link = IntraLink(group, rank, self.gpus, device, self._bucket_sum(group, push, bound))
            stack.callback(link.buckets.close)
            iteration, padded_s = 0, None
            while link.hand_out(state, go=True, step_s=padded_s):
                if iteration:
                    listener.comm_end(iteration - 1)
                loss, failed = 0.0, rank in self.errors
                if not failed:
                    try:
                        listener.compute_start(iteration)
                        loss, padded_s = step(self._push_complete(link))
                        listener.compute_end(iteration)
                    except BaseException as err:
                        self.errors[rank] = err
                        failed = True
                listener.comm_start(iteration)
                link.sum(loss, failed)
                iteration += 1
            if iteration:
                listener.comm_end(iteration - 1)

    def _push_complete(self, link: IntraLink) -> Callable[[], None]:
        """What a replica does once its push vector is complete: start the buckets backward has not
        started; with `early` off, nothing: every bucket starts in the sum, after the padded compute
        (the sum as it was before it overlapped backward)."""
        return link.buckets.compute_done if self.early else (lambda: None)

    def hand_out(self, state: torch.Tensor, step_s: float | None = None) -> None:
        """The pull, received once by replica 0, to every replica; replica 0's buckets armed
        (`step_s`: its previous step's emulated seconds when padded, buckets.py)."""
        self.link.hand_out(state, go=True, step_s=step_s)
        self._handed = True

    def compute_done(self) -> None:
        """Replica 0's push vector is complete: its buckets not yet started start (with `early`
        off, in the sum)."""
        self._push_complete(self.link)()

    def sum(self, loss: float) -> InstanceSum:
        """The instance's mean push into replica 0's push vector, and the mean loss. A replica's
        failure is raised here."""
        result, failures = self.link.sum(loss, failed=False)
        self._handed = False
        if failures:
            rank, err = min(self.errors.items())
            sys.stderr.write(f"spotfill worker: replica {rank} of {self.gpus} failed\n")
            raise err
        return result

    def close(self) -> None:
        """End the replicas: a sum they are waiting for (replica 0 failed mid-iteration) is joined
        with a flag, then the stop signal."""
        if self._closed:
            return
        self._closed = True
        if self._handed:
            self.link.sum(0.0, failed=True)
        self.link.hand_out(torch.zeros(0), go=False)
        for thread in self._threads:
            thread.join()
        self.link.buckets.close()
