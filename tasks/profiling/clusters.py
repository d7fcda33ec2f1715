"""Cluster profiling: a few small clusters trained side by side (in waves) for a short time.

Each cluster is its own run (its own PS and workers). From the telemetry: every worker's steady
compute and push+pull times (for the contention fit) and the cluster's smoothed loss against its
update count (for the loss-curve fit). The smoothing is the PS's own (an exponential moving
average with the PS's factor), so the fitted curve describes the number the PS stops on.

How long the clusters train adapts to the model: each trains at least `duration_s`, then on until
every cluster profiled so far has crossed a common loss band (`band_reached`, the band the
loss-curve fit reads), within a time budget for the whole stage (`budget_s`, shared evenly by the
waves). A wave judged alone cannot know how far later waves will go: when a later cluster's fall
leaves an earlier (stopped) one above every band they could share, that cluster is trained again
from the start, alone, until they share one (`laggard`). A model that has not crossed a common band
when the budget ends is a ProfilingError saying to raise the budget.

A loss target moves that end: the clusters train on until each has come within TARGET_APPROACH
times the target (`target_approached`), so the curve is fitted on losses near the target rather than
extrapolated from a band far above it, and on while a cluster's own curve still levels off at or
above the target (`floor_blocks`: the fit would refuse a target the model may yet reach); a budget
that ends first only stops them. After the fit,
`check_target_profiled` refuses a target the fitted curve still cannot reach, in one line with the
lowest target that can be planned and the budget that would train the clusters to it, and one a
profiled cluster had already met where its curve begins (`check_target_after_start`).
"""
from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from tasks.core.profile import LossCurve
from tasks.profiling.fit import cluster_shape, curve_floor, iterations_to_loss, loss_band
from tasks.profiling.measurements import ClusterMeasurement, ProfilingError, TypeMeasurement, WorkerObservation, megabits_to_mbps
from tasks.profiling.runs import (
    WARMUP_UPDATES, check_not_diverged, start_workers, update_records, wait_until, worker_batch,
)
from tasks.providers.base import Provider
from tasks.runtime.evaluation import TargetMetric, metric_curve, metric_evaluation


def loss_smoothing() -> float:
    from tasks.runtime.ps import PsConfig  # deferred: torch (start-up cost)

    return PsConfig.__dataclass_fields__["loss_smoothing"].default


MEASURED_UPDATES = 3  # steady updates each worker needs for its medians
BAND_MIN_SHARE = 0.1  # the common band must span this share of the loss's fall (levels to fit on)
EXTRAPOLATION_SHARE = 0.25  # a loss target may lie this share of the profiled fall below the lowest loss seen
TARGET_APPROACH = 1.5  # with a loss target, every cluster trains on until its loss is within this factor of it
FLOOR_MARGIN = 1e-3  # the lowest target planned lies this share above the fitted curve's floor (gamma5)


def band_reached(curves: list[list[tuple[int, float]]]) -> bool:
    """Whether the clusters' smoothed losses share a loss band wide enough to fit the curve on."""
    if not curves or any(len(c) < 2 for c in curves):
        return False
    try:
        top, bottom = loss_band(curves)
    except ProfilingError:
        return False
    first = statistics.median(c[0][1] for c in curves)
    lowest = min(loss for c in curves for _, loss in c)
    return top - bottom >= BAND_MIN_SHARE * (first - lowest)


def laggard(curves: list[list[tuple[int, float]]]) -> int:
    """Index of the curve whose lowest loss is highest: the one a common band waits for (the band
    ends above it, and only falls as the others train on)."""
    return max(range(len(curves)), key=lambda i: min(loss for _, loss in curves[i]))


def target_approached(curves: list[list[tuple[int, float]]], target_loss: float | None) -> bool:
    """Whether every cluster's smoothed loss has come within TARGET_APPROACH times the target (no
    target: always): the band the curve is fitted on then reaches down near the target."""
    return target_loss is None or all(c and min(loss for _, loss in c) <= TARGET_APPROACH * target_loss for c in curves)


def trained_enough(curves: list[list[tuple[int, float]]], target_loss: float | None) -> bool:
    """A common band to fit on and, with a target, every cluster near it."""
    return band_reached(curves) and target_approached(curves, target_loss)


