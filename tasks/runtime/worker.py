"""The worker loop: pull parameters, compute a gradient on its own batch, push it, repeat.

Each iteration calls the PhaseListener's four methods: compute (forward/backward) is
compute_start..compute_end, communication (push gradient, pull parameters) is comm_start..comm_end.

Emulated instance speed: the worker measures the real compute time of each iteration and pads it
(sleeps) to `reference_compute_s / relative_speed`, or to `measured / relative_speed` when no
reference is given: an instance type with relative speed 0.5 computes half as fast as the
reference. Compute that is already slower than the target is not padded.

Multi-GPU instances (`--gpus G`, the local provider passes SPOTFILL_GPUS): G replicas, one per
GPU, each at batch_size / G, summing their gradients inside the instance during backward before
one push (replicas.py, buckets.py); each replica pads its own step as above.

Phase: workers of one type would push and pull at the same moments on every iteration; after
four iterations each but the type's anchor waits once for the phase the PS's replies give it
(its slot's share of the period after the anchor's compute start; stagger.py).

Leaving: when the notice file appears (a revocation notice) or on SIGTERM/SIGINT, the worker
finishes its current iteration (its gradient is pushed and counted), tells the PS it leaves, and
exits 0. When the PS connection breaks, it rejoins under a fresh id for up to
`reconnect_timeout_s` (a PS restart), then gives up with exit 1. An unreachable PS at start or bad
input is one line on stderr and exit 2. However it exits, it ends what else its session runs (a
plug-in's helper process: tasks/core/processes.py), also when no orchestrator is left to do it.

Run: python -m tasks.runtime.worker --ps HOST:PORT --workload W --batch-size B [options]
The local provider passes instance facts in the environment: SPOTFILL_INSTANCE_ID,
SPOTFILL_INSTANCE_TYPE, SPOTFILL_RELATIVE_SPEED, SPOTFILL_NIC_MBPS, SPOTFILL_NOTICE_FILE,
SPOTFILL_REFERENCE_COMPUTE_S, SPOTFILL_WATCH_PID, SPOTFILL_GPUS, SPOTFILL_PCIE_MBPS (options given on
the command line win).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tasks.core import limits
from tasks.core.command_line import OneLineParser, arg_type
from tasks.core.errors import UserInputError
from tasks.core.processes import exit_now, run_then_exit
from tasks.core.phases import NoListener, PhaseListener
from tasks.filling.attach import InstanceFiller, ReportingFiller, build_worker_filler, check_memory_fits, worker_fill_config
from tasks.filling.executor import training_stream_scope
from tasks.runtime import flat, wire
from tasks.runtime.lifetime import pid_alive
from tasks.runtime.pieces import PIECE_MB, piece_numel_for
from tasks.runtime.pull import Puller
from tasks.runtime.push import Pusher
from tasks.runtime.replicas import Replicas
from tasks.runtime.stagger import PhaseAligner
from tasks.runtime.wire import LinkLost
from tasks.runtime.workloads import build_workload, parse_options, resolve_builder


@dataclass
class WorkerConfig:
    ps_host: str  # the PS (shard 0 when sharded)
    ps_port: int
    workload: str
    batch_size: int
    workload_options: dict = field(default_factory=dict)
    instance_id: str = ""
    instance_type: str = "local"
    relative_speed: float = 1.0
    reference_compute_s: float | None = None
    nic_mbps: float | None = None
    notice_file: Path | None = None
    seed: int | None = None
    device: str = "cpu"
    connect_timeout_s: float = 30.0
    reconnect_timeout_s: float = 60.0
    op_timeout_s: float = 300.0
    max_steps: int | None = None  # leave after this many iterations (tests, profiling)
    watch_pid: int | None = None  # leave when this process (the local orchestrator) is gone
    more_ps: list[tuple[str, int]] = field(default_factory=list)  # shards 1..k-1 of a sharded PS
    piece_mb: float = PIECE_MB  # the push and the pull move in pieces of this size, overlapping backward and forward
    gpus: int = 1  # replicas, one per GPU, splitting batch_size (replicas.py)
    pcie_mbps: float | None = None  # the emulated intra-instance link the replicas' sum is paced to
    sum_in_instance: bool = False  # the replicas' path (hand-out, sum) even with one GPU: bench gpu on a one-GPU machine
    sum_after_backward: bool = False  # the replicas' sum starts once compute ends, not during backward (the bench's before)


@dataclass
class WorkerResult:
    reason: str  # "stop" (PS said so), "notice", "terminated", "done" (max_steps)
    steps: int
    samples_accepted: int
    rejoins: int


class _LeaveFlag:
    """Set from a signal handler: leave after the current iteration."""

    def __init__(self):
        self.reason: str | None = None

    def set_terminated(self, *_):
        self.reason = "terminated"


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserInputError(f"PS address must be HOST:PORT, got {text!r}")
    return host, int(port)


def parse_addresses(text: str) -> list[tuple[str, int]]:
    """`HOST:PORT[,HOST:PORT...]`: the PS shards in shard order."""
    return [parse_address(part) for part in text.split(",")]


@contextlib.contextmanager
def _link_errors():
    try:
        yield
    except RuntimeError as err:
        raise LinkLost(str(err)) from err


class Shards:
    """The worker's links to the k PS shards; each transfer goes to all of them at once (one
    message per shard, in flight together), each shard getting its range of the flat vector."""

    def __init__(self, config: WorkerConfig, numel: int, timeout_s: float):
        addresses = [(config.ps_host, config.ps_port), *config.more_ps]
        # each shard shapes its share of this worker's NIC: the transfers to all shards run at once
        nic_mbps = config.nic_mbps / len(addresses) if config.nic_mbps else None
        description = {"instance_id": config.instance_id, "instance_type": config.instance_type,
                       "batch_size": config.batch_size, "gpus": config.gpus, "nic_mbps": nic_mbps, "pid": os.getpid(),
                       "piece_numel": piece_numel_for(config.piece_mb)}
        self.links: list[wire.Link] = []
        try:
            for host, port in addresses:
                self.links.append(wire.join(host, port, description, timeout_s, config.op_timeout_s)[2])
        except (RuntimeError, TimeoutError):
            self.leave("rejoin")  # the shards joined so far must not wait for this half-joined worker
            raise
        self.ranges = flat.shard_ranges(numel, len(self.links))
        self.replies = [wire.new_header() for _ in self.links]

    @staticmethod
    def _wait(works) -> None:
        for work in works:
            work.wait()

    def send(self, headers: list[torch.Tensor]) -> None:
        with _link_errors():
            self._wait([link.start_send(h) for link, h in zip(self.links, headers)])

    def receive(self, puller: Puller) -> bool:
        """The shards' replies into self.replies; when all say continue, True and the state's
        pieces on their way (`puller` lands them as forward reads them)."""
        with _link_errors():
            self._wait([link.start_recv(h) for link, h in zip(self.links, self.replies)])
            if any(h[0].item() == wire.STOP for h in self.replies):
                return False
            puller.start(self.links)
        return True

    def leave(self, reason: str) -> None:
        """Tell every linked shard this worker leaves; a shard that is gone is skipped."""
        header = wire.new_header()
        header[0], header[7] = wire.LEAVE, wire.REASON_CODES[reason]
        for link in self.links:
            try:
                link.send(header)
            except RuntimeError:
                pass

    def epoch_tags(self) -> tuple[float, float]:
        """(epoch, stop epoch) to tag the next push with: the largest any shard advertised."""
        return max(h[wire.EPOCH].item() for h in self.replies), max(h[wire.STOP_EPOCH].item() for h in self.replies)

    def headers(self, values: list[float]) -> list[torch.Tensor]:
        """One header per shard from `values`, with that shard's base version and the epoch tags."""
        epoch, stop_epoch = self.epoch_tags()
        out = []
        for reply in self.replies:
            header = torch.tensor(values + [0.0] * (wire.HEADER_LEN - len(values)), dtype=torch.float64)
            header[4], header[wire.EPOCH], header[wire.STOP_EPOCH] = reply[1], epoch, stop_epoch
            out.append(header)
        return out


