"""Profiling a workload, orchestrated once for `spotfill profile` and the pipeline: every type
alone, then the fit clusters, then the fit and the store, all under one cache key.

`profile_workload` runs the steps in order (the CLI, `spotfill validate`); the main flow wraps
each step in a Prefect task of its own (flows/train_with_slo.py: a task per type, Prefect's cache
under the same key), so both measure, check and fit the same way.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tasks.profiling import store
from tasks.profiling.clusters import check_target_profiled, profile_clusters
from tasks.profiling.fit import FittedProfile, fit_profile
from tasks.profiling.measurements import ClusterMeasurement, TypeMeasurement
from tasks.profiling.presets import Preset
from tasks.profiling.runs import fresh_run_id
from tasks.profiling.single import profile_type
from tasks.profiling.store import RawMeasurements, cached_profile, provenance, save_profile
from tasks.providers.base import Provider
from tasks.runtime.evaluation import TargetMetric, parse_target_metric

PROFILING_STAGES = ("types alone", "clusters", "fit and save")


@dataclass(frozen=True)
class ProfilingJob:
    """What to profile, and the rules a run adds. `spotfill profile` profiles a preset alone; the
    pipeline adds its request's async rule (its clusters train under the rule the run trains
    under), quotas (written into the profile) and loss target (the clusters train toward it, and
    it is checked against the fitted curve before the planner plans on it)."""

    preset: Preset
    emulation: dict  # the local provider's emulation ({} on AWS): part of what is measured
    provider_name: str
    async_rule: str | None = None  # None: the runtime's default rule
    quotas: dict[str, int] | None = None  # None: fit_profile's default quota
    target_loss: float | None = None  # None: no target to train toward and check
    target_metric: str | None = None  # NAME<=X|NAME>=X: the clusters are profiled on that metric's curve,
    # and target_loss is its target on the curve's scale (evaluation.py)
    provenance_settings: dict | None = None  # what the profile records as its settings; None: settings()

    def settings(self) -> dict:
        """The preset's settings that decide the measurements, and the emulation (what the
        profiles of `spotfill profile` record as their settings)."""
        p = self.preset
        return {"batch_per_gpu": p.batch_per_gpu, "iterations": p.iterations, "fit_clusters": list(p.fit_clusters),
                "cluster_duration_s": p.cluster_duration_s, "clusters_side_by_side": p.clusters_side_by_side,
                "cluster_budget_s": p.cluster_budget_s, **self.emulation}

    @property
    def metric(self) -> TargetMetric | None:
        return None if self.target_metric is None else parse_target_metric(self.target_metric)

    def key_settings(self) -> dict:
        """What the cache key covers besides the workload, its options and the types: settings(),
        the provider, the async rule the clusters train under and the target (loss or metric) they train
        toward (when there is one)."""
        target = {} if self.target_loss is None else {"target_loss": self.target_loss}
        if self.target_metric is not None:
            target["target_metric"] = self.target_metric
        return {**self.settings(), "provider": self.provider_name, "async_rule": self.async_rule, **target}


def cache_key(job: ProfilingJob, types: list[str]) -> str:
    """One key for a step's measurements of `types` and for the profile of them all (with the
    code version: store.cache_key)."""
    p = job.preset
    return store.cache_key(p.workload, types, p.workload_options, job.key_settings())


# ----------------------------------------------------------------------------- the steps
def measure_type(job: ProfilingJob, provider: Provider, run_id: str, instance_type: str) -> TypeMeasurement:
    """Step 1, for each type: one worker alone with the PS; what it started is cleaned up
    whatever happens."""
    p = job.preset
    type_run_id = f"{run_id}-{instance_type}"
    try:
        return profile_type(provider, type_run_id, p.workload, instance_type, iterations=p.iterations,
                            workload_options=p.workload_options, batch_per_gpu=p.batch_per_gpu,
                            ps_megabits_per_s=job.emulation.get("ps_megabits_per_s"))
    finally:
        provider.cleanup(type_run_id)


def measure_clusters(job: ProfilingJob, provider: Provider, run_id: str,
                     measurements: list[TypeMeasurement]) -> list[ClusterMeasurement]:
    """Step 2: the preset's fit clusters, under the job's async rule; cleaned up whatever happens."""
    p = job.preset
    clusters_run_id = f"{run_id}-clusters"
    try:
        return profile_clusters(provider, clusters_run_id, p.workload, measurements, list(p.fit_clusters),
                                duration_s=p.cluster_duration_s, workload_options=p.workload_options,
                                ps_megabits_per_s=job.emulation.get("ps_megabits_per_s"),
                                side_by_side=p.clusters_side_by_side, budget_s=p.cluster_budget_s,
                                async_rule=job.async_rule, target_loss=job.target_loss, target_metric=job.metric)
    finally:
        provider.cleanup(clusters_run_id)


def measured_wall_s(measurements: list[TypeMeasurement], clusters: list[ClusterMeasurement]) -> dict[str, float]:
    """Each type's wall time alone, and the clusters stage's (every cluster carries it)."""
    return {**{f"type:{m.type}": m.wall_s for m in measurements},
            "clusters_total": clusters[0].wall_s if clusters else 0.0}


def fit_and_save(job: ProfilingJob, measurements: list[TypeMeasurement], clusters: list[ClusterMeasurement],
                 directory: Path, wall_s: dict[str, float], key: str | None = None) -> tuple[Path, FittedProfile]:
    """Step 3: the fit, the target checked against it and the profile directory (`key`: the
    cache key taken before measuring, so a code change during profiling cannot mislabel the profile)."""
    p = job.preset
    types = list(p.types)
    fitted = fit_profile(p.workload, measurements, clusters, quotas=job.quotas)
    if job.target_loss is not None:
        check_target_profiled(clusters, job.target_loss, fitted.profile.loss, p.cluster_budget_s, job.metric)
    settings = job.settings() if job.provenance_settings is None else job.provenance_settings
    info = provenance(job.provider_name, types, p.workload_options, settings, wall_s)
    path = save_profile(fitted, RawMeasurements(measurements, clusters), directory,
                        key=key or cache_key(job, types), provenance_info=info)
    return path, fitted


# ----------------------------------------------------------------------------- the steps in order
def profile_workload(provider: Provider, job: ProfilingJob, *, directory: Path = Path("profiles"),
                     run_id: str | None = None, force: bool = False,
                     on_stage: Callable[[str], None] | None = None) -> tuple[Path, dict]:
    """(profile.json path, summary with wall times); a cached profile is returned as is.
    `on_stage(name)` after each of PROFILING_STAGES (progress)."""
    done = on_stage or (lambda name: None)
    p = job.preset
    types = list(p.types)
    key = cache_key(job, types)  # the code as it is now, before measuring
    if not force:
        cached = cached_profile(p.workload, types, workload_options=p.workload_options, settings=job.key_settings(),
                                directory=directory)
        if cached is not None:
            return cached, {"cached": True}
    run_id = run_id or fresh_run_id("profile")
    started_s = time.monotonic()
    with ThreadPoolExecutor(len(types)) as pool:
        measurements = list(pool.map(lambda t: measure_type(job, provider, run_id, t), types))
    types_wall_s = time.monotonic() - started_s
    done(PROFILING_STAGES[0])
    clusters = measure_clusters(job, provider, run_id, measurements)
    done(PROFILING_STAGES[1])
    wall = {"types_total": types_wall_s, **measured_wall_s(measurements, clusters), "total": time.monotonic() - started_s}
    path, fitted = fit_and_save(job, measurements, clusters, directory, wall, key=key)
    done(PROFILING_STAGES[2])
    summary = {"cached": False, "wall_s": wall,
               "fit": {name: {"r2": q.r2, "rmse": q.rmse, "n_points": q.n_points, "params": q.params}
                       for name, q in fitted.quality.items()}}
    return path, summary
