"""What profiling measures, as plain pydantic records (units in the names; MB = 1e6 bytes).

The runtime and the emulated network speak megabits per second; the model and the profile speak
megabytes per second (docs/formats.md). `megabits_to_mbps` converts one to the other.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tasks.core.errors import UserInputError

_CONFIG = ConfigDict(allow_inf_nan=False)


class ProfilingError(UserInputError):
    """A profiling run or fit cannot give a trustworthy number; the message names the cause."""


def cluster_label(cluster: dict[str, int], short: bool = False) -> str:
    """{"p3.2xlarge": 1, "g3.8xlarge": 2} -> "p3.2xlarge=1,g3.8xlarge=2" (short: "p3=1,g3=2", for plots)."""
    return ",".join(f"{t.split('.')[0] if short else t}={n}" for t, n in cluster.items())


def megabits_to_mbps(megabits_per_s: float) -> float:
    """Megabits per second (network units) -> megabytes per second (the profile's `_mbps`)."""
    return megabits_per_s / 8.0


class MemoryPoint(BaseModel):
    model_config = _CONFIG
    batch_per_gpu: int
    peak_bytes: int


class TypeMeasurement(BaseModel):
    """One instance type, profiled alone (one worker, one PS) for about 30 iterations."""

    model_config = _CONFIG
    type: str
    gpus: int
    batch_per_gpu: int
    compute_time_s: float  # Tcomp of the instance at gpus * batch_per_gpu (median of steady steps)
    comm_time_s: float  # push + pull alone (median), a multi-GPU type's intra-instance sum included
    intra_sum_s: float | None = None  # a multi-GPU type's sum of its replicas' gradients (median; None: one GPU)
    iteration_time_s: float  # compute + comm alone
    param_mb: float  # S: bytes pushed (and pulled) per iteration / 1e6
    required_bandwidth_mbps: float  # Breq = 2 S / (comm alone - intra_sum_s): the PS link's part
    spot_price: float
    on_demand_price: float
    gpu_memory_gb: float
    memory_device: str  # "cuda:<GPU model>" (peak allocated) or "cpu" (see tasks.profiling.memory)
    memory_points: list[MemoryPoint] = []
    alpha2: float | None = None  # Eq. 10: batch_per_gpu ~ alpha2 * memory_gb + beta2
    beta2: float | None = None
    max_batch_per_gpu: int | None = None  # 2 ** floor(log2(alpha2 * gpu_memory_gb / gpus + beta2))
    iterations: int
    steps: list[dict] = []  # raw per-update records used (compute_s, comm_s, loss)
    wall_s: float  # the whole profiling job, start-up included


class WorkerObservation(BaseModel):
    model_config = _CONFIG
    worker: int
    type: str
    batch: int
    updates: int
    compute_time_s: float
    comm_time_s: float
    iteration_time_s: float


class ClusterMeasurement(BaseModel):
    """One small heterogeneous cluster trained for a short time."""

    model_config = _CONFIG
    cluster: dict[str, int]
    workers: list[WorkerObservation]
    ps_bandwidth_mbps: float  # the PS bandwidth the run had (emulation cap or PS NIC)
    updates_total: int
    duration_s: float  # first update to last update
    ps_throughput_mbps: float  # bytes through the PS per second (both directions) over the run
    losses: list[tuple[int, float]]  # (update index j, smoothed loss as the PS computes it)
    wall_s: float

    @property
    def n(self) -> int:
        return sum(self.cluster.values())