def floor_blocks(curves: list[list[tuple[int, float]]], target_loss: float | None) -> bool:
    """Whether a cluster's curve, fitted alone, still levels off at or above the target (no target:
    never): the fit on these curves would refuse a target the model may yet reach, so its cluster
    trains on toward it while the budget lasts (`wave_done`)."""
    if target_loss is None:
        return False
    floors = [curve_floor(c) for c in curves]
    return any(f is not None and f >= target_loss for f in floors)


def wave_done(curves: list[list[tuple[int, float]]], earlier: int, target_loss: float | None) -> bool:
    """Whether a wave (the curves after the first `earlier`, which are stopped) may stop before its
    deadline: all trained enough and none of its clusters' curves levelling off above the target;
    or an earlier curve is the laggard (training these on only lowers the band further below it)."""
    return ((trained_enough(curves, target_loss) and not floor_blocks(curves[earlier:], target_loss))
            or laggard(curves) < earlier)


def no_band_error(curves: list[list[tuple[int, float]]], budget_s: float) -> ProfilingError:
    lows = ", ".join(f"{min(l for _, l in c):.4g}" for c in curves if c)
    return ProfilingError(f"the profiled clusters did not cross a common loss band within the profiling budget of "
                          f"{budget_s:g} s (lowest smoothed loss of each: {lows}); raise --profile-budget-s, or lower "
                          "the learning rate if a loss does not fall")


def lowest_reachable_target(clusters: list[ClusterMeasurement]) -> float:
    """The lowest loss target the profiled clusters support: their lowest smoothed loss, less
    EXTRAPOLATION_SHARE of the fall they showed (the fitted curve is trusted a little beyond)."""
    first = statistics.median(c.losses[0][1] for c in clusters)
    lowest = min(loss for c in clusters for _, loss in c.losses)
    return lowest - EXTRAPOLATION_SHARE * max(0.0, first - lowest)


def budget_to_reach(clusters: list[ClusterMeasurement], curve: LossCurve, target_loss: float, budget_s: float) -> float:
    """The profiling budget that would train every cluster down to `target_loss` on the fitted
    `curve` (above its gamma5): `budget_s` scaled by the slowest cluster's updates needed over
    those it made (time per update stays the same as a cluster trains on)."""
    g = [curve.gamma1, curve.gamma2, curve.gamma3, curve.gamma4, curve.gamma5, curve.kappa, curve.batch_n_exponent,
         curve.batch_staleness, curve.batch_noise]
    scale = 1.0
    for c in clusters:
        bw, cc = cluster_shape([w.batch for w in c.workers], [w.iteration_time_s for w in c.workers])
        needed = float(iterations_to_loss(target_loss, bw, cc, c.n, g))
        scale = max(scale, needed / max(1, c.losses[-1][0]))
    return math.ceil(budget_s * scale / 10) * 10


def check_target_profiled(clusters: list[ClusterMeasurement], target_loss: float, curve: LossCurve, budget_s: float,
                          target_metric: TargetMetric | None = None) -> None:
    """A loss target the fitted `curve` cannot reach (at or below its gamma5), or one far below what
    the clusters reached within the profiling budget `budget_s`, is refused before planning, in
    one line: the lowest target that can be planned, and what would change that. With
    `target_metric` the curve is that metric's (`target_loss` its target on the curve's scale) and
    the line speaks of the metric."""
    check_target_after_start(clusters, target_loss, target_metric)
    lowest = min(loss for c in clusters for _, loss in c.losses)
    floor = max(lowest_reachable_target(clusters), curve.gamma5 + FLOOR_MARGIN * abs(curve.gamma5))
    if target_loss >= floor:
        return
    what, aim = _target_words(target_loss, target_metric, floor)
    if target_metric is None:
        seen, curve_name, beyond, side = f"lowest smoothed loss {lowest:.4g}", "loss curve", "below", "above"
    else:
        m = target_metric
        seen, curve_name, beyond = f"best {m.name} {m.on_curve(lowest):.4g}", f"{m.name} curve", "beyond"
        side = "above" if m.direction == "<=" else "below"
    if target_loss <= curve.gamma5:
        raise ProfilingError(f"{what} is unreachable: profiling trained toward it ({seen}) and the fitted {curve_name} "
                             f"levels off at gamma5 = {curve.gamma5:.4g}; aim at {aim} or {side}")
    needed_s = budget_to_reach(clusters, curve, target_loss, budget_s)
    planned = f"{floor:.4g}" if target_metric is None else aim
    raise ProfilingError(f"{what} is {beyond} what profiling saw within its budget of {budget_s:g} s "
                         f"({seen}; targets down to {planned} are planned): raise "
                         f"--profile-budget-s to about {needed_s:g} so the clusters train down to it, or aim at "
                         f"{aim} or {side}")


