"""Profile a workload end to end with a preset: every type alone, the clusters, the fit, the store.

Used by `spotfill profile` and `spotfill validate`; the Prefect pipeline calls the same steps
(profile_type, profile_clusters, fit_profile, save_profile) as tasks of its own.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from tasks.profiling.clusters import profile_clusters
from tasks.profiling.fit import fit_profile
from tasks.profiling.presets import Preset
from tasks.profiling.runs import fresh_run_id
from tasks.profiling.single import profile_type
from tasks.profiling.store import RawMeasurements, cache_key, cached_profile, provenance, save_profile


def preset_settings(p: Preset, emulation: dict) -> dict:
    """What, besides the workload and types, decides the measurements (part of the cache key)."""
    return {"batch_per_gpu": p.batch_per_gpu, "iterations": p.iterations, "fit_clusters": list(p.fit_clusters),
            "cluster_duration_s": p.cluster_duration_s, "clusters_side_by_side": p.clusters_side_by_side,
            "cluster_budget_s": p.cluster_budget_s, **emulation}


PROFILING_STAGES = ("types alone", "clusters", "fit and save")


def profile_workload(provider, emulation: dict, p: Preset, *, directory: Path = Path("profiles"),
                     run_id: str | None = None, force: bool = False,
                     on_stage: Callable[[str], None] | None = None) -> tuple[Path, dict]:
    """(profile.json path, summary with wall times); a cached profile is returned as is.
    `on_stage(name)` after each of PROFILING_STAGES (progress)."""
    done = on_stage or (lambda name: None)
    settings = preset_settings(p, emulation)
    types = list(p.types)
    key = cache_key(p.workload, types, p.workload_options, settings)  # the code as it is now, before measuring
    if not force:
        cached = cached_profile(p.workload, types, workload_options=p.workload_options, settings=settings,
                                directory=directory)
        if cached is not None:
            return cached, {"cached": True}
    ps_megabits = emulation["ps_megabits_per_s"]
    run_id = run_id or fresh_run_id("profile")
    started_s = time.monotonic()
    with ThreadPoolExecutor(len(types)) as pool:
        measurements = list(pool.map(
            lambda t: profile_type(provider, f"{run_id}-{t}", p.workload, t, iterations=p.iterations,
                                   workload_options=p.workload_options, batch_per_gpu=p.batch_per_gpu,
                                   ps_megabits_per_s=ps_megabits), types))
    types_wall_s = time.monotonic() - started_s
    done(PROFILING_STAGES[0])
    clusters = profile_clusters(provider, f"{run_id}-clusters", p.workload, measurements, list(p.fit_clusters),
                                duration_s=p.cluster_duration_s, workload_options=p.workload_options,
                                ps_megabits_per_s=ps_megabits, side_by_side=p.clusters_side_by_side,
                                budget_s=p.cluster_budget_s)
    done(PROFILING_STAGES[1])
    wall = {"types_total": types_wall_s, **{f"type:{m.type}": m.wall_s for m in measurements},
            "clusters_total": clusters[0].wall_s if clusters else 0.0, "total": time.monotonic() - started_s}
    fitted = fit_profile(p.workload, measurements, clusters)
    info = provenance(provider.name, types, p.workload_options, settings, wall)
    path = save_profile(fitted, RawMeasurements(measurements, clusters), directory, key=key, provenance_info=info)
    done(PROFILING_STAGES[2])
    summary = {"cached": False, "wall_s": wall,
               "fit": {name: {"r2": q.r2, "rmse": q.rmse, "n_points": q.n_points, "params": q.params}
                       for name, q in fitted.quality.items()}}
    return path, summary
