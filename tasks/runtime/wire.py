"""The PS <-> worker link: a private 2-rank gloo process group per worker, and its messages.

torch.distributed's default group is static, so it cannot take workers that come and go. Instead
the PS hosts a TCPStore; a worker joining takes a fresh id from the store's counter, leaves its
description under `join/<id>`, and both sides build `ProcessGroupGloo(PrefixStore("w<id>/", store),
rank, 2)`: PS rank 0, worker rank 1. Workers join and leave without touching anyone else's group.

Messages (torch.distributed send/recv on that group; headers on tag 0):
worker -> PS: a float64 header [kind, step, samples, loss, base_version, compute_s, comm_s, reason,
    epoch, stop_epoch, intra_sum_s, intra_sum_link_s]. A PUSH is that header as compute starts, then the PS's range of the flat
    float32 vector (flat.py) of gradients followed by the worker's floating-point buffers
    (BatchNorm statistics), in pieces of `piece_numel` elements (from the worker's join
    description; pieces.py) on tags 1, 2, ... as backward finishes them (push.py), then the header
    again, now with the loss and the times (the trailer), after which the PS applies it (unless its
    slot 7 is DROPPED); its slot 10 is the part of a multi-GPU worker's intra-instance sum left
    exposed after compute, slot 11 the seconds the sum held the instance's link (replicas.py;
    negative: one GPU).
PS -> worker: a float64 header [status, version, lr, applied (1.0 when the push just received was
    applied and counted), 0, 0, phase fraction, anchor start, epoch, stop_epoch, 0...] (the
    phase: the worker's slot among its type's workers, counted from the type's anchor, and the
    anchor's latest compute start, wall-clock; 0: none to align to; stagger.py); with status CONTINUE the PS's range of the flat
    float32 vector of parameters followed by buffers, in the same pieces on the same tags (the
    buffers' first: pieces.pull_order), which the worker lands while forward runs (pull.py). `epoch` and `stop_epoch` (0:
    none) carry the sharded PS's consistent cuts (ps.py); a single PS leaves them 0.
"""
from __future__ import annotations

import datetime
import json
import socket
import time

import torch
from torch import nn
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from tasks.core.limits import ps_bind_address
from tasks.runtime import flat

HEADER_LEN = 12
EPOCH, STOP_EPOCH = 8, 9  # header slots of the sharded PS's epoch protocol (both directions)
PHASE_FRACTION, PHASE_ANCHOR_S = 6, 7  # a reply's slots: where in its period the worker iterates (stagger.py)
INTRA_SUM_S = 10  # a push trailer's slot: the exposed seconds of the sum of a multi-GPU worker's replicas
INTRA_SUM_LINK_S = 11  # and the seconds its buckets held the instance's link
PUSH, LEAVE, PULL = 1.0, 2.0, 3.0
CONTINUE, STOP = 0.0, 1.0
DROPPED = 1.0  # slot 7 of a push's trailer: the worker withdraws this push (push.py); it is not applied
LEAVE_REASONS = {1.0: "notice", 2.0: "terminated", 3.0: "done", 4.0: "rejoin"}  # rejoin: a half-done join
REASON_CODES = {name: code for code, name in LEAVE_REASONS.items()}
COUNTER_KEY = "worker_counter"
# Set by the PS once its worker ids are seeded (a restarted PS continues after the ids it had):
# a worker that took an id from the store before that would collide with an earlier worker's id.
SERVING_KEY = "serving"


class LinkLost(Exception):
    """A transfer to or from a PS shard failed: the PS went away (the worker rejoins). Not a
    RuntimeError, so that a failure of the worker's own compute (CUDA out of memory, a cuDNN
    error) ends the worker with its message instead of looking like a lost PS."""


def new_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.float64)


def flat_size(model: nn.Module) -> int:
    return flat.layout_of(model).numel


class Link:
    """One worker's private gloo group; every call blocks until the transfer is done."""

    def __init__(self, store: TCPStore, worker_id: int, rank: int, timeout_s: float):
        self.group = ProcessGroupGloo(
            PrefixStore(f"w{worker_id}/", store), rank, 2, datetime.timedelta(seconds=timeout_s)
        )
        self.peer = 1 - rank

    def send(self, tensor: torch.Tensor) -> None:
        self.group.send([tensor], self.peer, 0).wait()

    def recv(self, tensor: torch.Tensor) -> None:
        self.group.recv([tensor], self.peer, 0).wait()

    def start_send(self, tensor: torch.Tensor, tag: int = 0):
        """Begin a send and return its work (`.wait()`): transfers to several PS shards, and the
        pieces of one push (push.py, each on its own tag), are in flight together."""
        return self.group.send([tensor], self.peer, tag)

    def start_recv(self, tensor: torch.Tensor, tag: int = 0):
        return self.group.recv([tensor], self.peer, tag)


def host_store(port: int, timeout_s: float) -> TCPStore:
    """The PS's store at `port`, on the address in SPOTFILL_PS_BIND: 127.0.0.1 unless a provider
    whose workers are other machines sets it (AWS: 0.0.0.0, behind the run's security group)."""
    fd = socket.create_server((ps_bind_address(), port)).detach()
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                    timeout=datetime.timedelta(seconds=timeout_s))


def join(host: str, port: int, description: dict, connect_timeout_s: float, op_timeout_s: float) -> tuple[int, TCPStore, Link]:
    """Register with the PS at host:port under a fresh id and build the private link.
    Raises TimeoutError (or RuntimeError from torch) when the PS cannot be reached in time."""
    worker_id, store = register(host, port, description, connect_timeout_s)
    return worker_id, store, Link(store, worker_id, 1, op_timeout_s)


def register(host: str, port: int, description: dict, connect_timeout_s: float) -> tuple[int, TCPStore]:
    """Take a fresh worker id from a PS that serves (not from a store that listens while the PS
    has yet to seed its ids) and post the worker's description under it."""
    wait_listening(host, port, connect_timeout_s)
    store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=connect_timeout_s))
    store.wait([SERVING_KEY], datetime.timedelta(seconds=connect_timeout_s))
    worker_id = int(store.add(COUNTER_KEY, 1))
    store.set(f"join/{worker_id}", json.dumps(description))
    return worker_id, store


def wait_listening(host: str, port: int, timeout_s: float) -> None:
    """Wait until something accepts TCP connections at host:port (quietly, unlike the store's
    client, which logs every failed attempt); TimeoutError after timeout_s."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, timeout_s))):
                return
        except OSError as err:
            if time.monotonic() >= deadline_s:
                raise TimeoutError(f"nothing listens at {host}:{port}: {err.strerror or err}") from None
            time.sleep(0.2)