def device_batches(batches, device: torch.device):
    """The workload's batches on `device`. On CUDA the next batch is made by a thread in pinned
    memory and copied without blocking, while the GPU computes the current one."""
    if device.type != "cuda":
        yield from batches
        return

    def pinned(batch):
        # contiguous first: a pinned copy keeps a slice's strides, and a strided pinned tensor
        # goes to the GPU through a pageable staging copy, blocking the host
        return tuple(t.contiguous().pin_memory() for t in batch)

    for inputs, targets in prefetched(batches, pinned):
        yield inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def prefetched(items, prepare: Callable, depth: int = 2):
    """`prepare(item)` for each of `items`, made up to `depth` ahead by a thread. The thread's
    failure is raised here (never a consumer waiting forever on a dead producer), and the thread
    stops once the consumer is closed."""
    import queue
    import threading

    ready: queue.Queue = queue.Queue(maxsize=depth)
    closed = threading.Event()
    end = object()

    def offer(item) -> None:
        while not closed.is_set():
            try:
                ready.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def produce() -> None:
        try:
            for item in items:
                if closed.is_set():
                    return
                offer((prepare(item), None))
            offer((end, None))
        except Exception as err:
            offer((None, err))

    threading.Thread(target=produce, daemon=True, name="prefetch").start()
    try:
        while True:
            item, err = ready.get()
            if err is not None:
                raise err
            if item is end:
                return
            yield item
    finally:
        closed.set()


