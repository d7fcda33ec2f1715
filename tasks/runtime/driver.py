"""The plain-Python API the flows call to run training on a provider.

    provider = LocalProvider()
    run = start_run(provider, "run-1", "resnet20", ps_type="p3.2xlarge", max_updates=500)
    add_workers(run, "g4dn.4xlarge", 2, batch_size=64)
    progress = wait_for(run, lambda p: p.samples_total >= 10_000, timeout_s=600)
    final = stop_run(run)         # the PS stops, workers leave, every instance is terminated

The PS runs as an on-demand instance of the provider; workers are spot instances whose Startup is
`python -m tasks.runtime.worker --ps HOST:PORT --workload W --batch-size B ...`. Progress comes
from the PS's telemetry (tasks.runtime.telemetry) while training runs.
"""
from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tasks.core.errors import UserInputError, shown
from tasks.core.limits import ps_bind_address
from tasks.providers.base import Instance, LaunchResult, Provider, Startup
from tasks.runtime import lease
from tasks.runtime.cuts import shard_dir
from tasks.runtime.evaluation import DEFAULT_EVAL_EVERY_UPDATES, parse_target_metric
from tasks.runtime.lifetime import pid_alive
from tasks.runtime.ps import ERROR_FILE, READY_FILE, STOP_FILE
from tasks.runtime.telemetry import ClusterProgress, TelemetryReader
from tasks.runtime.worker import check_one_gpu_device
from tasks.runtime.workloads import check_workload


@dataclass
class TrainingRun:
    run_id: str
    run_dir: Path
    provider: Provider
    ps_address: str  # host:port workers connect to (host:port,... for the shards of a sharded PS)
    ps_instance: Instance  # shard 0's
    workload: str
    workload_options: dict = field(default_factory=dict)
    ps_settings: dict = field(default_factory=dict)  # start_run's PS keyword arguments, for restarts
    reader: TelemetryReader | None = None
    ps_instances: list[Instance] = field(default_factory=list)  # every shard's, in shard order
    lease_s: float | None = None  # the run's lease (lease.py); None: its processes die with this one
    lease_renewed_s: float = 0.0  # monotonic time of the last renewal

    @property
    def lease_place(self) -> Path | str:
        return lease_place(self.run_dir, self.ps_settings.get("durable_url"))

    def progress(self) -> ClusterProgress:
        """Cluster totals so far: samples, updates, smoothed loss, per-worker step times. Whoever
        watches the run polls this, so it also keeps the run's lease (every lease.RENEW_EVERY_S)."""
        self.keep_lease()
        if self.reader is None:
            self.reader = TelemetryReader(self.run_dir)
        return self.reader.poll()

    def keep_lease(self) -> None:
        self.lease_renewed_s = kept_lease(self.lease_place, self.lease_s, self.lease_renewed_s)


FULL_DISK_BYTES = 1 << 20  # less free than this under a run folder: a silent exit is put down to it


def kept_lease(place: Path | str, lease_s: float | None, renewed_s: float) -> float:
    """Renew the lease at `place` if lease.RENEW_EVERY_S has passed since `renewed_s` (monotonic
    s; no lease when lease_s is None); returns when it was renewed last."""
    if lease_s is not None and time.monotonic() - renewed_s >= lease.RENEW_EVERY_S:
        lease.renew(place, lease_s)
        return time.monotonic()
    return renewed_s


def lease_place(run_dir: Path, durable_url: str | None) -> Path | str:
    """Where the run's lease is: beside its durable checkpoints when they are in S3 (the PS runs
    on another machine), else in its run folder."""
    return f"{durable_url.rstrip('/')}/{lease.LEASE_FILE}" if durable_url else run_dir / lease.LEASE_FILE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _option_args(options: dict) -> list[str]:
    return [arg for key, value in options.items() for arg in ("--workload-opt", f"{key}={value}")]


