"""Validation: train held-out clusters to a loss target and compare with the model's prediction.

For every configuration: the observed training time (first update to the update on which the
PS's smoothed loss reached the target) and iterations (PS updates until then), against the
model's prediction (tasks.core.model.Model) and against a contention-blind baseline, the same model
with an unlimited PS (every worker at its ideal speed, cluster speed = the sum of the ideal
speeds, as CM-DARE predicts it).

Workers start a few seconds apart (process start-up) and each waits once for its phase slot
(tasks/runtime/stagger.py), so both predictions are replayed on the observed start schedule:
worker i makes its update at ALIGN_STEP (the first after that wait) when it did in the run,
ALIGN_STEP before it, and one every T_i after it, and the predicted time is when those updates add
up to the predicted iterations. Start-up itself is the
provider's overhead, reported separately (start_skew_s), not the model's to predict.

The error is split in two: `speed_time_error` replays the OBSERVED iterations on the predicted
iteration times (the speed and contention model alone); `time_error` uses the predicted iterations
(speed and loss-curve model together). Beside the profile's model (the form its fit chose), the
same runs score the paper's form fitted on the same clusters (`paper_*`), so what the extensions
buy is visible, and every run is checked against the profile's interval at `level` (`coverage`:
the share of runs whose observed time lies inside it).

The model predicts the expected time; one run lands a few percent off it (async update order, data
sampling: about 2-6% in iterations at the presets' target). With `repeats` > 1 each configuration
trains that many times, in rounds (every configuration once, then every one again: a slow spell of
the shared machine then spreads over configurations instead of landing on both runs of one); the
observed and predicted values are the means over its runs, and every run's own numbers are kept
(`runs`), so the spread is visible.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from pydantic import BaseModel

from tasks.core.atomic import atomic_write_bytes
from tasks.core.errors import UserInputError
from tasks.core.intervals import DEFAULT_LEVEL, time_interval_s
from tasks.core.model import Model
from tasks.core.profile import Contention, LossCurve, Profile
from tasks.profiling.measurements import ProfilingError, cluster_label
from tasks.profiling.runs import WARMUP_UPDATES, check_not_diverged, fresh_run_id, update_records, wait_until, worker_batch
from tasks.providers.base import Provider
from tasks.runtime.stagger import ALIGN_STEP

UNLIMITED_MBPS = 1e12


class RunObservation(BaseModel):
    """One training run of a configuration to the target, and the predictions on its start schedule."""

    observed_time_s: float
    observed_iterations: int
    predicted_time_s: float
    paper_time_s: float  # the paper's form, fitted on the same clusters
    baseline_time_s: float
    speed_time_s: float  # the observed iterations on the predicted iteration times
    baseline_speed_time_s: float
    observed_iteration_time_s: float
    start_skew_s: float
    wall_s: float
    compute_stretch: float  # median over workers of steady compute / the profile's (see run_once)
    interval_s: tuple[float, float] | None = None  # the profile's interval around predicted_time_s
    inside: bool | None = None  # observed_time_s within interval_s


class ConfigResult(BaseModel):
    cluster: dict[str, int]
    gpus_per_worker: dict[str, int]  # each type's GPUs: a worker of a multi-GPU type trains a replica per GPU
    predicted_time_s: float
    observed_time_s: float
    time_error: float
    predicted_iterations: float
    observed_iterations: float  # mean over the runs
    iterations_error: float
    predicted_iteration_time_s: float  # Texp of the model
    observed_iteration_time_s: float  # steady: seconds per update once every worker was in and aligned
    predicted_steady_time_s: float  # iterations * Texp, without the start schedule
    paper_time_s: float
    paper_time_error: float
    baseline_time_s: float
    baseline_time_error: float
    # the speed model alone: the observed iterations on the predicted iteration times
    speed_time_error: float
    baseline_speed_time_error: float
    start_skew_s: float  # last worker's first update - first update (the largest over the runs)
    compute_stretch: float  # mean over the runs
    wall_s: float
    runs: list[RunObservation]


class ValidationReport(BaseModel):
    workload: str
    loss_target: float
    configs: list[ConfigResult]
    median_time_error: float
    max_time_error: float
    median_iterations_error: float
    paper_median_time_error: float
    paper_max_time_error: float
    baseline_median_time_error: float
    baseline_max_time_error: float
    median_speed_time_error: float
    baseline_median_speed_time_error: float
    median_compute_stretch: float
    # the median time error of the clusters whose workers have one GPU each, and of those with a
    # multi-GPU worker (None: no such cluster)
    one_gpu_median_time_error: float | None
    multi_gpu_median_time_error: float | None
    form: dict | None  # the profile's model form and every candidate's cross-validation error
    interval_level: float
    coverage: float | None  # share of runs inside their interval (None: the profile has no spread)
    wall_s: float
    plot: str | None = None


def _recorded_form(profile: Profile):
    quality = (profile.model_extra or {}).get("fit_quality") or {}
    return quality.get("form") if isinstance(quality, dict) else None


def contention_blind(profile: Profile) -> Model:
    return Model.from_profile(profile.model_copy(update={"ps_bandwidth_mbps": UNLIMITED_MBPS}))


def paper_form(profile: Profile) -> Profile:
    """The profile with the paper's form as its fit recorded it (fit.form's "paper" candidate);
    the profile itself when its fit recorded no choice of form."""
    try:
        candidates = ((profile.model_extra or {}).get("fit") or {}).get("form", {}).get("candidates", [])
        paper = next((c for c in candidates if c["name"] == "paper"), None)
        if paper is None:
            return profile
        return profile.model_copy(update={"contention": Contention(**paper["contention"]),
                                          "loss": LossCurve(**paper["loss"])})
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise UserInputError(f"the profile's fit.form is not the shape spotfill writes ({type(err).__name__}: "
                             f"{str(err)[:80]})") from None


def time_on_schedule(iterations: float, start_offsets_s: list[float], iteration_times_s: list[float],
                     origin_s: float | None = None) -> float:
    """Seconds from the first update until the cluster has made `iterations` updates, worker i
    making its first update at its offset and one every T_i after it: the observed time is
    measured the same way (first update to the j-th). Updates are counted as discrete events; a
    continuous rate from each offset undercounts by about half an update per worker and
    over-predicted every measured run by 1-3%. A fractional count is interpolated between the
    updates on either side. `origin_s`: where the time counts from when the offsets are a
    replay's (`replay_starts_s`), whose earliest need not be the run's first update."""
    starts = np.asarray(start_offsets_s, dtype=float)
    periods = np.asarray(iteration_times_s, dtype=float)
    first = float(starts.min()) if origin_s is None else origin_s
    j = max(1.0, float(iterations))
    below, above = int(np.floor(j)), int(np.ceil(j))
    t_below = _kth_update_s(below, starts, periods)
    t_above = t_below if above == below else _kth_update_s(above, starts, periods)
    return t_below + (j - below) * (t_above - t_below) - first


def replay_starts_s(first_s: list[float], aligned_s: list[float | None], iteration_times_s: list[float]) -> list[float]:
    """Where each worker's replayed schedule starts, for `time_on_schedule`: its update at
    ALIGN_STEP, the first after its one wait for its phase slot (tasks/runtime/stagger.py), on
    its observed time, with its ALIGN_STEP earlier updates evenly before it (as many as it made);
    a worker that did not get that far (None), from its first update. The wait is start-up, like
    the start skew: the model predicts the steady rate after it."""
    return [first if aligned is None else aligned - ALIGN_STEP * t
            for first, aligned, t in zip(first_s, aligned_s, iteration_times_s)]


def _kth_update_s(k: int, starts: np.ndarray, periods: np.ndarray) -> float:
    """When the k-th update (1-based) of all workers together happens: bisection on the count."""
    def count(t: float) -> int:
        ran = t >= starts
        return int(np.sum(np.floor((t - starts[ran]) / periods[ran]) + 1))

    low, high = float(starts.min()), float(starts.max() + k * periods.max())
    for _ in range(200):
        if count(low) >= k or high - low <= 1e-12 * max(1.0, high):
            break
        mid = 0.5 * (low + high)
        if count(mid) >= k:
            high = mid
        else:
            low = mid
    return low if count(low) >= k else high


def _relative(predicted: float, observed: float) -> float:
    return abs(predicted - observed) / observed


def run_once(provider: Provider, run_id: str, profile: Profile, workload: str, prediction: ConfigPrediction,
             loss_target: float, *, workload_options: dict | None = None, ps_megabits_per_s: float | None = None,
             timeout_s: float = 600.0) -> RunObservation:
    """Train the predicted cluster once until the PS's smoothed loss reaches `loss_target`, and
    replay both predictions on the run's start schedule."""
    from tasks.runtime.driver import add_workers, start_run, stop_run  # deferred: torch (start-up cost)

    cluster = prediction.cluster
    models, iterations = prediction.models, prediction.iterations
    model = models["model"]
    started_s = time.monotonic()
    run = start_run(provider, run_id, workload, workload_options=workload_options, ps_type=next(iter(cluster)),
                    ps_mbps=ps_megabits_per_s, target_loss=loss_target, checkpoint_every_s=3600.0,
                    eval_every_updates=None)
    try:
        for instance_type, n in cluster.items():
            add_workers(run, instance_type, n,
                        batch_size=worker_batch(provider, instance_type, profile.instance(instance_type).batch_per_gpu)[1])
        wait_until(run, lambda p: False, time.monotonic() + timeout_s)
        updates = update_records(run)
    finally:
        progress = stop_run(run)
    where = f"validating cluster {cluster}"
    check_not_diverged(updates, where)
    if progress.stopped != "target_loss":
        raise ProfilingError(f"{where}: the run stopped ({progress.stopped}) before reaching loss {loss_target}")
    first_t = updates[0]["t"]
    first_by_worker: dict[int, float] = {}
    type_by_worker: dict[int, str] = {}
    for u in updates:
        first_by_worker.setdefault(u["worker"], u["t"] - first_t)
        type_by_worker[u["worker"]] = u["instance_type"]
    workers = sorted(first_by_worker)
    if len(workers) != sum(cluster.values()):
        raise ProfilingError(f"{where}: only {len(workers)} of {sum(cluster.values())} workers trained "
                             "before the target was reached; use a lower loss target")
    offsets = [first_by_worker[w] for w in workers]
    aligned_by_worker = {u["worker"]: u["t"] - first_t for u in updates if u["step"] == ALIGN_STEP}
    aligned = [aligned_by_worker.get(w) for w in workers]
    names = list(model.types.names)

    def scheduled(name: str, iterations: float) -> float:
        m = models[name]
        t_i = m.cluster_iteration_times_s(m.counts_vector(cluster))[0]
        periods = [float(t_i[names.index(type_by_worker[w])]) for w in workers]
        starts = replay_starts_s(offsets, aligned, periods)
        return time_on_schedule(iterations, starts, periods, origin_s=0.0)  # from the first update, as observed

    skew_s = max(offsets)
    # steady: every worker in and past its one wait for its phase
    steady_from_s = max([skew_s] + [a for a in aligned if a is not None])
    steady = [u for u in updates if u["t"] - first_t >= steady_from_s]
    # The emulated compute is padded to the profile's; a busy host (or too many workers for its
    # cores) stretches it beyond, which slows the run without any error of the model's.
    by_worker: dict[int, list[float]] = {}
    for u in updates:
        by_worker.setdefault(u["worker"], []).append(u["compute_s"])
    stretch = statistics.median(
        statistics.median(c[WARMUP_UPDATES:] or c) / float(model.types.compute_s[names.index(type_by_worker[w])])
        for w, c in by_worker.items())
    observed_s, predicted_s = updates[-1]["t"] - first_t, scheduled("model", iterations["model"])
    interval_s = None if profile.uncertainty is None else time_interval_s(profile, prediction.level, predicted_s)
    return RunObservation(
        observed_time_s=observed_s, observed_iterations=len(updates), predicted_time_s=predicted_s,
        paper_time_s=scheduled("paper", iterations["paper"]), baseline_time_s=scheduled("blind", iterations["blind"]),
        speed_time_s=scheduled("model", len(updates)), baseline_speed_time_s=scheduled("blind", len(updates)),
        observed_iteration_time_s=(steady[-1]["t"] - steady[0]["t"]) / max(1, len(steady) - 1),
        start_skew_s=skew_s, wall_s=time.monotonic() - started_s, compute_stretch=stretch, interval_s=interval_s,
        inside=None if interval_s is None else interval_s[0] <= observed_s <= interval_s[1],
    )