def check_one_gpu_device(device: str, gpus: int) -> None:
    """A device naming one GPU (cuda:N) is for a one-GPU worker only."""
    if gpus > 1 and ":" in device:
        raise UserInputError(f"--device {device} names one GPU, but the instance has {gpus}: a multi-GPU worker "
                             f"trains on cuda:0..cuda:{gpus - 1} (give --device cuda or auto)")


def replica_devices(device: torch.device, gpus: int) -> list[torch.device]:
    """One device per replica: cuda:0..G-1 on CUDA, the CPU for every replica of an emulated
    instance."""
    check_one_gpu_device(str(device), gpus)
    if device.type != "cuda":
        return [device] * gpus
    if gpus > torch.cuda.device_count():
        raise UserInputError(f"the instance has {gpus} GPUs but torch sees {torch.cuda.device_count()}")
    if gpus == 1:  # with its index: a replica's thread sets its device (torch.cuda.set_device needs one)
        return [device if device.index is not None else torch.device("cuda", torch.cuda.current_device())]
    return [torch.device("cuda", i) for i in range(gpus)]


def check_gpus(batch_size: int, gpus: int) -> int:
    """The batch per GPU: the instance's batch split evenly over its replicas."""
    if gpus <= 0:
        raise UserInputError(f"GPUs per instance must be positive, got {gpus}")
    if batch_size % gpus:
        raise UserInputError(f"batch size {batch_size} does not split over {gpus} GPUs: give a multiple of {gpus}")
    return batch_size // gpus


def pad_to_speed(t0: float, config: WorkerConfig) -> float | None:
    """Sleep until the step begun at `t0` has taken the emulated type's compute time; returns that
    time when the step was padded (None: the real compute was already slower), by which a
    replica's next sum places its buckets' starts (buckets.py)."""
    real_s = time.monotonic() - t0
    target_s = (config.reference_compute_s or real_s) / config.relative_speed
    if target_s > real_s:
        time.sleep(target_s - real_s)
        return target_s
    return None


def replica_builder(config: WorkerConfig, devices: list[torch.device], batch_per_gpu: int, seed: int):
    """`build(rank)` for replicas 1..G-1 (replicas.py): its own model on its device and its own
    batches; `step(push_complete)` computes one padded forward/backward into the push vector."""

    def build(rank: int):
        workload = build_workload(config.workload, config.workload_options)
        model = workload.model.to(devices[rank])
        model.train()
        bound = flat.bind(model)
        batches = device_batches(workload.batches(batch_per_gpu, seed + rank), devices[rank])

        def step(push_complete: Callable[[], None]) -> tuple[float, float | None]:
            t0 = time.monotonic()
            inputs, targets = next(batches)
            loss = workload.loss_fn(model(inputs), targets)
            bound.zero_grad()
            loss.backward()
            bound.fill_push_buffers()
            push_complete()
            loss_value = loss.item()
            return loss_value, pad_to_speed(t0, config)

        return bound, step

    return build


