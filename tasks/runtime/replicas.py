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
  mean over the instance's g x batch_per_gpu samples, as one batch of that size), with the
  losses; replica 0 then pushes the result once to every PS shard.
The sum is paced to the emulated PCIe link when `pcie_mbps` is given (the local provider passes
the type's PCIe bandwidth): it takes at least 2 g S / Bpcie, the model's term. Its time is the
push trailer's `intra_sum_s` (telemetry). A replica that fails still joins the collectives with a
flag, so replica 0 raises its error instead of waiting on a peer that is gone.

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

import torch
from torch.distributed import HashStore, ProcessGroupGloo

from tasks.core.phases import NoListener, PhaseListener

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


class IntraLink:
    """Replica `rank`'s end of the instance's local group: hand-out of the state, sum of the push."""

    def __init__(self, group, rank: int, gpus: int, device: torch.device, floor_s: float):
        self.group, self.rank, self.gpus, self.floor_s = group, rank, gpus, floor_s
        self._control = torch.zeros(1, device=device)
        self._totals = torch.zeros(2, device=device)  # [loss, replicas that failed]

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()

    def hand_out(self, state: torch.Tensor, go: bool) -> bool:
        """Replica 0: send the go (or stop) signal and, on go, the state; the others receive them.
        Returns whether to compute this iteration."""
        if self.rank == 0:
            self._control.fill_(GO if go else STOP)
        self._broadcast(self._control)
        if self._control.item() != GO:
            return False
        self._broadcast(state)
        return True

    def sum(self, push: torch.Tensor, loss: float, failed: bool) -> tuple[float, int, float]:
        """Sum the replicas' push vectors into each one's and divide by g (the instance's mean
        gradient), paced to the emulated PCIe link: (mean loss, replicas that failed, seconds)."""
        t0 = time.monotonic()
        if failed:
            push.zero_()
        self._totals[0], self._totals[1] = 0.0 if failed else loss, 1.0 if failed else 0.0
        self.group.allreduce([push]).wait()
        self.group.allreduce([self._totals]).wait()
        push.div_(self.gpus)
        elapsed_s = time.monotonic() - t0
        if self.floor_s > elapsed_s:
            time.sleep(self.floor_s - elapsed_s)
        failures = int(round(self._totals[1].item()))
        ok = self.gpus - failures
        return (self._totals[0].item() / ok if ok else float("nan")), failures, time.monotonic() - t0


class Replicas:
    """Replica 0's handle on the others: starts their threads, hands out each pull, sums each push,
    and ends them (`close`) however the worker's loop ends.

    `build(rank)` returns (flat model, step) for replica `rank`: `step()` computes one padded
    forward/backward on the replica's own batch, leaves its push vector filled and returns the loss.
    `scope(rank)` (default: no listener) wraps replica `rank`'s thread and yields its PhaseListener.
    """

    def __init__(self, gpus: int, devices: list[torch.device], numel: int, pcie_mbps: float | None,
                 timeout_s: float, build: Callable[[int], tuple],
                 scope: Callable[[int], AbstractContextManager[PhaseListener]] | None = None):
        store = HashStore()
        floor_s = pcie_floor_s(gpus, numel, pcie_mbps)
        self.gpus, self.numel, self.devices = gpus, numel, devices
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
        self.link = IntraLink(groups[0], 0, gpus, devices[0], floor_s)
        self._threads = []
        for rank in range(1, gpus):
            link = IntraLink(groups[rank], rank, gpus, devices[rank], floor_s)
            thread = threading.Thread(target=self._serve, args=(rank, link, devices[rank], build), daemon=True,
                                      name=f"replica-{rank}")
            thread.start()
            self._threads.append(thread)

    def _serve(self, rank: int, link: IntraLink, device: torch.device, build) -> None:
        """Replicas 1..g-1: wait for the state, compute, join the sum; until told to stop. A failure
        (its own batch, its GPU, its scope) is kept for replica 0 to raise; this replica goes on
        joining the collectives with a flag, so nobody waits for it."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        with contextlib.ExitStack() as stack:
            listener: PhaseListener = NoListener()
            try:
                listener = stack.enter_context(self._scope(rank))
                bound, step = build(rank)
                state, push = bound.state, bound.push
            except BaseException as err:  # no model: stand-ins of the right size keep the collectives going
                self.errors[rank] = err
                state, push = torch.zeros(self.numel, device=device), torch.zeros(self.numel, device=device)
            iteration = 0
            while link.hand_out(state, go=True):
                if iteration:
                    listener.comm_end(iteration - 1)
                loss, failed = 0.0, rank in self.errors
                if not failed:
                    try:
                        listener.compute_start(iteration)
                        loss = step()
                        listener.compute_end(iteration)
                    except BaseException as err:
                        self.errors[rank] = err
                        failed = True
                listener.comm_start(iteration)
                link.sum(push, loss, failed)
                iteration += 1
            if iteration:
                listener.comm_end(iteration - 1)

    def hand_out(self, state: torch.Tensor) -> None:
        """The pull, received once by replica 0, to every replica."""
        self.link.hand_out(state, go=True)
        self._handed = True

    def sum(self, push: torch.Tensor, loss: float) -> tuple[float, float]:
        """The instance's mean push into `push` (replica 0's): (mean loss, the sum's seconds). A
        replica's failure is raised here."""
        loss, failures, elapsed_s = self.link.sum(push, loss, failed=False)
        self._handed = False
        if failures:
            rank, err = min(self.errors.items())
            sys.stderr.write(f"spotfill worker: replica {rank} of {self.gpus} failed\n")
            raise err
        return loss, elapsed_s

    def close(self) -> None:
        """End the replicas: a sum they are waiting for (replica 0 failed mid-iteration) is joined
        with a flag, then the stop signal."""
        if self._closed:
            return
        self._closed = True
        if self._handed:
            self.link.sum(torch.zeros(self.numel, device=self.devices[0]), 0.0, failed=True)
        self.link.hand_out(torch.zeros(0), go=False)
        for thread in self._threads:
            thread.join()
