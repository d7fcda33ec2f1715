"""The PS <-> worker link: a private 2-rank gloo process group per worker, and its messages.

torch.distributed's default group is static, so it cannot take workers that come and go. Instead
the PS hosts a TCPStore; a worker joining takes a fresh id from the store's counter, leaves its
description under `join/<id>`, and both sides build `ProcessGroupGloo(PrefixStore("w<id>/", store),
rank, 2)`: PS rank 0, worker rank 1. Workers join and leave without touching anyone else's group.

Messages (torch.distributed send/recv on that group):
worker -> PS: a float64 header [kind, step, samples, loss, base_version, compute_s, comm_s, reason],
    then for PUSH the flat float32 vector of gradients (one per parameter) followed by the
    worker's floating-point buffers (BatchNorm statistics).
PS -> worker: a float64 header [status, version, lr, applied (1.0 when the push just received was
    applied and counted), 0...]; with status CONTINUE the flat float32
    vector of parameters followed by buffers.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import time

import torch
from torch import nn
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

HEADER_LEN = 8
PUSH, LEAVE, PULL = 1.0, 2.0, 3.0
CONTINUE, STOP = 0.0, 1.0
LEAVE_REASONS = {1.0: "notice", 2.0: "terminated", 3.0: "done"}
REASON_CODES = {name: code for code, name in LEAVE_REASONS.items()}
COUNTER_KEY = "worker_counter"


def new_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.float64)


def synced_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What the PS owns and workers pull: parameters, then floating-point buffers."""
    return [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def flat_size(model: nn.Module) -> int:
    return sum(t.numel() for t in synced_tensors(model))


def flatten_state(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in synced_tensors(model)])


def flatten_push(model: nn.Module) -> torch.Tensor:
    """Gradients of the parameters (zeros where a parameter got none), then the buffers."""
    parts = []
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append(g.detach().reshape(-1).float().cpu())
    parts += [b.detach().reshape(-1).float().cpu() for b in model.buffers() if b.is_floating_point()]
    return torch.cat(parts)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


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


def host_store(port: int, timeout_s: float) -> TCPStore:
    """The PS's store at `port`, on the address in SPOTFILL_PS_BIND: 127.0.0.1 unless a provider
    whose workers are other machines sets it (AWS: 0.0.0.0, behind the run's security group)."""
    fd = socket.create_server((os.environ.get("SPOTFILL_PS_BIND", "127.0.0.1"), port)).detach()
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                    timeout=datetime.timedelta(seconds=timeout_s))


def join(host: str, port: int, description: dict, connect_timeout_s: float, op_timeout_s: float) -> tuple[int, TCPStore, Link]:
    """Register with the PS at host:port under a fresh id and build the private link.
    Raises TimeoutError (or RuntimeError from torch) when the PS cannot be reached in time."""
    wait_listening(host, port, connect_timeout_s)
    store = TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=connect_timeout_s))
    worker_id = int(store.add(COUNTER_KEY, 1))
    store.set(f"join/{worker_id}", json.dumps(description))
    return worker_id, store, Link(store, worker_id, 1, op_timeout_s)


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
