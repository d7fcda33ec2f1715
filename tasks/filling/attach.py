"""What the training runtime calls: `build_worker_filler(config)` -> a started filler (a
tasks.core.phases.PhaseListener with `metrics()` and `close()`), or a do-nothing one when disabled.

Online load: a worker has no front end of its own, so the filler generates a seeded Poisson
arrival stream at `online_rate_per_s` (0 = none); offline work scores the model's dataset.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.core.atomic import atomic_write_json
from tasks.core.errors import UserInputError
from tasks.core.inputs import loads_json
from tasks.core.limits import MAX_SEED
from tasks.core.phases import NoListener
from tasks.core.profile import format_validation_error
from tasks.filling.baselines import OpenAdmission, RateLimitedAdmission
from tasks.filling.filler import Filler
from tasks.filling.gate import Gate
from tasks.filling.guard import StepTimeGuard
from tasks.filling.monitor import BubbleMonitor
from tasks.filling.scheduler import CostModel, OnlineQueue, PoissonArrivals, Scheduler

Policy = Literal["gated", "naive", "naive_split", "rate_limited"]


class FillConfig(BaseModel):
    """Inference filling on one worker. Validated: bad values -> one-line UserInputError."""
    # strict: `true` is no rate of 1 and 2.0 no count (an int stands for a float, nothing else)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    enabled: bool = True
    device: Literal["cpu", "cuda"] = "cpu"
    model: Literal["cnn", "transformer", "resnet50", "bert"] = "cnn"
    online_rate_per_s: float = Field(10.0, ge=0)
    slo_s: float = Field(0.25, gt=0)
    queue_capacity: int = Field(64, ge=1)
    max_in_flight: int = Field(1, ge=1, le=16)  # K
    margin: float = Field(0.25, ge=0)  # chunk cost * (1 + margin) must fit the predicted remainder
    margin_s: float = Field(0.0, ge=0)
    # share of wall time online requests may run outside bubbles (scaled by the guard's budget)
    online_reserve: float = Field(0.02, ge=0, le=1)
    # a request waits for the next bubble when it is predicted to open within this bound, else it
    # runs at once from the online reserve; None: half the SLO
    online_max_wait_s: float | None = Field(None, ge=0)
    tolerance: float = Field(0.02, gt=0)  # guard: allowed compute-time drift over solo
    calibration_steps: int = Field(5, ge=1)  # guard: compute phases per solo baseline
    rebaseline_every: int = Field(50, ge=1)  # guard: steps between fresh solo baselines
    max_batch: int = Field(32, ge=1, le=4096)
    intra_op_threads: int = Field(1, ge=1)
    # CPU: "realtime" runs the online lane's thread SCHED_FIFO, so a request served during
    # training's compute (from the online reserve, which bounds what it takes) preempts training's
    # threads instead of sharing cores with them; needs CAP_SYS_NICE, else it runs at normal
    # priority and metrics say so (`online_priority`). CUDA: lanes use low-priority streams.
    online_priority: Literal["realtime", "normal"] = "realtime"
    slots: int = Field(1, ge=1)
    memory_budget_mb: float | None = Field(None, gt=0)  # CPU: default = half of MemAvailable
    dataset_size: int = Field(1024, ge=1)
    rate_limited_duty: float = Field(0.3, gt=0, le=1)  # only for the TGS-like baseline
    seed: int = Field(0, ge=0, le=MAX_SEED)  # numpy's seed range: a negative one fails only once running


def parse_fill_config(data: dict, source: str = "fill config") -> FillConfig:
    try:
        return FillConfig(**data)
    except ValidationError as err:
        raise UserInputError(format_validation_error(err, source)) from None


def available_memory_mb(config: FillConfig) -> float:
    """Memory inference may use: on CUDA the device's free memory (torch.cuda.mem_get_info); on
    CPU `memory_budget_mb`, or half of the kernel's MemAvailable when not given."""
    if config.device == "cuda":
        import torch

        free_bytes, _total = torch.cuda.mem_get_info()
        return free_bytes / 2**20
    if config.memory_budget_mb is not None:
        return config.memory_budget_mb
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024 / 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**20 / 2