@dataclass(frozen=True)
class ConfigPrediction:
    """What the model and the contention-blind baseline say of one configuration, before it runs."""

    cluster: dict[str, int]
    gpus_per_worker: dict[str, int]  # each type's GPUs (the profile's)
    models: dict[str, Model]  # "model" (the profile's), "paper" (the paper's form), "blind" (contention-blind)
    iterations: dict[str, float]  # predicted updates to the target, by each
    iteration_time_s: float  # Texp of the model
    steady_time_s: float  # iterations * Texp, without the start schedule
    level: float = DEFAULT_LEVEL  # of the interval each run is checked against


def predict_config(profile: Profile, cluster: dict[str, int], loss_target: float,
                   level: float = DEFAULT_LEVEL) -> ConfigPrediction:
    profile.loss.require_reachable(loss_target)
    paper = paper_form(profile)
    models = {"model": Model.from_profile(profile), "paper": Model.from_profile(paper), "blind": contention_blind(profile)}
    counts = models["model"].counts_vector(cluster)
    results = {name: m.evaluate(counts, loss_target) for name, m in models.items()}
    for name, p in (("model", profile), ("paper", paper)):
        if not np.isfinite(results[name]["iterations"][0]):
            raise ProfilingError(f"cluster {cluster}: the fitted loss curve never reaches {loss_target} "
                                 f"(gamma5 = {p.loss.gamma5:.4g})")
    return ConfigPrediction(cluster=cluster, gpus_per_worker={t: profile.instance(t).gpus for t in cluster}, models=models,
                            iterations={name: float(r["iterations"][0]) for name, r in results.items()},
                            iteration_time_s=float(results["model"]["iteration_time_s"][0]),
                            steady_time_s=float(results["model"]["time_s"][0]), level=level)