def ps_startup(run_dir: Path, port: int, workload: str, workload_options: dict, *, ps_mbps: float | None = None,
               checkpoint_every_s: float = 30.0, checkpoint_every_updates: int | None = None,
               max_updates: int | None = None, target_loss: float | None = None, shard: int = 0,
               num_ps: int = 1, async_rule: str | None = None, leased: bool = False,
               durable_url: str | None = None, eval_every_updates: int | None = DEFAULT_EVAL_EVERY_UPDATES,
               target_metric: str | None = None) -> Startup:
    argv = ["python", "-m", "tasks.runtime.ps", "--run-dir", str(run_dir), "--port", str(port),
            "--workload", workload, *_option_args(workload_options),
            "--checkpoint-every-s", repr(checkpoint_every_s), "--shard", str(shard), "--num-shards", str(num_ps)]
    if leased:
        argv += ["--lease", str(lease_place(run_dir, durable_url))]
    argv += ["--no-eval"] if eval_every_updates is None else ["--eval-every-updates", str(eval_every_updates)]
    for flag, value in (("--ps-mbps", ps_mbps), ("--checkpoint-every-updates", checkpoint_every_updates),
                        ("--max-updates", max_updates), ("--target-loss", target_loss),
                        ("--async-rule", async_rule), ("--durable-url", durable_url), ("--target-metric", target_metric)):
        if value is not None:
            argv += [flag, str(value)]
    return Startup(tuple(argv), detached=leased)


