"""The parameter server: holds the parameters and optimizer state, applies each worker's gradient
as it arrives (asynchronous SGD), and tracks per-worker staleness.

One thread per connected worker (wire.Link); updates are applied under one lock, so each one is
applied exactly once and counted once. A worker's learning rate follows its batch size
(Workload.lr_for_batch); the asynchronous update rule (tasks/runtime/async_rule.py, `async_rule`)
then sets the step for the update's staleness s: by default it lowers the optimizer's momentum by
the momentum asynchrony itself adds and raises SGD's learning rate back while the loss falls;
`sqrt` and `inverse` damp the learning rate instead,
lr / (1 + s) ** staleness_lr_power (docs/runtime.md).
The emulated network (shaping.Shaper) is applied here, where all traffic meets.

The parameters live in one flat vector (flat.py) and the optimizer steps that vector as one
tensor (`optimizer_step`, the update rule); a pull sends one copy of it per version. With
`num_shards` = k > 1 this PS owns one k-th of the vector, and checkpoints, stops and restarts
follow the consistent cuts of cuts.py; otherwise the server checkpoints atomically every `checkpoint_every_s` seconds or every
`checkpoint_every_updates` updates (that snapshot is taken at exactly the N-th update, under the
lock, and written by the main thread at once), and on start resumes from the newest good checkpoint in
<run_dir>/checkpoints if there is one (with --durable-url, checkpoints are copied to S3 as well,
and a PS whose disk has none newer starts from the newest there: durable.py). A workload with an
`evaluate(model)` is evaluated every N updates on a snapshot, beside the updates (periodic_eval.py).
It stops on a step budget (max_updates), a target smoothed loss, a target metric met by an
evaluation, a pushed loss that is NaN or infinite (`diverged`: that push is not applied), a file
<run_dir>/STOP, SIGTERM/SIGINT, the run's lease lapsing (--lease, tasks/runtime/lease.py: no
orchestrator renewed it in time), or, for a run without a lease, when the process given by
--watch-pid is gone (the local orchestrator, killed with no chance to clean up); it then tells
each worker to stop at its next exchange and writes a final checkpoint. However it ends, it ends
what else its session runs (a plug-in's helper process: tasks/core/processes.py), also when no
orchestrator is left to do it.

Run: python -m tasks.runtime.ps --run-dir DIR --port P --workload W [options]
When it listens it writes <run_dir>/ps.json ({"address", "pid", "version"}) atomically.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tasks.core import limits
from tasks.core.atomic import atomic_write_text
from tasks.core.command_line import OneLineParser, arg_type
from tasks.core.errors import UserInputError
from tasks.core.processes import exit_now, run_then_exit
from tasks.runtime import checkpoint, flat, wire
from tasks.runtime.lease import LeaseWatch
from tasks.runtime.async_rule import DEFAULT_RULE, RULES, make_rule
from tasks.runtime.cuts import CUTS_KEPT, EpochCut, shard_dir
from tasks.runtime.durable import S3Checkpoints
from tasks.runtime.stagger import TypeSlots
from tasks.runtime.evaluation import DEFAULT_EVAL_EVERY_UPDATES, TargetMetric, parse_target_metric
from tasks.runtime.lifetime import pid_alive
from tasks.runtime.periodic_eval import PeriodicEvaluation
from tasks.runtime.pieces import pieces, pull_order
from tasks.runtime.shaping import Shaper
from tasks.runtime.telemetry import TelemetryWriter
from tasks.runtime.workloads import build_workload, parse_options

STOP_FILE = "STOP"
READY_FILE = "ps.json"
ERROR_FILE = "ps-error.txt"  # one line: why this PS failed (the driver reads it; tells a failure from a stop)
POLL_S = 0.1  # the main loop's period (joins, checkpoints, stop): each poll costs a store round trip


@dataclass
class PsConfig:
    run_dir: Path
    port: int
    workload: str
    workload_options: dict = field(default_factory=dict)
    ps_mbps: float | None = None  # emulated PS NIC cap (both directions); None: not limited
    checkpoint_every_s: float = 30.0
    checkpoint_every_updates: int | None = None
    max_updates: int | None = None
    target_loss: float | None = None
    loss_smoothing: float = 0.1
    async_rule: str = DEFAULT_RULE  # how a stale gradient is applied (tasks/runtime/async_rule.py)
    staleness_lr_power: float | None = None  # lr / (1 + staleness) ** this; None: the rule's own; 0: no damping
    op_timeout_s: float = 300.0
    stop_grace_s: float = 10.0
    watch_pid: int | None = None  # stop when this process (the local orchestrator) is gone
    lease: Path | str | None = None  # stop once this lease (file or s3:// object, lease.py) lapses
    durable_url: str | None = None  # s3://BUCKET/PREFIX: checkpoints copied there too (durable.py)
    shard: int = 0  # this PS's index among num_shards (cuts.py): it owns that range of the flat vector
    num_shards: int = 1
    eval_every_updates: int | None = DEFAULT_EVAL_EVERY_UPDATES  # the plug-in's evaluate (periodic_eval.py); None: never
    target_metric: TargetMetric | None = None  # stop once an evaluation meets it


class ParameterServer:
    def __init__(self, config: PsConfig):
        self.config = config
        if not 0 <= config.shard < config.num_shards:
            raise UserInputError(f"shard must be in 0..{config.num_shards - 1}, got {config.shard}")
        self.workload = build_workload(config.workload, config.workload_options)
        self.model = self.workload.model
        whole = flat.bind(self.model, with_grads=False)
        self.layout = whole.layout
        self.lo, self.hi = flat.shard_ranges(self.layout.numel, config.num_shards)[config.shard]
        self.state = whole.state[self.lo:self.hi]  # this PS's range: [parameters | buffers] of the flat vector
        self.param_numel = max(0, min(self.hi, self.layout.param_numel) - self.lo)
        self.params = self.state[:self.param_numel]
        # one flat tensor: every optimizer step is one fused pass, not a loop over tensors
        self.optimizer = fused(self.workload.make_optimizer([self.params]))
        self.flat_size = self.hi - self.lo
        try:
            self.rule = make_rule(config.async_rule, self.optimizer, config.staleness_lr_power)
        except ValueError as err:
            raise UserInputError(str(err)) from None
        self.lock = threading.Lock()
        self.version = 0
        self.updates_total = 0
        self.samples_total = 0
        self.smoothed_loss: float | None = None
        self.next_worker_id = 0
        self.stopping: str | None = None
        self.shaper = Shaper(config.ps_mbps)
        self.type_slots = TypeSlots()  # each type's workers spread over their period (stagger.py)
        self.dir = shard_dir(config.run_dir, config.shard)  # the run directory for shard 0
        self.telemetry = TelemetryWriter(self.dir)
        self.checkpoint_dir = self.dir / "checkpoints"
        self._handlers: list[threading.Thread] = []
        self._last_checkpoint_version = -1
        self._last_checkpoint_updates = 0
        self._pending_checkpoint: dict | None = None
        self._wake = threading.Event()  # set when a checkpoint snapshot waits to be written
        self._published: tuple[int, torch.Tensor] | None = None  # (version, copy of the state) workers pull
        self._pool: dict[torch.Tensor, int] = {}  # copies of the state -> handlers sending them now
        self.epochs = EpochCut(self) if config.num_shards > 1 else None
        self._signalled: str | None = None  # set by a signal handler, acted on by serve()
        if config.durable_url and config.num_shards > 1:
            raise UserInputError("durable checkpoints (--durable-url) need a single PS shard")
        self.durable = S3Checkpoints(config.durable_url) if config.durable_url else None
        self.error: str | None = None  # why a worker's handler failed: the PS stops as failed
        self.evaluation = self._periodic_evaluation()

    def _periodic_evaluation(self) -> PeriodicEvaluation | None:
        """The plug-in's evaluate every N updates, when it has one; it needs the whole vector, so
        one unsharded PS."""
        c = self.config
        if c.target_metric is not None and (self.workload.evaluate is None or c.eval_every_updates is None or self.sharded):
            raise UserInputError(f"target metric {c.target_metric} needs one unsharded PS evaluating the "
                                 f"workload's evaluate(model) every N updates")
        if self.workload.evaluate is None or c.eval_every_updates is None or self.sharded:
            return None
        return PeriodicEvaluation(c.workload, self.workload, c.eval_every_updates, self.telemetry, c.target_metric,
                                  on_met=lambda: self.stop_locked("target_metric"), on_error=self.fail)

    def stop_locked(self, reason: str) -> None:
        """Stop, taking the lock: from a thread beside the updates (apply() sets `stopping` under it)."""
        with self.lock:
            self.stopping = self.stopping or reason

    def fail(self, err: BaseException) -> None:
        """A handler thread's unexpected error is the PS's failure, not one lost worker: stop (as
        "failed") rather than serve on with a piece of the PS broken."""
        self.error = self.error or one_line_error(err)
        self.stopping = "failed"

    # ------------------------------------------------------------ state and checkpoints

    @property
    def sharded(self) -> bool:
        return self.epochs is not None

    def resume(self) -> bool:
        """Load the newest good checkpoint (sharded: the newest consistent cut every shard has),
        if any; True when resumed."""
        checkpoint.remove_partial_writes(self.checkpoint_dir)  # a predecessor killed mid-write left them
        if self.durable is not None:  # a PS on a new instance: its disk has none, the store has
            try:
                self.durable.fetch_newest(self.checkpoint_dir)
            except Exception as err:  # noqa: BLE001 - boto3's errors are many; the message says which
                raise UserInputError(f"cannot read the durable checkpoints at {self.config.durable_url}: "
                                     f"{str(err).splitlines()[0][:160]}") from None
        if self.sharded:
            state = self.epochs.load_common_cut()
        else:
            state = checkpoint.load_latest(
                self.checkpoint_dir,
                on_corrupt=lambda path, err: (
                    self.telemetry.write("corrupt_checkpoint", path=str(path), error=err),
                    sys.stderr.write(f"spotfill ps: {err}; using the previous checkpoint\n"),
                ),
            )
        if state is None:
            return False
        if (state["workload"], state["workload_options"]) != (self.config.workload, self.config.workload_options):
            raise UserInputError(
                f"checkpoint in {self.checkpoint_dir} is for workload {state['workload']} "
                f"{state['workload_options']}, not {self.config.workload} {self.config.workload_options}"
            )
        if state.get("shard", (0, 1)) != (self.config.shard, self.config.num_shards) or state["params"].numel() != self.flat_size:
            raise UserInputError(f"checkpoint in {self.checkpoint_dir} is for another PS layout "
                                 f"(shard {state.get('shard', (0, 1))}, {state['params'].numel()} elements)")
        self.state.copy_(state["params"])
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as err:
            raise UserInputError(f"checkpoint in {self.checkpoint_dir} has optimizer state of another layout ({err})") from None
        self.version = state["version"]
        self.updates_total = state["updates_total"]
        self.samples_total = state["samples_total"]
        self.smoothed_loss = state["smoothed_loss"]
        self.next_worker_id = state["next_worker_id"]
        self._last_checkpoint_version = self.version
        self._last_checkpoint_updates = self.updates_total
        if self.sharded:
            self.epochs.resume_after(state["epoch"])
        self.telemetry.write("resume", version=self.version, updates_total=self.updates_total,
                             samples_total=self.samples_total, epoch=state.get("epoch"))
        return True

    def _snapshot(self, epoch: int | None = None) -> dict:
        """The state a checkpoint holds; the caller holds the lock. Sharded: the cut of `epoch`."""
        self._last_checkpoint_version = self.version
        self._last_checkpoint_updates = self.updates_total
        return {
            "workload": self.config.workload,
            "workload_options": self.config.workload_options,
            "shard": (self.config.shard, self.config.num_shards),
            "params": self.state.clone(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "version": self.version,
            "epoch": epoch,
            "updates_total": self.updates_total,
            "samples_total": self.samples_total,
            "smoothed_loss": self.smoothed_loss,
            "next_worker_id": self.next_worker_id,
        }

    def write_checkpoint(self, state: dict | None = None) -> None:
        """Write `state` (a snapshot taken at an update or, sharded, at a cut) or, unsharded, a
        snapshot of now, unless nothing changed since the last one. A sharded PS writes only cuts:
        a snapshot between cuts could hold an update another shard lacks."""
        if state is None:
            if self.sharded:
                return
            with self.lock:
                if self.version == self._last_checkpoint_version:
                    return
                state = self._snapshot()
        number = state["epoch"] if self.sharded else state["version"]
        path = checkpoint.save_checkpoint(self.checkpoint_dir, number, state,
                                          keep=CUTS_KEPT if self.sharded else checkpoint.KEEP)
        self.telemetry.write("checkpoint", version=state["version"], updates_total=state["updates_total"],
                             samples_total=state["samples_total"], epoch=state["epoch"], path=str(path))
        if self.durable is not None:
            try:
                key = self.durable.upload(path)
            except Exception as err:  # noqa: BLE001 - reported; the next checkpoint tries again
                self.telemetry.write("durable_error", path=str(path), error=str(err)[:200])
                sys.stderr.write(f"spotfill ps: copying {path.name} to {self.config.durable_url} failed: {str(err)[:160]}\n")
            else:
                self.telemetry.write("durable_checkpoint", version=state["version"], key=key)

    def cut(self, epoch: int) -> None:
        """The cut of `epoch` (cuts.py; the caller holds the lock): snapshot now, written at once by
        serve()'s thread."""
        self._pending_checkpoint = self._snapshot(epoch)
        self._wake.set()

    def optimizer_step(self, grad: torch.Tensor, lr: float) -> None:
        """The update rule: one step of the workload's optimizer on this PS's flat parameters with
        the flat gradient `grad` at learning rate `lr` (already scaled by batch and staleness)."""
        self.params.grad = grad
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.params.grad = None

    def apply(self, worker_id: int, instance_type: str, header: torch.Tensor, push: torch.Tensor, batch_size: int) -> bool:
        """Apply one pushed gradient; False (not applied, not counted) once the PS is stopping."""
        values = header.tolist()
        _, step, samples, loss, base_version, compute_s, comm_s, dropped, epoch, stop_epoch = values[:wire.INTRA_SUM_S]
        intra_sum_s, intra_sum_link_s = (values[slot] if len(values) > slot else -1.0  # a one-GPU header of old
                                         for slot in (wire.INTRA_SUM_S, wire.INTRA_SUM_LINK_S))
        with self.lock:
            if self.sharded and not self.epochs.admit(worker_id, int(epoch), int(stop_epoch)):
                return False
            if self.stopping or dropped == wire.DROPPED:
                return False
            if not math.isfinite(loss):  # diverged: its gradient would poison the parameters
                self.telemetry.write("diverged", worker=worker_id, step=int(step), version=self.version, loss=repr(loss))
                if not self.sharded:
                    self.stopping = "diverged"
                elif self.config.shard == 0:  # every shard refuses this push; the leader stops them all
                    self.epochs.propose("diverged")
                return False
            staleness = self.version - int(base_version)
            self.rule.observe(loss)
            lr = self.rule.prepare(self.workload.lr_for_batch(batch_size), staleness)
            start_s = time.perf_counter()
            self.optimizer_step(push[:self.param_numel], lr)
            self.state[self.param_numel:].copy_(push[self.param_numel:])
            apply_s = time.perf_counter() - start_s
            self.version += 1
            self.updates_total += 1
            self.samples_total += int(samples)
            a = self.config.loss_smoothing
            self.smoothed_loss = loss if self.smoothed_loss is None else (1 - a) * self.smoothed_loss + a * loss
            if self.evaluation is not None:
                self.evaluation.offer(self.state, self.updates_total, self.version)
            self.telemetry.write(
                "update", worker=worker_id, instance_type=instance_type, step=int(step), samples=int(samples),
                loss=loss, compute_s=compute_s, comm_s=comm_s if comm_s >= 0 else None,
                intra_sum_s=intra_sum_s if intra_sum_s >= 0 else None,
                intra_sum_link_s=intra_sum_link_s if intra_sum_link_s >= 0 else None,
                base_version=int(base_version), version=self.version, staleness=staleness, lr=lr,
                samples_total=self.samples_total, updates_total=self.updates_total,
                apply_ms=1e3 * apply_s, apply_ms_per_mb=1e3 * apply_s / (self.flat_size * 4 / 1e6),
            )
            c = self.config
            stop = None
            if c.max_updates is not None and self.updates_total >= c.max_updates:
                stop = "max_updates"
            elif c.target_loss is not None and self.smoothed_loss <= c.target_loss:
                stop = "target_loss"
            due = (c.checkpoint_every_updates is not None
                   and self.updates_total - self._last_checkpoint_updates >= c.checkpoint_every_updates)
            if self.sharded:
                if c.shard == 0:  # the leader decides cuts and stops; the others follow (EpochCut)
                    self.epochs.propose(stop) if stop else (self.epochs.propose() if due else None)
            else:
                if due:
                    self._pending_checkpoint = self._snapshot()  # exactly at this update; written by serve()
                    self._wake.set()
                self.stopping = self.stopping or stop  # fail() from another thread may have set it meanwhile
            return True

    def published_state(self) -> tuple[int, torch.Tensor | None]:
        """(version, the state workers pull); None once stopping. One copy per version, shared by
        every worker that pulls it, so sending it needs no lock. Copies come from a pool (a fresh
        100 MB tensor each version would cost more in page faults than the copy): a copy is
        reused once no handler holds it (`release_state`)."""
        with self.lock:
            if self.stopping:
                return self.version, None
            if self._published is None or self._published[0] != self.version:
                free = [t for t, readers in self._pool.items() if readers == 0 and
                        (self._published is None or t is not self._published[1])]
                copy_ = free[0] if free else torch.empty_like(self.state)
                copy_.copy_(self.state)
                self._published = (self.version, copy_)
            self._pool[self._published[1]] = self._pool.get(self._published[1], 0) + 1
            return self._published

    def release_state(self, state: torch.Tensor) -> None:
        with self.lock:
            self._pool[state] -= 1

    # ------------------------------------------------------------ serving

    def _serve_worker(self, store, worker_id: int) -> None:
        """Talk to one worker until it leaves, the PS stops, or the connection breaks."""
        reason = "lost"
        try:
            desc = json.loads(store.get(f"join/{worker_id}"))
            link = wire.Link(store, worker_id, 0, self.config.op_timeout_s)
        except Exception as err:  # the worker vanished while joining
            self.telemetry.write("leave", worker=worker_id, reason="lost", error=str(err)[:200])
            return
        instance_type = desc.get("instance_type", "")
        phase_fraction = self.type_slots.take(instance_type, worker_id)
        self.shaper.add_worker(worker_id, desc.get("nic_mbps"))
        if self.sharded:
            self.epochs.joined(worker_id)
        self.telemetry.write("join", worker=worker_id, instance_type=instance_type, instance_id=desc.get("instance_id"),
                             batch_size=desc["batch_size"], gpus=desc.get("gpus", 1), nic_mbps=desc.get("nic_mbps"),
                             phase=phase_fraction)
        header = wire.new_header()
        push = torch.empty(self.flat_size)
        nbytes = push.numel() * push.element_size()
        cut = pieces(self.flat_size, max(1, int(desc.get("piece_numel") or self.flat_size)))
        order = pull_order(cut, self.param_numel)
        try:
            while True:
                link.recv(header)
                kind = header[0].item()
                if kind == wire.LEAVE:
                    reason = wire.LEAVE_REASONS.get(header[7].item(), "done")
                    return
                applied = False
                if kind == wire.PUSH:  # header, the pieces (push.py), then the trailer: a header with the times
                    self.type_slots.started(worker_id, time.time())  # the header leaves as compute starts
                    works = [link.start_recv(push[lo:hi], tag) for tag, (lo, hi) in enumerate(cut, start=1)]
                    link.recv(header)
                    for work in works:
                        work.wait()
                    self.shaper.transfer(worker_id, nbytes)
                    applied = self.apply(worker_id, instance_type, header, push, desc["batch_size"])
                reply = wire.new_header()
                reply[3] = 1.0 if applied else 0.0
                reply[2] = self.workload.lr_for_batch(desc["batch_size"])
                reply[wire.PHASE_FRACTION], reply[wire.PHASE_ANCHOR_S] = self.type_slots.phase(instance_type, worker_id)
                if self.sharded:
                    reply[wire.EPOCH], reply[wire.STOP_EPOCH] = self.epochs.advertised()
                version, params = self.published_state()
                reply[1] = version
                if params is None:
                    reply[0] = wire.STOP
                    link.send(reply)
                    reason = "ps_stop"
                    return
                reply[0] = wire.CONTINUE
                try:
                    self.shaper.transfer(worker_id, nbytes)
                    link.send(reply)
                    for work in [link.start_send(params[cut[i][0]:cut[i][1]], i + 1) for i in order]:
                        work.wait()
                finally:
                    self.release_state(params)
        except RuntimeError:
            reason = "lost"
        except Exception as err:  # not the link's: the PS's own fault (a shaping delay past range...)
            reason = "ps_failed"
            self.fail(err)
        finally:
            self.shaper.remove_worker(worker_id)
            self.type_slots.free(instance_type, worker_id)
            if self.sharded:
                self.epochs.left(worker_id)
            self.telemetry.write("leave", worker=worker_id, reason=reason)

    def serve(self, store) -> str:
        """Accept workers and checkpoint until stopped; returns the stop reason."""
        c = self.config
        if self.next_worker_id:
            store.add(wire.COUNTER_KEY, self.next_worker_id)  # ids stay unique across restarts
        store.set(wire.SERVING_KEY, "1")  # only now may workers take ids
        atomic_write_text(self.dir / READY_FILE, json.dumps({"address": f"127.0.0.1:{c.port}", "pid": os.getpid(), "version": self.version}))
        accepted = self.next_worker_id
        last_checkpoint_s = time.monotonic()
        stop_file = c.run_dir / STOP_FILE
        lease = LeaseWatch(c.lease) if c.lease else None
        if self.evaluation is not None:
            self.evaluation.start()
        while not self.stopping:
            registered = int(store.add(wire.COUNTER_KEY, 0))
            while accepted < registered:
                accepted += 1
                with self.lock:
                    self.next_worker_id = accepted
                thread = threading.Thread(target=self._serve_worker, args=(store, accepted), daemon=True)
                thread.start()
                self._handlers.append(thread)
            with self.lock:
                pending, self._pending_checkpoint = self._pending_checkpoint, None
            if pending is not None:
                self.write_checkpoint(pending)
                last_checkpoint_s = time.monotonic()
            if time.monotonic() - last_checkpoint_s >= c.checkpoint_every_s:
                if self.sharded:
                    if c.shard == 0:
                        with self.lock:
                            self.epochs.propose()
                else:
                    self.write_checkpoint()
                last_checkpoint_s = time.monotonic()
            if stop_file.exists():
                self.request_stop("stop_file")
            if lease is not None and lease.lapsed():
                self.request_stop("lease_lapsed")
            elif lease is None and c.watch_pid and not pid_alive(c.watch_pid):
                self.stopping = self.stopping or "orchestrator_gone"
            if self._signalled:
                self.stopping = self.stopping or self._signalled
            self._wake.wait(POLL_S)
            self._wake.clear()
        with self.lock:
            pending, self._pending_checkpoint = self._pending_checkpoint, None
        if pending is not None:
            self.write_checkpoint(pending)
        self.write_checkpoint()
        if self.evaluation is not None:
            self.evaluation.close()
        deadline_s = time.monotonic() + c.stop_grace_s
        for thread in self._handlers:  # workers hear "stop" at their next exchange
            thread.join(timeout=max(0.0, deadline_s - time.monotonic()))
        if self.error:  # before the stop record: a reader that sees "failed" finds the error
            write_error(self.dir, self.error)
        self.telemetry.write("stop", reason=self.stopping, version=self.version,
                             updates_total=self.updates_total, samples_total=self.samples_total)
        self.telemetry.close()
        return self.stopping

    def on_signal(self, *_) -> None:
        """SIGTERM/SIGINT: stop at once (takes no lock: it runs between any two bytecodes)."""
        self._signalled = "signal"

    def request_stop(self, reason: str) -> None:
        """A stop asked from outside (the STOP file, a signal). Unsharded: at once. Sharded: the
        leader stops every shard at the next cut; a follower stops at once only while no worker is
        connected (otherwise it hears the stop cut from the workers' pushes)."""
        if not self.sharded:
            self.stopping = self.stopping or reason
        elif self.config.shard == 0:
            with self.lock:
                self.epochs.propose(reason)
        else:
            with self.lock:
                self.epochs.stop_if_idle(reason)

