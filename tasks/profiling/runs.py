"""Shared plumbing for profiling runs: start a PS, read its telemetry, stop everything.

Every run is bounded by a timeout and always cleaned up (the provider terminates every instance
of the run), so a failed profile leaks no process or instance.
"""
from __future__ import annotations

import math
import secrets
import time

from tasks.profiling.measurements import ProfilingError
from tasks.providers.base import Provider

DIVERGED_FACTOR = 10.0  # a loss this many times the first one counts as diverged
WARMUP_UPDATES = 3  # per worker: the first steps pay for start-up and are not steady state


def fresh_run_id(prefix: str) -> str:
    """A run id not used before: provider launches are idempotent per run id, so a second
    profiling session under an old id would get the old (finished) instances back."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def worker_batch(provider: Provider, instance_type: str, batch_per_gpu: int) -> tuple[int, int]:
    """(gpus, samples per iteration) of one instance of a type."""
    types = {t.name: t for t in provider.list_types()}
    if instance_type not in types:
        raise ProfilingError(f"unknown instance type {instance_type!r}; {provider.name} offers {', '.join(types)}")
    gpus = types[instance_type].gpus
    return gpus, gpus * batch_per_gpu


def start_workers(run, instance_type: str, count: int, batch_size: int) -> None:
    """Launch a profiling run's workers, all of them: a measurement on fewer workers than asked
    would be a wrong one, so a spot market short of them stops profiling with what it refused."""
    from tasks.runtime.driver import add_workers  # deferred: torch (start-up cost)

    refused = add_workers(run, instance_type, count, batch_size=batch_size).refused
    if refused:
        why = "; ".join(r.message for r in refused.values())
        raise ProfilingError(f"profiling needs {count} x {instance_type} and the spot market refused "
                             f"{sum(r.missing for r in refused.values())} ({why}): profile when it has capacity, "
                             f"leave {instance_type} out of the candidates, or pass a measured profile (--profile)")


def check_not_diverged(updates: list[dict], where: str) -> None:
    """Non-finite losses, or a loss DIVERGED_FACTOR times the first: the run diverged."""
    if not updates:
        return
    first = updates[0]["loss"]
    for u in updates:
        loss = u["loss"]
        if not math.isfinite(loss) or (first > 0 and loss > DIVERGED_FACTOR * first):
            raise ProfilingError(f"{where}: the loss diverged ({loss:.4g} at update {u['version']}, "
                                 f"first {first:.4g}); lower the learning rate or check the workload")


def wait_until(run, condition, deadline_s: float, poll_s: float = 0.1, what: str = "in time"):
    """Wait until `condition(progress)` holds or the PS stopped (monotonic `deadline_s`);
    ProfilingError when a worker was lost or the deadline passed."""
    while True:
        progress = run.progress()
        if progress.stopped == "diverged":
            raise ProfilingError(f"run {run.run_id}: the loss diverged (NaN or infinite after "
                                 f"{progress.updates_total} updates); lower the learning rate or check the workload")
        if progress.stopped or condition(progress):
            return progress
        if any(w.left == "lost" for w in progress.workers.values()):
            raise ProfilingError(f"run {run.run_id}: a worker was lost after {progress.updates_total} updates; "
                                 f"see {run.run_dir}/logs/")
        if time.monotonic() > deadline_s:
            raise ProfilingError(f"run {run.run_id}: not finished {what} "
                                 f"({progress.updates_total} updates so far)")
        time.sleep(poll_s)


def update_records(run) -> list[dict]:
    run.progress()
    return [r for r in run.reader.records if r["kind"] == "update"]