def start_run(provider: Provider, run_id: str, workload: str, *, workload_options: dict | None = None,
              run_dir: Path | None = None, ps_type: str | None = None, port: int | None = None,
              ps_mbps: float | None = None, checkpoint_every_s: float = 30.0,
              checkpoint_every_updates: int | None = None, max_updates: int | None = None,
              target_loss: float | None = None, plan_id: str = "ps", ready_timeout_s: float = 120.0,
              num_ps: int = 1, ports: list[int] | None = None, async_rule: str | None = None,
              lease_s: float | None = None, durable_url: str | None = None,
              eval_every_updates: int | None = DEFAULT_EVAL_EVERY_UPDATES, target_metric: str | None = None) -> TrainingRun:
    """Start the PS as on-demand instances (`num_ps` shards, each owning an equal share of the
    parameter bytes, docs/runtime.md) and wait until all listen. A run directory holding
    checkpoints resumes from them; a restart after a PS failure passes a new `plan_id` (launches
    are idempotent per plan id) and the old ports, so the workers find them again. With `lease_s`
    the run is detached: it trains on without this process for up to `lease_s` seconds after
    the last renewal (lease.py; progress() renews it), then stops by itself. With `durable_url`
    (s3://BUCKET/PREFIX) the PS copies its checkpoints there and a restarted one starts from them
    (durable.py). A workload with an evaluate(model) is evaluated every `eval_every_updates`
    updates (None: never; periodic_eval.py), and with `target_metric` ("NAME<=X" or "NAME>=X")
    the PS stops once an evaluation meets it."""
    workload_options = workload_options or {}
    ps_bind_address()  # the address each PS will listen on
    target = parse_target_metric(target_metric) if target_metric is not None else None
    # a bad name, plug-in or target metric fails here, before anything starts
    check_workload(workload, workload_options, target_metric=target)
    if max_updates is not None and max_updates <= 0:
        raise UserInputError(f"max_updates must be positive, got {max_updates}")
    if num_ps <= 0:
        raise UserInputError(f"num_ps must be positive, got {num_ps}")
    if lease_s is not None and not lease_s > 0:
        raise UserInputError(f"lease_s must be positive, got {lease_s}")
    # absolute: the PS runs in another working directory (the local provider's is the repository)
    run_dir = Path(run_dir or Path(getattr(provider, "artifacts_dir", "artifacts")) / run_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    if lease_s is not None:  # before the PS starts: it stops at once without a valid lease
        lease.renew(lease_place(run_dir, durable_url), lease_s)
    renewed_s = time.monotonic()
    ports = ports or ([port] if port else []) + [free_port() for _ in range(num_ps - (1 if port else 0))]
    ps_type = ps_type or provider.list_types()[0].name
    instances = []
    for shard in range(num_ps):
        for stale in (READY_FILE, ERROR_FILE):  # an earlier PS's
            (shard_dir(run_dir, shard) / stale).unlink(missing_ok=True)
        startup = ps_startup(run_dir, ports[shard], workload, workload_options, ps_mbps=ps_mbps,
                             checkpoint_every_s=checkpoint_every_s, checkpoint_every_updates=checkpoint_every_updates,
                             max_updates=max_updates, target_loss=target_loss, shard=shard, num_ps=num_ps,
                             async_rule=async_rule, leased=lease_s is not None, durable_url=durable_url,
                             eval_every_updates=eval_every_updates, target_metric=target_metric)
        shard_plan = plan_id if shard == 0 else f"{plan_id}.shard{shard}"
        launched = provider.launch(run_id, shard_plan, ps_type, 1, role="ps", market="on-demand", startup=startup)
        if not launched.instances:  # the PS is on demand: a refusal here is the run's failure
            raise RuntimeError(f"no parameter server: {launched.refused[ps_type].message}")
        instances += launched.instances
    deadline_s = time.monotonic() + ready_timeout_s
    for shard, instance in enumerate(instances):
        while not (shard_dir(run_dir, shard) / READY_FILE).exists():
            if not any(i.instance_id == instance.instance_id for i in provider.describe(run_id)):
                provider.terminate([i.instance_id for i in instances])
                raise RuntimeError(f"the parameter server exited during start-up: "
                                   f"{ps_error(run_dir, shard, instance.instance_id)}")
            if time.monotonic() > deadline_s:
                provider.terminate([i.instance_id for i in instances])
                raise TimeoutError(f"the parameter server did not listen within {ready_timeout_s:g} s")
            # kept while the PS starts: a lease shorter than its start-up would stop it at version 0
            renewed_s = kept_lease(lease_place(run_dir, durable_url), lease_s, renewed_s)
            time.sleep(0.05)
    settings = dict(ps_type=ps_type, ps_mbps=ps_mbps, checkpoint_every_s=checkpoint_every_s,
                    checkpoint_every_updates=checkpoint_every_updates, max_updates=max_updates,
                    target_loss=target_loss, num_ps=num_ps, async_rule=async_rule, lease_s=lease_s, durable_url=durable_url,
                    eval_every_updates=eval_every_updates, target_metric=target_metric)
    address = ",".join(f"{i.address}:{p}" for i, p in zip(instances, ports))
    return TrainingRun(run_id, run_dir, provider, address, instances[0], workload, workload_options, settings,
                       ps_instances=instances, lease_s=lease_s, lease_renewed_s=renewed_s)


def attach_run(provider: Provider, run_id: str, run_dir: Path, ps_address: str, ps_instance_ids: list[str],
               workload: str, workload_options: dict, ps_settings: dict, lease_s: float | None) -> TrainingRun:
    """Take over a leased run another orchestrator started and left (`spotfill run --resume`, a
    Prefect retry): its PS must still run and its lease be valid; the lease is renewed at once,
    held by this process from now on. No PS or worker is started."""
    path = lease_place(run_dir, ps_settings.get("durable_url"))
    owner = lease.owner_pid(path)
    if owner is not None and owner != os.getpid() and pid_alive(owner):
        raise UserInputError(f"run {run_id} is still watched by process {owner}; stop it first (or let it end)")
    alive = {i.instance_id: i for i in provider.describe(run_id)}
    shards = [alive.get(i) for i in ps_instance_ids]
    expires_at_s = lease.expiry_s(path)
    if lease_s is None or not all(shards) or expires_at_s is None or expires_at_s <= time.time():
        raise UserInputError(f"run {run_id} is no longer running (its parameter server has stopped or its lease "
                             f"lapsed): nothing to resume; its last checkpoint is in {run_dir / 'checkpoints'}")
    run = TrainingRun(run_id, run_dir, provider, ps_address, shards[0], workload, workload_options, ps_settings,
                      ps_instances=shards, lease_s=lease_s)
    run.keep_lease()
    return run


def restart_ps(run: TrainingRun, plan_id: str, ready_timeout_s: float = 120.0, stop_timeout_s: float = 60.0) -> TrainingRun:
    """Start a new PS for a run whose PS (or one of its shards) died: same run directory (it
    resumes from the newest good checkpoint; shards from the newest cut they all have, so the
    shards still alive are stopped first and roll back with the restarted one), same ports (the
    workers rejoin by themselves), same settings; `plan_id` must be new (launches are idempotent
    per plan id)."""
    shards = run.ps_instances or [run.ps_instance]
    alive = {i.instance_id for i in run.provider.describe(run.run_id)}
    survivors = [i.instance_id for i in shards if i.instance_id in alive]
    if survivors:
        run.provider.terminate(survivors)
        deadline_s = time.monotonic() + stop_timeout_s
        while {i.instance_id for i in run.provider.describe(run.run_id)} & set(survivors):
            if time.monotonic() > deadline_s:
                raise TimeoutError(f"run {run.run_id}: the surviving PS shards did not stop within {stop_timeout_s:g} s")
            time.sleep(0.05)
    ports = [int(address.rsplit(":", 1)[1]) for address in run.ps_address.split(",")]
    return start_run(run.provider, run.run_id, run.workload, workload_options=run.workload_options,
                     run_dir=run.run_dir, ports=ports, plan_id=plan_id, ready_timeout_s=ready_timeout_s,
                     **run.ps_settings)


def worker_startup(run: TrainingRun, batch_size: int, extra_args: tuple[str, ...] = ()) -> Startup:
    if batch_size <= 0:
        raise UserInputError(f"batch size must be positive, got {batch_size}")
    return Startup(("python", "-m", "tasks.runtime.worker", "--ps", run.ps_address, "--workload", run.workload,
                    *_option_args(run.workload_options), "--batch-size", str(batch_size), *extra_args),
                   detached=run.lease_s is not None)  # a leased run's workers end with its PS


def add_workers(run: TrainingRun, instance_type: str, count: int, batch_size: int, *, plan_id: str = "p0",
                extra_args: tuple[str, ...] = ()) -> LaunchResult:
    """Launch `count` spot workers of a type; (plan_id, type) makes the launch idempotent.
    `batch_size` is the instance's: a type with g GPUs trains g replicas at batch_size / g."""
    gpus = next((t.gpus for t in run.provider.list_types() if t.name == instance_type), 1)
    if "--device" in extra_args:  # a multi-GPU worker given one GPU: refused here, not by each process
        check_one_gpu_device(extra_args[extra_args.index("--device") + 1], gpus)
    return run.provider.launch(run.run_id, plan_id, instance_type, count, role="worker", market="spot",
                               startup=worker_startup(run, batch_size, extra_args))


def wait_for(run: TrainingRun, condition: Callable[[ClusterProgress], bool], timeout_s: float,
             poll_s: float = 0.1) -> ClusterProgress:
    """Poll the telemetry until `condition(progress)` holds or the PS stopped; TimeoutError after
    timeout_s."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        progress = run.progress()
        if condition(progress) or progress.stopped:
            return progress
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"run {run.run_id}: condition not met within {timeout_s:g} s "
                               f"({progress.updates_total} updates, loss {progress.smoothed_loss})")
        time.sleep(poll_s)


def last_log_line(run_dir: Path, instance_id: str) -> str:
    """"ID's log ends: LINE": what a process that exited said last (its error, usually). A process
    that could say nothing may have had no room to: a full disk under the run folder is named."""
    log = run_dir / "logs" / f"{instance_id}.log"
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    if lines:
        return f"{instance_id}'s log ends: {lines[-1][:200]}"
    try:
        free_bytes = shutil.disk_usage(run_dir).free
    except OSError:
        free_bytes = None
    if free_bytes is not None and free_bytes < FULL_DISK_BYTES:
        return f"{instance_id} left no log: the disk holding {shown(str(run_dir))} is full ({free_bytes} bytes free)"
    return f"{instance_id} left no log"


def ps_error(run_dir: Path, shard: int, instance_id: str) -> str:
    """What a PS shard that exited said about why: its error file, else its log's last line."""
    path = shard_dir(run_dir, shard) / ERROR_FILE
    try:
        error = " ".join(path.read_text(errors="replace").split())[:400] if path.is_file() else ""
    except OSError:
        error = ""
    return error or last_log_line(run_dir, instance_id)


def ps_failure(run: TrainingRun) -> str | None:
    """Why the PS failed, in one line, once a shard has: it stopped as failed (its error file), or
    exited without having stopped (killed, or a crash too sudden to say so). None while it runs
    or after a clean stop. Part of every stop decision: a dead PS trains nobody."""
    alive = {i.instance_id for i in run.provider.describe(run.run_id)}
    for shard, instance in enumerate(run.ps_instances or [run.ps_instance]):
        directory = shard_dir(run.run_dir, shard)
        if (directory / ERROR_FILE).exists():
            return ps_error(run.run_dir, shard, instance.instance_id)
        # a shard's stop record is written before it exits: read after seeing it gone, it tells
        # a clean stop from a death (read whole, and only then: a resume clears an earlier stop)
        if instance.instance_id not in alive and TelemetryReader(directory).poll().stopped in (None, "failed"):
            return f"the parameter server exited: {ps_error(run.run_dir, shard, instance.instance_id)}"
    return None


def stop_run(run: TrainingRun, timeout_s: float = 60.0) -> ClusterProgress:
    """Ask the PS to stop (workers hear it at their next exchange), wait for it, then terminate
    every instance of the run."""
    try:
        (run.run_dir / STOP_FILE).touch()
        deadline_s = time.monotonic() + timeout_s
        shards = {i.instance_id for i in run.ps_instances or [run.ps_instance]}
        while time.monotonic() < deadline_s:  # every shard stops at the same cut (cuts.py)
            if not shards & {i.instance_id for i in run.provider.describe(run.run_id)}:
                break
            if run.progress().stopped is not None and len(shards) == 1:
                break
            time.sleep(0.1)
    finally:
        run.provider.cleanup(run.run_id)
    return run.progress()