FUSED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def fused(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer, same settings, with torch's fused kernel where it has one (SGD, Adam,
    AdamW): one pass over the flat vector instead of several, and no temporaries."""
    if type(optimizer) not in FUSED_OPTIMIZERS or len(optimizer.param_groups) != 1:
        return optimizer
    return type(optimizer)(optimizer.param_groups[0]["params"], **{**optimizer.defaults, "fused": True, "foreach": False})


def build_parser() -> argparse.ArgumentParser:
    nonnegative_float, positive_float, positive_int = arg_type(limits.nonnegative_float), arg_type(limits.positive_float), arg_type(limits.positive_int)
    p = OneLineParser(prog="python -m tasks.runtime.ps", description="spotfill parameter server")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--ps-mbps", type=arg_type(limits.mbps), default=None, help="emulated PS bandwidth cap")
    p.add_argument("--checkpoint-every-s", type=positive_float, default=30.0)
    p.add_argument("--checkpoint-every-updates", type=positive_int, default=None)
    p.add_argument("--max-updates", type=positive_int, default=None)
    p.add_argument("--target-loss", type=positive_float, default=None)
    p.add_argument("--stop-grace-s", type=positive_float, default=10.0)
    p.add_argument("--async-rule", choices=sorted(RULES), default=DEFAULT_RULE,
                   help="how a stale gradient is applied (tasks/runtime/async_rule.py)")
    p.add_argument("--staleness-lr-power", type=nonnegative_float, default=None,
                   help="damp each update's learning rate by (1 + staleness) ** this (default: the rule's; 0: none)")
    p.add_argument("--watch-pid", type=positive_int, default=os.environ.get("SPOTFILL_WATCH_PID") or None,
                   help="stop when this process is gone (the local provider sets it to the orchestrator)")
    p.add_argument("--lease", default=None, metavar="PATH|s3://BUCKET/KEY",
                   help="stop (final checkpoint) once the run's lease there lapses; replaces --watch-pid")
    p.add_argument("--durable-url", default=None, metavar="s3://BUCKET/PREFIX",
                   help="copy each checkpoint there too, and start from the newest there (a PS on a new instance)")
    p.add_argument("--shard", type=int, default=0, help="this PS's index among --num-shards")
    p.add_argument("--num-shards", type=positive_int, default=1, help="PS processes the parameters are split across")
    p.add_argument("--eval-every-updates", type=positive_int, default=DEFAULT_EVAL_EVERY_UPDATES,
                   help="run the workload's evaluate(model), if it has one, every N updates (periodic_eval.py)")
    p.add_argument("--no-eval", action="store_true", help="never run the workload's evaluate during training")
    p.add_argument("--target-metric", type=arg_type(parse_target_metric), default=None, metavar="NAME<=X|NAME>=X",
                   help="stop once an evaluation meets this target")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for the optimizer step and the state copies (default: a quarter of the cores, 1 to 4)")
    return p


def default_threads(cpu_count: int) -> int:
    """The PS's update and its copy of the state are memory-bound vector work: a few threads cut
    them where cores are spare (a quarter of a 16-core host: 4), while on a small machine whose
    cores the workers need it keeps to one."""
    return max(1, min(4, cpu_count // 4))


def one_line_error(err: BaseException) -> str:
    """An exception as one bounded line: its type (for an OSError, the errno's words) and message."""
    text = " ".join(str(err).split())[:300] or type(err).__name__
    return text if isinstance(err, UserInputError) else f"{type(err).__name__}: {text}"


def write_error(directory: Path, error: str) -> None:
    """Leave the PS's error where the driver reads it, atomically; on a full disk this may fail
    too, and the log's last line (the same words) is what the driver reports then."""
    try:
        atomic_write_text(directory / ERROR_FILE, error + "\n", fsync=False)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads or default_threads(os.cpu_count() or 1))
    error_dir = shard_dir(args.run_dir, args.shard)
    try:
        config = PsConfig(
            run_dir=args.run_dir, port=args.port, workload=args.workload,
            workload_options=parse_options(args.workload_opt), ps_mbps=args.ps_mbps,
            checkpoint_every_s=args.checkpoint_every_s, checkpoint_every_updates=args.checkpoint_every_updates,
            max_updates=args.max_updates, target_loss=args.target_loss, stop_grace_s=args.stop_grace_s,
            watch_pid=args.watch_pid, lease=args.lease, durable_url=args.durable_url, async_rule=args.async_rule, staleness_lr_power=args.staleness_lr_power,
            shard=args.shard, num_shards=args.num_shards,
            eval_every_updates=None if args.no_eval else args.eval_every_updates, target_metric=args.target_metric,
        )
        server = ParameterServer(config)
        server.resume()
        try:
            store = wire.host_store(config.port, config.op_timeout_s)
        except RuntimeError as err:
            raise UserInputError(f"cannot listen on port {config.port}: {str(err).splitlines()[0][:120]}") from None
    except UserInputError as err:
        write_error(error_dir, one_line_error(err))
        sys.stderr.write(f"spotfill ps: error: {err}\n")
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.on_signal)
    try:
        reason = server.serve(store)
    except Exception as err:  # a checkpoint on a full disk, ...: the run's failure, said in one line
        traceback.print_exc()
        server.error = one_line_error(err)
        write_error(error_dir, server.error)
    if server.error:
        sys.stderr.write(f"spotfill ps: error: {server.error}\n")
        sys.stderr.flush()
        exit_now(1)
    sys.stderr.write(f"spotfill ps: stopped ({reason}) at version {server.version}\n")
    sys.stdout.flush()
    exit_now(0)  # handler threads may still sit in a gloo recv from a silent worker


if __name__ == "__main__":
    run_then_exit(main)  # however main ends: a plug-in's thread or helper process does not outlive it