def check_memory_fits(config: FillConfig, workload=None, copies: int = 1) -> None:
    """UserInputError (one line) unless `copies` fillers of `config` fit the memory left for
    inference (available_memory_mb); the need is estimated on the CPU (models.memory_needed_mb),
    so nothing has touched the GPU when it refuses."""
    from tasks.filling.models import build_workload, memory_needed_mb  # deferred: torch (start-up cost)

    check_device(config)
    workload = workload or build_workload(config.model, config.dataset_size, config.seed)
    need_mb = copies * memory_needed_mb(workload, config.max_batch)
    have_mb = available_memory_mb(config)
    if need_mb > have_mb:
        what = f"inference model {config.model}" + (f" x {copies}" if copies > 1 else "")
        raise UserInputError(
            f"{what} needs ~{need_mb:.0f} MB at batch {config.max_batch} "
            f"but only {have_mb:.0f} MB remain for inference; lower max_batch or raise the budget")


def check_device(config: FillConfig) -> None:
    import torch

    if config.device == "cuda" and not torch.cuda.is_available():
        raise UserInputError("fill config: device is cuda but torch sees no CUDA device")


def online_max_wait(config: FillConfig) -> float:
    """The gate's bound on how long a request waits for a bubble (half the SLO by default)."""
    return config.slo_s / 2 if config.online_max_wait_s is None else config.online_max_wait_s


def assemble(config: FillConfig, policy: Policy = "gated"):
    """Build (not start) a filler for `policy`; checks the device and the memory first."""
    from tasks.filling.executor import CpuExecutor, CudaExecutor  # deferred: torch (start-up cost)
    from tasks.filling.models import build_workload  # deferred: torch (start-up cost)

    check_device(config)
    workload = build_workload(config.model, config.dataset_size, config.seed)
    check_memory_fits(config, workload)  # on the CPU: nothing is on the GPU yet
    if config.device == "cuda":
        workload = workload.to("cuda")
    monitor = BubbleMonitor(slots=config.slots)
    guard = StepTimeGuard(config.tolerance, config.calibration_steps, config.rebaseline_every)
    arrivals = (PoissonArrivals(config.online_rate_per_s, config.seed)
                if config.online_rate_per_s > 0 else None)
    scheduler = Scheduler(OnlineQueue(config.queue_capacity, config.slo_s), arrivals,
                          CostModel(config.max_batch), config.dataset_size,
                          online_costs=CostModel(config.max_batch))
    if policy == "gated":
        admission = Gate(monitor, guard, config.max_in_flight, config.margin, config.margin_s,
                         config.online_reserve, online_max_wait(config), waited_s=scheduler.oldest_wait_s)
    elif policy in ("naive", "naive_split"):
        admission = OpenAdmission(config.max_in_flight)
    else:
        admission = RateLimitedAdmission(guard, config.rate_limited_duty, burst_s=0.05,
                                         max_in_flight=config.max_in_flight)
    if policy in ("gated", "naive_split"):
        lanes = ["online"] * (arrivals is not None) + ["offline"] * config.max_in_flight
    else:
        lanes = ["any"] * config.max_in_flight
    executor = (CudaExecutor(workload) if config.device == "cuda"
                else CpuExecutor(workload, config.intra_op_threads, config.online_priority))
    return Filler(monitor, guard, admission, scheduler, executor, lanes)


class DisabledFiller(NoListener):
    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass


CONFIG_ENV = "SPOTFILL_FILL_CONFIG"  # JSON object of FillConfig fields a worker's filler takes


def worker_fill_config(config: FillConfig | dict) -> FillConfig:
    """`config` (the worker's own flags) with the fields of $SPOTFILL_FILL_CONFIG on top: how a
    launcher chooses a worker's inference model, batch sizes and gate settings without a flag
    per field."""
    if isinstance(config, FillConfig):
        config = config.model_dump()
    extra = os.environ.get(CONFIG_ENV)
    if not extra:
        return parse_fill_config(config)
    data = loads_json(extra, CONFIG_ENV)  # strictly: a key given twice, NaN, an int past int64 refused
    if not isinstance(data, dict):
        raise UserInputError(f"{CONFIG_ENV}: expected a JSON object")
    # a user's own fields come from the variable: the error names it
    return parse_fill_config({**config, **data}, f"fill config from {CONFIG_ENV}")


