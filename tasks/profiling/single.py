"""Single-instance profiling: one worker of a type alone with the PS for about 30 iterations.

Measures compute time per iteration, push+pull time alone (hence Breq = 2 S / comm), a
multi-GPU type's intra-instance sum per iteration (taken out of comm for Breq; the fit estimates
the PCIe bandwidth from it), the parameter size S from the workload's flat parameter vector, and peak memory against batch size
for Eq. 10 (tasks.profiling.memory).
"""
from __future__ import annotations

import statistics
import time

from tasks.profiling.fit import fit_memory, max_batch_per_gpu
from tasks.profiling.measurements import ProfilingError, TypeMeasurement
from tasks.profiling.memory import measure_memory
from tasks.profiling.runs import (
    WARMUP_UPDATES, check_not_diverged, start_workers, update_records, wait_until, worker_batch,
)
from tasks.providers.base import Provider

MEMORY_BATCHES = (1, 2, 4, 8, 16)


def param_mb(workload: str, workload_options: dict | None) -> float:
    """S: the float32 vector a worker pushes (and pulls) per iteration, in MB (1e6 bytes)."""
    from tasks.runtime import wire  # deferred: torch (start-up cost)
    from tasks.runtime.workloads import build_workload  # deferred: torch (start-up cost)

    return wire.flat_size(build_workload(workload, workload_options or {}).model) * 4 / 1e6


def profile_type(provider: Provider, run_id: str, workload: str, instance_type: str, *, iterations: int = 30,
                 workload_options: dict | None = None, batch_per_gpu: int = 16, ps_megabits_per_s: float | None = None,
                 ps_type: str | None = None, memory_batches=MEMORY_BATCHES, memory_device: str = "auto",
                 timeout_s: float = 300.0) -> TypeMeasurement:
    from tasks.runtime.driver import start_run, stop_run  # deferred: torch (start-up cost)

    if iterations <= WARMUP_UPDATES + 2:
        raise ProfilingError(f"{instance_type}: {iterations} iterations are too few to measure "
                             f"(the first {WARMUP_UPDATES} are warm-up)")
    started_s = time.monotonic()
    itype = {t.name: t for t in provider.list_types()}.get(instance_type)
    gpus, batch = worker_batch(provider, instance_type, batch_per_gpu)
    run = start_run(provider, run_id, workload, workload_options=workload_options, ps_type=ps_type or instance_type,
                    ps_mbps=ps_megabits_per_s, max_updates=iterations, checkpoint_every_s=3600.0,
                    eval_every_updates=None)  # the worker's own times alone: nothing else on the PS
    try:
        start_workers(run, instance_type, 1, batch)
        wait_until(run, lambda p: False, time.monotonic() + timeout_s)
        updates = update_records(run)
    finally:
        stop_run(run)
    check_not_diverged(updates, f"profiling {instance_type}")
    steady = updates[WARMUP_UPDATES:]
    comms = [u["comm_s"] for u in steady if u["comm_s"] is not None]
    if len(comms) < 3:
        raise ProfilingError(f"{instance_type}: only {len(comms)} steady iterations measured; too few to fit")
    compute_s = statistics.median(u["compute_s"] for u in steady)
    comm_s = statistics.median(comms)
    sums = [u["intra_sum_s"] for u in steady if u.get("intra_sum_s") is not None]
    intra_sum_s = statistics.median(sums) if sums else None
    link_s = comm_s - (intra_sum_s or 0.0)  # the PS link's part of the communication
    if link_s <= 0:
        raise ProfilingError(f"{instance_type}: the intra-instance sum ({intra_sum_s:.4f} s) took as long as the "
                             f"whole communication ({comm_s:.4f} s); too noisy to fit")
    size_mb = param_mb(workload, workload_options)

    device, points = measure_memory(workload, workload_options, memory_batches, memory_device)
    memory = fit_memory([p.batch_per_gpu for p in points], [p.peak_bytes for p in points])
    alpha2, beta2 = memory.params["alpha2"], memory.params["beta2"]
    gpu_memory_gb = itype.gpu_memory_gb if itype else 0.0
    per_gpu_gb = gpu_memory_gb / gpus if gpus else 0.0
    return TypeMeasurement(
        type=instance_type, gpus=gpus, batch_per_gpu=batch_per_gpu, compute_time_s=compute_s, comm_time_s=comm_s,
        intra_sum_s=intra_sum_s, iteration_time_s=compute_s + comm_s, param_mb=size_mb,
        required_bandwidth_mbps=2 * size_mb / link_s,
        spot_price=itype.spot_usd_per_h, on_demand_price=itype.on_demand_usd_per_h, gpu_memory_gb=gpu_memory_gb,
        memory_device=device, memory_points=points, alpha2=alpha2, beta2=beta2,
        max_batch_per_gpu=max_batch_per_gpu(alpha2, beta2, per_gpu_gb) if per_gpu_gb > 0 else None,
        iterations=len(updates),
        steps=[{"step": u["step"], "compute_s": u["compute_s"], "comm_s": u["comm_s"],
                "intra_sum_s": u.get("intra_sum_s"), "loss": u["loss"]} for u in updates],
        wall_s=time.monotonic() - started_s,
    )