def _target_words(target_loss: float, target_metric: TargetMetric | None, level: float) -> tuple[str, str]:
    """How a refusal names the target, and a target at curve level `level` to aim at: in the
    loss's words ("loss target 1.2", "--loss 1.3") or the metric's ("target metric val_acc>=0.9",
    "val_acc>=0.87")."""
    if target_metric is None:
        return f"loss target {target_loss:g}", f"--loss {level:.4g}"
    m = target_metric
    return f"target metric {m}", f"{m.name}{m.direction}{m.on_curve(level):.4g}"


def check_target_after_start(clusters: list[ClusterMeasurement], target_loss: float,
                             target_metric: TargetMetric | None = None) -> None:
    """A target some profiled cluster had already met at the first point of its curve (a metric
    target met by the first evaluation, a loss target at or above the first smoothed loss) lies in
    that cluster's warm-up: the curve starts after it and cannot tell how many updates it takes,
    and the planner would read "no update needed" on clusters like it. Refused in one line,
    naming the cluster and the top of the band the curve is fitted on, the easiest target it
    predicts from what it saw."""
    early = [c for c in clusters if c.losses and c.losses[0][1] <= target_loss]
    if not early:
        return
    first = min(early, key=lambda c: c.losses[0][1])
    update, value = first.losses[0]
    top, _ = loss_band([c.losses for c in clusters])
    where = ", ".join(f"{t}={n}" for t, n in first.cluster.items() if n)
    what, aim = _target_words(target_loss, target_metric, top)
    m = target_metric
    seen = (f"smoothed loss {value:.4g} at update {update}" if m is None
            else f"{m.name} {m.on_curve(value):.4g} at its first evaluation, update {update}")
    side = "above" if m is not None and m.direction == ">=" else "below"
    raise ProfilingError(f"{what} was already met where the profiled curve of {where} begins ({seen}): the fitted "
                         f"curve starts after it and cannot tell how many updates it takes; aim at {aim} or {side}")


def smoothed_losses(updates: list[dict], factor: float) -> list[tuple[int, float]]:
    """(update count j, EMA of the losses so far), as the PS computes it."""
    out, ema = [], None
    for u in updates:
        ema = u["loss"] if ema is None else (1 - factor) * ema + factor * u["loss"]
        out.append((u["version"], ema))
    return out


def run_curve(run, factor: float, target_metric: TargetMetric | None) -> list[tuple[int, float]]:
    """The curve a cluster is profiled on: its smoothed training loss, or with a target metric that
    metric's evaluations on the loss curve's scale (evaluation.py)."""
    updates = update_records(run)  # polls the telemetry
    return smoothed_losses(updates, factor) if target_metric is None else metric_curve(run.reader.records, target_metric)