def score_config(prediction: ConfigPrediction, runs: list[RunObservation]) -> ConfigResult:
    """A configuration's observed means over its runs against the predictions."""
    def mean(field: str) -> float:
        return statistics.fmean(getattr(r, field) for r in runs)

    observed_time_s = mean("observed_time_s")
    return ConfigResult(
        cluster=prediction.cluster, gpus_per_worker=prediction.gpus_per_worker,
        predicted_time_s=mean("predicted_time_s"), observed_time_s=observed_time_s,
        time_error=_relative(mean("predicted_time_s"), observed_time_s),
        predicted_iterations=prediction.iterations["model"], observed_iterations=mean("observed_iterations"),
        iterations_error=_relative(prediction.iterations["model"], mean("observed_iterations")),
        predicted_iteration_time_s=prediction.iteration_time_s,
        observed_iteration_time_s=mean("observed_iteration_time_s"), predicted_steady_time_s=prediction.steady_time_s,
        paper_time_s=mean("paper_time_s"), paper_time_error=_relative(mean("paper_time_s"), observed_time_s),
        baseline_time_s=mean("baseline_time_s"), baseline_time_error=_relative(mean("baseline_time_s"), observed_time_s),
        speed_time_error=_relative(mean("speed_time_s"), observed_time_s),
        baseline_speed_time_error=_relative(mean("baseline_speed_time_s"), observed_time_s),
        start_skew_s=max(r.start_skew_s for r in runs), compute_stretch=mean("compute_stretch"),
        wall_s=sum(r.wall_s for r in runs), runs=runs,
    )