def run_worker(config: WorkerConfig, listener: PhaseListener | None = None, leave_flag: _LeaveFlag | None = None,
               replica_listeners: list[PhaseListener] | None = None) -> WorkerResult:
    """Pull, compute, push, repeat. The model's parameters and gradients are views into two flat
    vectors (flat.py), so a pull lands in the model and a push is the gradient vector itself; on
    CUDA each crosses the bus once, through a pinned host copy. The push leaves in pieces during
    backward (push.py); the pull lands in pieces during forward (pull.py). With `gpus` > 1 this
    loop is replica 0 of the instance's replicas (replicas.py): the pull lands whole and is handed
    to every replica, and the push leaves once their gradients are summed (bucket by bucket during
    backward, buckets.py). `listener` hears
    replica 0's phase edges, `replica_listeners[r - 1]` replica r's (each GPU's own filler)."""
    if config.batch_size <= 0:
        raise UserInputError(f"batch size must be positive, got {config.batch_size}")
    if config.relative_speed <= 0:
        raise UserInputError(f"relative speed must be positive, got {config.relative_speed}")
    if config.piece_mb <= 0:
        raise UserInputError(f"piece size must be positive, got {config.piece_mb} MB")
    batch_per_gpu = check_gpus(config.batch_size, config.gpus)
    devices = replica_devices(torch.device(config.device), config.gpus)
    listener = listener or NoListener()
    leave_flag = leave_flag or _LeaveFlag()
    workload = build_workload(config.workload, config.workload_options)
    device = devices[0]
    model = workload.model.to(device)
    model.train()
    flat_model = flat.bind(model)
    on_cuda = device.type == "cuda"
    # what the wire reads and writes: the flat vectors themselves on CPU, pinned host copies on CUDA
    host_state = torch.empty(flat_model.layout.numel, pin_memory=True) if on_cuda else flat_model.state
    host_push = torch.empty(flat_model.layout.numel, pin_memory=True) if on_cuda else flat_model.push
    seed = config.seed if config.seed is not None else zlib.crc32(f"{config.instance_id}:{os.getpid()}".encode())
    batches = device_batches(workload.batches(batch_per_gpu, seed), device)
    numel = flat_model.layout.numel
    try:
        shards = Shards(config, numel, config.connect_timeout_s)
    except (RuntimeError, TimeoutError) as err:
        raise UserInputError(
            f"cannot reach the parameter server at {config.ps_host}:{config.ps_port} "
            f"within {config.connect_timeout_s:g} s ({str(err).splitlines()[0][:120]})"
        ) from None

    replicas = None
    listeners = replica_listeners or [None] * (config.gpus - 1)
    if config.gpus > 1 or config.sum_in_instance:
        replicas = Replicas(config.gpus, devices, flat_model, config.pcie_mbps,
                            config.op_timeout_s + config.reconnect_timeout_s,
                            replica_builder(config, devices, batch_per_gpu, seed),
                            scope=lambda rank: replica_scope(listeners[rank - 1], devices[rank]),
                            early=not config.sum_after_backward)
    pusher = Pusher(flat_model, shards.ranges, host_push, piece_numel_for(config.piece_mb), overlap=replicas is None)
    puller = Puller(flat_model, shards.ranges, host_state, piece_numel_for(config.piece_mb))

    try:
        step = samples_accepted = rejoins = 0
        comm_s = -1.0  # the previous iteration's push+pull; none before the first
        padded_s = None  # the previous step's emulated compute time, when padded (the replicas' buckets, buckets.py)
        need_pull = True
        while True:
            try:
                if need_pull:
                    shards.send(shards.headers([wire.PULL]))
                    if not shards.receive(puller):
                        return WorkerResult("stop", step, samples_accepted, rejoins)
                    need_pull = False
                    aligner = PhaseAligner()  # a fresh one at each (re)join's first pull
                leave = leave_flag.reason or ("notice" if config.notice_file and config.notice_file.exists() else None)
                if leave is None and config.watch_pid and not pid_alive(config.watch_pid):
                    leave = "terminated"
                if leave is None and config.max_steps is not None and step >= config.max_steps:
                    leave = "done"
                if leave:
                    puller.land_all()  # every piece received (on CUDA the compute stream waits for its copy)
                    shards.leave(leave)
                    return WorkerResult(leave, step, samples_accepted, rejoins)

                wait_s = aligner.wait_s(time.time(), shards.replies[0][wire.PHASE_FRACTION].item(),
                                        shards.replies[0][wire.PHASE_ANCHOR_S].item())
                if wait_s > 0:  # once, to this type's slot in the period (stagger.py)
                    time.sleep(wait_s)
                listener.compute_start(step)
                t0 = time.monotonic()
                if replicas is not None:  # the pull, received once, to every replica
                    puller.land_all()
                    replicas.hand_out(flat_model.state, padded_s)
                with _link_errors():
                    pusher.start(shards.links, shards.headers([wire.PUSH, step, config.batch_size]))
                try:
                    inputs, targets = next(batches)
                except StopIteration:
                    raise UserInputError(f"the workload's batches ran out after {step} steps: batches(batch_size, "
                                         "seed) must yield batches for as long as training runs") from None
                with puller.landing():
                    outputs = model(inputs)
                loss = workload.loss_fn(outputs, targets)
                flat_model.zero_grad()
                loss.backward()
                flat_model.fill_push_buffers()
                if replicas is None:
                    pusher.compute_done()
                else:  # the buckets of the instance's sum not started during backward start now
                    replicas.compute_done()
                loss_value = loss.item()
                padded_s = pad_to_speed(t0, config)
                compute_s = time.monotonic() - t0
                listener.compute_end(step)

                listener.comm_start(step)
                t1 = time.monotonic()
                intra_sum_s = intra_sum_link_s = -1.0
                dropped = False
                if replicas is not None:  # the instance's gradient: its replicas' summed, then pushed once
                    loss_value, intra_sum_s, intra_sum_link_s, dropped = replicas.sum(loss_value)
                    pusher.compute_done()
                with _link_errors():
                    pusher.finish(shards.headers([wire.PUSH, step, config.batch_size, loss_value, 0, compute_s, comm_s,
                                                  wire.DROPPED if pusher.dropped or dropped else 0.0, 0, 0,
                                                  intra_sum_s, intra_sum_link_s]))
                more = shards.receive(puller)
                if shards.replies[0][3].item() == 1.0:
                    samples_accepted += config.batch_size
                if not more:
                    listener.comm_end(step)
                    return WorkerResult("stop", step + 1, samples_accepted, rejoins)
                comm_s = time.monotonic() - t1
                listener.comm_end(step)
                step += 1
            except LinkLost as err:  # a PS went away: rejoin all shards when they are back
                sys.stderr.write(f"spotfill worker: lost the parameter server ({str(err).splitlines()[0][:100]}); rejoining\n")
                deadline_s = time.monotonic() + config.reconnect_timeout_s
                while True:
                    if leave_flag.reason or (config.watch_pid and not pid_alive(config.watch_pid)):
                        # told to go while the PS is away: there is nobody to tell
                        return WorkerResult(leave_flag.reason or "terminated", step, samples_accepted, rejoins)
                    try:
                        shards = Shards(config, numel, min(1.0, config.reconnect_timeout_s))
                        break
                    except (RuntimeError, TimeoutError):
                        if time.monotonic() >= deadline_s:
                            raise SystemExit(
                                f"spotfill worker: the parameter server at {config.ps_host}:{config.ps_port} "
                                f"did not come back within {config.reconnect_timeout_s:g} s"
                            ) from None
                        time.sleep(0.5)
                rejoins += 1
                need_pull = True
                comm_s = -1.0
    finally:
        if replicas is not None:
            replicas.close()
        pusher.close()
        puller.close()


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def device_arg(text: str) -> str:
    """--device: auto, cpu, cuda or cuda:N (the device torch then uses)."""
    kind, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    positive_float, positive_int = arg_type(limits.positive_float), arg_type(limits.positive_int)
    p = OneLineParser(prog="python -m tasks.runtime.worker", description="spotfill training worker")
    p.add_argument("--ps", required=True, help="HOST:PORT of the parameter server (HOST:PORT,... for its shards)")
    p.add_argument("--workload", required=True)
    p.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--batch-size", type=positive_int, required=True)
    p.add_argument("--instance-id", default=os.environ.get("SPOTFILL_INSTANCE_ID", ""))
    p.add_argument("--instance-type", default=os.environ.get("SPOTFILL_INSTANCE_TYPE", "local"))
    p.add_argument("--relative-speed", type=positive_float, default=_env_float("SPOTFILL_RELATIVE_SPEED") or 1.0)
    # defaults from the environment as text: argparse checks them as it checks the flags
    p.add_argument("--reference-compute-s", type=arg_type(limits.duration_s),
                   default=os.environ.get("SPOTFILL_REFERENCE_COMPUTE_S") or None)
    p.add_argument("--nic-mbps", type=arg_type(limits.mbps), default=os.environ.get("SPOTFILL_NIC_MBPS") or None)
    p.add_argument("--gpus", type=positive_int, default=os.environ.get("SPOTFILL_GPUS") or None,
                   help="replicas, one per GPU, splitting --batch-size (default: the GPUs torch sees, 1 on CPU)")
    p.add_argument("--pcie-mbps", type=arg_type(limits.mbps), default=os.environ.get("SPOTFILL_PCIE_MBPS") or None,
                   help="pace the replicas' gradient sum to this intra-instance link (megabits/s)")
    p.add_argument("--sum-in-instance", action="store_true",
                   help="hand out the pull and sum the push over the instance's replicas even with one GPU "
                        "(the multi-GPU path; `spotfill bench gpu` runs it on a one-GPU machine)")
    p.add_argument("--sum-after-backward", action="store_true",
                   help="start the replicas' gradient sum once compute ends instead of bucket by bucket during "
                        "backward (`spotfill bench runtime --part gpus` measures both)")
    p.add_argument("--notice-file", type=Path, default=os.environ.get("SPOTFILL_NOTICE_FILE") or None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    p.add_argument("--device", type=device_arg, default="auto", help="auto (cuda when present), cpu, cuda or cuda:N")
    p.add_argument("--connect-timeout-s", type=positive_float, default=30.0)
    p.add_argument("--reconnect-timeout-s", type=positive_float, default=60.0)
    p.add_argument("--max-steps", type=positive_int, default=None)
    p.add_argument("--piece-mb", type=positive_float, default=PIECE_MB,
                   help="the push and the pull move in pieces of this size, overlapping backward and forward (docs/runtime.md)")
    p.add_argument("--fill", action="store_true", help="fill communication bubbles with inference (docs/filling.md)")
    p.add_argument("--fill-online-rate", type=float, default=10.0, help="online inference requests per second")
    p.add_argument("--fill-online-slo-s", type=positive_float, default=0.25, help="online latency SLO")
    p.add_argument("--fill-metrics-dir", type=Path, default=os.environ.get("SPOTFILL_FILL_METRICS_DIR") or None,
                   help="where to leave this worker's filling metrics (<dir>/<instance id>.json)")
    p.add_argument("--watch-pid", type=positive_int, default=os.environ.get("SPOTFILL_WATCH_PID") or None,
                   help="leave when this process is gone (the local provider sets it to the orchestrator)")
    return p


def build_filler(args: argparse.Namespace, device: str, gpus: int = 1) -> tuple[object | None, list]:
    """With --fill: (the instance's filler, the replicas' own fillers). Each replica fills its own
    GPU's bubbles with a filler on that GPU (on the CPU, g fillers share the host's memory, which
    is checked for all of them first); the worker's loop feeds its edges to the instance's filler,
    which drives replica 0's and sums every replica's harvest into the instance's metrics file."""
    if not args.fill:
        return None, []

    config = {"device": torch.device(device).type, "online_rate_per_s": args.fill_online_rate,
              "slo_s": args.fill_online_slo_s}
    devices = replica_devices(torch.device(device), gpus)
    if devices[0].type == "cpu" and gpus > 1:
        check_memory_fits(worker_fill_config(config), copies=gpus)
    fillers = []
    try:
        for replica_device in devices:
            with torch.cuda.device(replica_device) if replica_device.type == "cuda" else contextlib.nullcontext():
                fillers.append(build_worker_filler(config))
    except BaseException:
        for filler in fillers:
            filler.close()
        raise
    instance = InstanceFiller(fillers)
    metrics_dir = args.fill_metrics_dir or (args.notice_file.parent.parent / "filling" if args.notice_file else None)
    if metrics_dir is None:
        return instance, fillers
    return ReportingFiller(instance, Path(metrics_dir) / f"{args.instance_id or os.getpid()}.json"), fillers


def fill_stream_scope(filler, device: str):
    """With a filler on CUDA, the worker computes on a highest-priority stream, above the
    inference lanes' lowest-priority ones (tasks.filling.executor)."""
    if filler is None:
        return contextlib.nullcontext()

    return training_stream_scope(device)


@contextlib.contextmanager
def replica_scope(listener: PhaseListener | None, device: torch.device):
    """A replica thread's scope (replicas.py): its own filler's stream scope, yielding its listener."""
    with fill_stream_scope(listener, str(device)):
        yield listener or NoListener()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    gpus = args.gpus or (torch.cuda.device_count() if args.device in ("auto", "cuda") else 1) or 1
    # auto: CUDA when torch sees a GPU for every replica; an emulated instance's replicas on the CPU otherwise
    device = ("cuda" if 0 < gpus <= torch.cuda.device_count() else "cpu") if args.device == "auto" else args.device
    leave_flag = _LeaveFlag()
    try:
        check_one_gpu_device(device, gpus)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UserInputError(f"--device {device}: torch sees no CUDA device")
        (host, port), *more_ps = parse_addresses(args.ps)
        resolve_builder(args.workload)
        config = WorkerConfig(
            ps_host=host, ps_port=port, workload=args.workload, batch_size=args.batch_size,
            workload_options=parse_options(args.workload_opt), instance_id=args.instance_id,
            instance_type=args.instance_type, relative_speed=args.relative_speed,
            reference_compute_s=args.reference_compute_s, nic_mbps=args.nic_mbps,
            notice_file=args.notice_file, seed=args.seed, device=device,
            connect_timeout_s=args.connect_timeout_s, reconnect_timeout_s=args.reconnect_timeout_s,
            max_steps=args.max_steps, watch_pid=args.watch_pid, more_ps=more_ps,
            piece_mb=args.piece_mb, gpus=gpus, pcie_mbps=args.pcie_mbps, sum_in_instance=args.sum_in_instance,
            sum_after_backward=args.sum_after_backward,
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, leave_flag.set_terminated)
        filler, replica_fillers = build_filler(args, device, gpus)
        try:
            with fill_stream_scope(filler, device):
                result = run_worker(config, listener=filler, leave_flag=leave_flag, replica_listeners=replica_fillers[1:])
        finally:
            if filler is not None:
                filler.close()
    except UserInputError as err:
        sys.stderr.write(f"spotfill worker: error: {err}\n")
        return 2
    sys.stderr.write(f"spotfill worker: left ({result.reason}) after {result.steps} steps, "
                     f"{result.samples_accepted} samples accepted\n")
    sys.stdout.flush()
    exit_now(0)  # skip gloo teardown, which can wait on a peer that already went


if __name__ == "__main__":
    run_then_exit(main)  # however main ends: a plug-in's thread or helper process does not outlive it