def worker_observations(updates: list[dict], batches: dict[int, int], where: str) -> list[WorkerObservation]:
    """Each worker's median compute and push+pull time over its steady iterations."""
    by_worker: dict[int, list[dict]] = {}
    for u in updates:
        by_worker.setdefault(u["worker"], []).append(u)
    observations = []
    for worker, rows in sorted(by_worker.items()):
        steady = [r for r in rows[WARMUP_UPDATES:] if r["comm_s"] is not None]
        if len(steady) < MEASURED_UPDATES:
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
                     budget_s: float = 300.0, async_rule: str | None = None,
                     target_loss: float | None = None,
                     target_metric: TargetMetric | None = None) -> list[ClusterMeasurement]:
    """Train every cluster for at least `duration_s` seconds of updates each, and on until they
    all cross a common loss band and, with `target_loss`, come near it (`trained_enough`; a wave
    whose share of the budget ends with a band but short of the target stops there), `side_by_side` at a time (default: all at once), in the order
    given; wave k of m must be done `budget_s` * k / m seconds after the stage started.

    `ps_megabits_per_s` caps the PS's emulated NIC (local provider); `ps_bandwidth_mbps` is the PS
    bandwidth recorded for the fit (MB/s), by default that cap / 8, or without a cap the PS
    instance type's NIC (`network_mbytes_per_s`, already MB/s). On a small machine the processes of many clusters at once compete for
    the cores and stretch the communication times the contention fit reads; waves keep that down.
    """
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
    waves = range(0, len(clusters), wave)
    factor = loss_smoothing()
    runs = []
    for k, first in enumerate(waves, 1):
        runs += _train_side_by_side(provider, run_id, workload, by_type, list(enumerate(clusters))[first:first + wave],
                                    duration_s=duration_s, workload_options=workload_options,
                                    ps_megabits_per_s=ps_megabits_per_s, ps_type=ps_type,
                                    deadline_s=started_s + budget_s * k / len(waves), budget_s=budget_s,
                                    earlier=[run_curve(r, factor, target_metric) for r in runs],
                                    async_rule=async_rule, target_loss=target_loss, target_metric=target_metric)
    stage_end_s = started_s + budget_s
    again = 0
    while not band_reached(curves := [run_curve(r, factor, target_metric) for r in runs]):
        if time.monotonic() > stage_end_s:
            raise no_band_error(curves, budget_s)
        k, again = laggard(curves), again + 1
        runs[k] = _train_side_by_side(provider, f"{run_id}-again{again}", workload, by_type, [(k, clusters[k])],
                                      duration_s=duration_s, workload_options=workload_options,
                                      ps_megabits_per_s=ps_megabits_per_s, ps_type=ps_type, deadline_s=stage_end_s,
                                      budget_s=budget_s, earlier=curves[:k] + curves[k + 1:],
                                      async_rule=async_rule, target_loss=target_loss,
                                      target_metric=target_metric)[0]
    wall_s = time.monotonic() - started_s
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
            losses=run_curve(run, factor, target_metric), wall_s=wall_s,
        ))
    return results


def _train_side_by_side(provider: Provider, run_id: str, workload: str, by_type: dict[str, TypeMeasurement],
                        numbered: list[tuple[int, dict[str, int]]], *, duration_s: float, workload_options: dict | None,
                        ps_megabits_per_s: float | None, ps_type: str | None, deadline_s: float,
                        budget_s: float, earlier: list[list[tuple[int, float]]], async_rule: str | None,
                        target_loss: float | None = None, target_metric: TargetMetric | None = None) -> list:
    """Start the clusters at once, wait until each trained `duration_s` and all of them with the
    `earlier` waves' curves are trained enough (a common loss band; near `target_loss`) by
    `deadline_s`, or until an earlier curve is the laggard (training these on only lowers the band
    further below it), stop them all (always). At `deadline_s` a band is enough."""
    from tasks.runtime.driver import start_run, stop_run  # deferred: torch (start-up cost)

    runs = []

    def start(k_cluster):
        k, cluster = k_cluster
        run = start_run(provider, f"{run_id}-c{k}", workload, workload_options=workload_options,
                        ps_type=ps_type or next(iter(cluster)), ps_mbps=ps_megabits_per_s, checkpoint_every_s=3600.0,
                        async_rule=async_rule, **metric_evaluation(target_metric))
        runs.append(run)
        for instance_type, count in cluster.items():
            if count:
                batch = worker_batch(provider, instance_type, by_type[instance_type].batch_per_gpu)[1]
                start_workers(run, instance_type, count, batch)
        return run

    def long_enough(cluster: dict[str, int]):
        """`duration_s` of updates, and every worker past its warm-up with steps to measure."""
        def done(p) -> bool:
            return (p.first_update_t is not None and p.last_update_t - p.first_update_t >= duration_s
                    and len(p.workers) >= sum(cluster.values())
                    and all(w.updates >= WARMUP_UPDATES + MEASURED_UPDATES for w in p.workers.values()))
        return done

    factor = loss_smoothing()
    try:
        with ThreadPoolExecutor(len(numbered)) as pool:  # the PSs start side by side
            ordered = list(pool.map(start, numbered))
        for (_, cluster), run in zip(numbered, ordered):
            wait_until(run, long_enough(cluster), deadline_s, what=f"within the profiling budget of {budget_s:g} s "
                       f"(raise --profile-budget-s)")
        while True:
            curves = earlier + [run_curve(run, factor, target_metric) for run in ordered]
            if wave_done(curves, len(earlier), target_loss):
                break
            if time.monotonic() > deadline_s:
                if band_reached(curves):
                    break  # short of the target: check_target_profiled says what budget would reach it
                raise no_band_error(curves, budget_s)
            for run in ordered:
                check_not_diverged(update_records(run), f"profiling cluster run {run.run_id}")
            time.sleep(1.0)
    finally:
        for run in runs:
            stop_run(run)
    return ordered