def validate_profile(provider: Provider, profile: Profile, workload: str, configs: list[dict[str, int]],
                     loss_target: float, *, run_id: str | None = None, workload_options: dict | None = None,
                     ps_megabits_per_s: float | None = None, parallel: int = 1, repeats: int = 1,
                     timeout_s: float = 600.0, fitted_clusters: list[dict[str, int]] | None = None, plot_path: Path | None = None,
                     level: float = DEFAULT_LEVEL,
                     on_run: Callable[[dict[str, int], RunObservation], None] | None = None) -> ValidationReport:
    """Run every configuration to the loss target `repeats` times and score the model. The runs go
    in rounds, every configuration once per round (`parallel` of them at a time), so a slow spell
    of the machine lands on runs of different configurations rather than on all runs of one;
    `on_run(cluster, run)` after each run (progress)."""
    if not configs:
        raise ProfilingError("no validation configurations given")
    if repeats < 1:
        raise ProfilingError(f"repeats must be at least 1, got {repeats}")
    held_in = [c for c in configs if fitted_clusters and _same(c, fitted_clusters)]
    if held_in:
        raise ProfilingError(f"validation configuration {held_in[0]} was used for fitting; validate on held-out ones")
    predictions = [predict_config(profile, cluster, loss_target, level) for cluster in configs]  # fails before any run
    started_s = time.monotonic()
    run_id = run_id or fresh_run_id("validate")

    def one(job: tuple[int, int]) -> RunObservation:
        round_k, k = job
        run = run_once(provider, f"{run_id}-v{k}-r{round_k}", profile, workload, predictions[k], loss_target,
                       workload_options=workload_options, ps_megabits_per_s=ps_megabits_per_s, timeout_s=timeout_s)
        if on_run is not None:
            on_run(configs[k], run)
        return run

    runs: list[list[RunObservation]] = [[] for _ in configs]
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        for round_k in range(repeats):
            for k, run in enumerate(pool.map(one, [(round_k, k) for k in range(len(configs))])):
                runs[k].append(run)
    results = [score_config(p, r) for p, r in zip(predictions, runs)]
    report = ValidationReport(
        workload=workload, loss_target=loss_target, configs=results,
        median_time_error=statistics.median(r.time_error for r in results),
        max_time_error=max(r.time_error for r in results),
        median_iterations_error=statistics.median(r.iterations_error for r in results),
        paper_median_time_error=statistics.median(r.paper_time_error for r in results),
        paper_max_time_error=max(r.paper_time_error for r in results),
        baseline_median_time_error=statistics.median(r.baseline_time_error for r in results),
        baseline_max_time_error=max(r.baseline_time_error for r in results),
        median_speed_time_error=statistics.median(r.speed_time_error for r in results),
        baseline_median_speed_time_error=statistics.median(r.baseline_speed_time_error for r in results),
        median_compute_stretch=statistics.median(r.compute_stretch for r in results),
        one_gpu_median_time_error=_median_or_none([r.time_error for r in results if not multi_gpu(r)]),
        multi_gpu_median_time_error=_median_or_none([r.time_error for r in results if multi_gpu(r)]),
        form=_recorded_form(profile), interval_level=level,
        coverage=coverage(results), wall_s=time.monotonic() - started_s,
    )
    if plot_path is not None:
        report.plot = str(plot_validation(report, plot_path))
    return report