def build_worker_filler(config: FillConfig | dict):
    """The runtime's entry point: a calibrated, started gated filler (or a no-op when disabled).
    On CUDA its compute phases are timed by the GPU (DeviceTimedPhases)."""
    config = worker_fill_config(config)
    if not config.enabled:
        return DisabledFiller()
    filler = assemble(config, "gated")
    filler.calibrate()
    filler.start()
    if config.device == "cuda":
        from tasks.filling.cuda_timing import DeviceTimedPhases  # deferred: torch (start-up cost)

        return DeviceTimedPhases(filler)
    return filler


# how the replicas' metrics of one instance combine: counters add up, the rest is the worst replica's
SUMMED = ("inference_samples", "offline_samples", "online_offered", "online_served", "online_shed_overflow",
          "online_shed_expired", "online_shed_paused", "chunks", "busy_s", "busy_in_bubble_s", "spill_s",
          "bubble_s", "bubbles", "guard_shrinks")
WORST_HIGH = ("online_p50_s", "online_p95_s", "online_p99_s", "compute_slowdown", "elapsed_s")


def instance_metrics(replicas: list[dict]) -> dict:
    """One instance's filling metrics from its replicas' (one filler per GPU): the harvest summed,
    the fill efficiency over the summed bubbles, latencies and the compute slowdown the worst
    replica's (percentiles of separate streams do not add up), the smallest guard budget; the
    replicas' own metrics under `per_replica`. {} when filling is off."""
    replicas = [m for m in replicas if m]
    if not replicas:
        return {}
    out = dict(replicas[0])
    for key in SUMMED:
        out[key] = sum(m[key] for m in replicas)
    for key in WORST_HIGH:
        values = [m[key] for m in replicas if m[key] is not None]
        out[key] = max(values) if values else None
    out["guard_budget"] = min(m["guard_budget"] for m in replicas)
    out["fill_efficiency"] = out["busy_in_bubble_s"] / out["bubble_s"] if out["bubble_s"] else 0.0
    out["error"] = next((m["error"] for m in replicas if m["error"]), None)
    out["replicas"] = len(replicas)
    out["per_replica"] = replicas
    return out


class InstanceFiller:
    """The fillers of one instance, one per replica on its own GPU: the worker's loop (replica 0)
    drives the first one's phase edges, replica r drives `fillers[r]`'s; `metrics()` is the
    instance's harvest (instance_metrics)."""

    def __init__(self, fillers: list):
        self.fillers = fillers

    def compute_start(self, step: int) -> None:
        self.fillers[0].compute_start(step)

    def compute_end(self, step: int, compute_s: float | None = None) -> None:
        self.fillers[0].compute_end(step, compute_s)

    def comm_start(self, step: int) -> None:
        self.fillers[0].comm_start(step)

    def comm_end(self, step: int) -> None:
        self.fillers[0].comm_end(step)

    def metrics(self) -> dict:
        return instance_metrics([f.metrics() for f in self.fillers])

    def close(self) -> None:
        for filler in self.fillers:
            filler.close()


def read_worker_metrics(metrics_dir: Path) -> list[dict]:
    """The metrics each worker's ReportingFiller left in `metrics_dir` (unreadable files skipped:
    a worker may be writing its first one)."""
    out = []
    for path in sorted(Path(metrics_dir).glob("*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


class ReportingFiller:
    """A worker's filler that also leaves its metrics in a JSON file (atomically, every
    `every_s` and at close), where the orchestrator's report sums them."""

    def __init__(self, filler, path, every_s: float = 2.0):
        import time

        self.filler, self.path, self.every_s = filler, path, every_s
        self._clock = time.monotonic
        self._last_s = self._clock()

    def compute_start(self, step: int) -> None:
        self.filler.compute_start(step)

    def compute_end(self, step: int, compute_s: float | None = None) -> None:
        self.filler.compute_end(step, compute_s)

    def comm_start(self, step: int) -> None:
        self.filler.comm_start(step)

    def comm_end(self, step: int) -> None:
        self.filler.comm_end(step)
        if self._clock() - self._last_s >= self.every_s:
            self.write()

    def metrics(self) -> dict:
        return self.filler.metrics()

    def write(self) -> None:
        self._last_s = self._clock()
        atomic_write_json(self.path, self.filler.metrics())

    def close(self) -> None:
        self.filler.close()
        self.write()
