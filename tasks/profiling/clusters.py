"""Cluster profiling: a few small clusters trained side by side (in waves) for a short time.

Each cluster is its own run (its own PS and workers). From the telemetry: every worker's steady
compute and push+pull times (for the contention fit) and the cluster's smoothed loss against its
update count (for the loss-curve fit). The smoothing is the PS's own (an exponential moving
average with the PS's factor), so the fitted curve describes the number the PS stops on.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from tasks.profiling.measurements import ClusterMeasurement, ProfilingError, TypeMeasurement, WorkerObservation
from tasks.profiling.runs import WARMUP_UPDATES, check_not_diverged, update_records, wait_until, worker_batch
from tasks.providers.base import Provider


def loss_smoothing() -> float:
    from tasks.runtime.ps import PsConfig

    return PsConfig.__dataclass_fields__["loss_smoothing"].default


def smoothed_losses(updates: list[dict], factor: float) -> list[tuple[int, float]]:
    """(update count j, EMA of the losses so far), as the PS computes it."""
    out, ema = [], None
    for u in updates:
        ema = u["loss"] if ema is None else (1 - factor) * ema + factor * u["loss"]
        out.append((u["version"], ema))
    return out


def worker_observations(updates: list[dict], batches: dict[int, int], where: str) -> list[WorkerObservation]:
    """Each worker's median compute and push+pull time over its steady iterations."""
    by_worker: dict[int, list[dict]] = {}
    for u in updates:
        by_worker.setdefault(u["worker"], []).append(u)
    observations = []
    for worker, rows in sorted(by_worker.items()):
        steady = [r for r in rows[WARMUP_UPDATES:] if r["comm_s"] is not None]
        if len(steady) < 3:
            raise ProfilingError(f"{where}: worker {worker} made only {len(rows)} updates; "
                                 "too few to measure (run the clusters longer)")
        compute_s = statistics.median(r["compute_s"] for r in steady)
        comm_s = statistics.median(r["comm_s"] for r in steady)
        observations.append(WorkerObservation(worker=worker, type=rows[0]["instance_type"], batch=batches[worker],
                                              updates=len(rows), compute_time_s=compute_s, comm_time_s=comm_s,
                                              iteration_time_s=compute_s + comm_s))
    return observations


def profile_clusters(provider: Provider, run_id: str, workload: str, measurements: list[TypeMeasurement],
                     clusters: list[dict[str, int]], *, duration_s: float = 30.0, workload_options: dict | None = None,
                     ps_megabits_per_s: float | None = None, ps_bandwidth_mbps: float | None = None,
                     ps_type: str | None = None, side_by_side: int | None = None,
                     timeout_s: float = 600.0) -> list[ClusterMeasurement]:
    """Train every cluster for about `duration_s` seconds of updates each, `side_by_side` at a time
    (default: all at once), in the order given.

    `ps_megabits_per_s` caps the PS's emulated NIC (local provider); `ps_bandwidth_mbps` is the PS
    bandwidth recorded for the fit (MB/s), by default that cap / 8, or without a cap the PS
    instance type's NIC (`network_mbytes_per_s`, already MB/s). On a small machine the processes of many clusters at once compete for
    the cores and stretch the communication times the contention fit reads; waves keep that down.
    """
    from tasks.profiling.measurements import megabits_to_mbps

    by_type = {m.type: m for m in measurements}
    for cluster in clusters:
        missing = set(cluster) - set(by_type)
        if missing:
            raise ProfilingError(f"cluster {cluster}: types {sorted(missing)} were not profiled alone first")
        if sum(cluster.values()) < 1:
            raise ProfilingError(f"cluster {cluster} has no workers")
    if side_by_side is not None and side_by_side < 1:
        raise ProfilingError(f"side_by_side must be at least 1, got {side_by_side}")
    if ps_bandwidth_mbps is None:
        if ps_megabits_per_s is None:  # not capped: the PS instance's own NIC
            types = {t.name: t for t in provider.list_types()}
            ps_bandwidth_mbps = types[ps_type or next(iter(clusters[0]))].network_mbytes_per_s
        else:
            ps_bandwidth_mbps = megabits_to_mbps(ps_megabits_per_s)
    started_s = time.monotonic()
    wave = side_by_side or len(clusters)
    runs = []
    for first in range(0, len(clusters), wave):
        runs += _train_side_by_side(provider, run_id, workload, by_type, list(enumerate(clusters))[first:first + wave],
                                    duration_s=duration_s, workload_options=workload_options,
                                    ps_megabits_per_s=ps_megabits_per_s, ps_type=ps_type, timeout_s=timeout_s)
    wall_s = time.monotonic() - started_s
    factor = loss_smoothing()
    results = []
    for cluster, run in zip(clusters, runs):
        where = f"profiling cluster {cluster}"
        updates = update_records(run)
        check_not_diverged(updates, where)
        batches = {r["worker"]: r["batch_size"] for r in run.reader.records if r["kind"] == "join"}
        workers = worker_observations(updates, batches, where)
        if len(workers) != sum(cluster.values()):
            raise ProfilingError(f"{where}: only {len(workers)} of {sum(cluster.values())} workers trained")
        span_s = updates[-1]["t"] - updates[0]["t"]
        size_mb = measurements[0].param_mb
        results.append(ClusterMeasurement(
            cluster={t: n for t, n in cluster.items() if n}, workers=workers, ps_bandwidth_mbps=ps_bandwidth_mbps,
            updates_total=len(updates), duration_s=span_s, ps_throughput_mbps=2 * size_mb * len(updates) / span_s,
            losses=smoothed_losses(updates, factor), wall_s=wall_s,
        ))
    return results


def _train_side_by_side(provider: Provider, run_id: str, workload: str, by_type: dict[str, TypeMeasurement],
                        numbered: list[tuple[int, dict[str, int]]], *, duration_s: float, workload_options: dict | None,
                        ps_megabits_per_s: float | None, ps_type: str | None, timeout_s: float) -> list:
    """Start the clusters at once, wait until each trained `duration_s`, stop them all (always)."""
    from tasks.runtime.driver import add_workers, start_run, stop_run

    runs = []

    def start(k_cluster):
        k, cluster = k_cluster
        run = start_run(provider, f"{run_id}-c{k}", workload, workload_options=workload_options,
                        ps_type=ps_type or next(iter(cluster)), ps_mbps=ps_megabits_per_s, checkpoint_every_s=3600.0)
        runs.append(run)
        for instance_type, count in cluster.items():
            if count:
                batch = worker_batch(provider, instance_type, by_type[instance_type].batch_per_gpu)[1]
                add_workers(run, instance_type, count, batch_size=batch)
        return run

    def long_enough(p) -> bool:
        return p.first_update_t is not None and p.last_update_t - p.first_update_t >= duration_s

    try:
        with ThreadPoolExecutor(len(numbered)) as pool:  # the PSs start side by side
            ordered = list(pool.map(start, numbered))
        deadline_s = time.monotonic() + timeout_s
        for run in ordered:
            wait_until(run, long_enough, deadline_s)
    finally:
        for run in runs:
            stop_run(run)
    return ordered