def multi_gpu(result: ConfigResult) -> bool:
    """Whether a worker of the cluster has several GPUs (its replicas sum over the instance's PCIe)."""
    return any(result.gpus_per_worker[t] > 1 for t, n in result.cluster.items() if n)


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def coverage(results: list[ConfigResult]) -> float | None:
    """The share of runs whose observed time lies inside their interval (None without intervals)."""
    checked = [run.inside for r in results for run in r.runs if run.inside is not None]
    return statistics.fmean(checked) if checked else None


def _same(cluster: dict[str, int], others: list[dict[str, int]]) -> bool:
    norm = {t: n for t, n in cluster.items() if n}
    return any(norm == {t: n for t, n in o.items() if n} for o in others)


def plot_validation(report: ValidationReport, path: Path) -> Path:
    """Two panels (PNG): predicted against observed training time, the model's points with each
    configuration's run-to-run range and the contention-blind baseline, inside the +-10% band; and
    each configuration's signed errors (time, iterations, speed model alone)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = report.configs
    observed = np.array([r.observed_time_s for r in configs])
    predicted = np.array([r.predicted_time_s for r in configs])
    baseline = np.array([r.baseline_time_s for r in configs])
    paper = np.array([r.paper_time_s for r in configs])
    run_times = [[run.observed_time_s for run in r.runs] for r in configs]
    spread = np.array([[o - min(t) for o, t in zip(observed, run_times)], [max(t) - o for o, t in zip(observed, run_times)]])
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})

    low = 0.85 * min(observed.min(), predicted.min(), baseline.min(), paper.min())
    high = 1.1 * max(observed.max(), predicted.max(), baseline.max(), paper.max())
    line = np.array([low, high])
    ax.plot(line, line, color="grey", lw=0.8, label="predicted = observed")
    ax.fill_between(line, 0.9 * line, 1.1 * line, color="grey", alpha=0.12, label="within 10%")
    ax.errorbar(observed, predicted, xerr=spread, fmt="o", color="C0", capsize=2, zorder=3,
                label="spotfill model (runs' range)")
    ax.scatter(observed, paper, marker="+", color="C2", zorder=3, label="paper's form")
    ax.scatter(observed, baseline, marker="x", color="C1", zorder=3, label="contention-blind")
    for r, x, y in zip(configs, observed, predicted):
        ax.annotate(cluster_label(r.cluster, short=True), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("observed training time to target (s)")
    ax.set_ylabel("predicted (s)")
    ax.set_title(f"{report.workload} to loss {report.loss_target:g}: time error median "
                 f"{report.median_time_error:.1%}, max {report.max_time_error:.1%} "
                 f"(blind {report.baseline_median_time_error:.1%}, {report.baseline_max_time_error:.1%})", fontsize=8)
    ax.legend(fontsize=7, loc="upper left")

    signed = {
        "time": (predicted - observed) / observed,
        "iterations": np.array([(r.predicted_iterations - r.observed_iterations) / r.observed_iterations for r in configs]),
        "speed model alone": np.array([statistics.fmean(run.speed_time_s for run in r.runs) for r in configs]) / observed - 1,
    }
    x = np.arange(len(configs))
    width = 0.8 / len(signed)
    for k, (name, values) in enumerate(signed.items()):
        bars.bar(x + (k - 1) * width, 100 * values, width, label=name)
    for level in (-10, 10):
        bars.axhline(level, color="grey", lw=0.8, ls="--")
    bars.axhline(0, color="black", lw=0.6)
    bars.set_xticks(x, [cluster_label(r.cluster, short=True) for r in configs], rotation=30, ha="right", fontsize=7)
    bars.set_ylabel("predicted - observed (% of observed)")
    bars.set_title(f"per configuration (iterations error median {report.median_iterations_error:.1%})", fontsize=8)
    bars.legend(fontsize=7)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())
