"""Fit the model's parameters (docs/model.md) to measurements with bounded least squares.

Three fits, each with bounds, starting points and a quality report (residuals, RMSE, R^2):
- memory (Eq. 10): batch_per_gpu = alpha2 * memory_gb + beta2, from (batch, peak memory) points;
- contention (Eq. 8, 9): alpha1, beta1 from each cluster worker's communication time;
- loss curve (Eq. 3): gamma1..gamma5 from the smoothed loss of each profiled cluster against its
  update count, with the cluster's WA batch size bw, convergence coefficient R and size n; the
  residuals are in iterations (Eq. 3 solved for j), where the planner uses the curve, taken where
  each cluster first crossed a common grid of loss levels (`loss_band`, `crossings`).
Too few points, a fit that does not converge, and non-finite data are ProfilingErrors naming the
cause, never a silent profile.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from pydantic import BaseModel
from scipy.optimize import least_squares

from tasks.profile import Profile, profile_from_dict
from tasks.profiling.measurements import ClusterMeasurement, ProfilingError, TypeMeasurement

LOSS_LEVELS = 30  # loss levels of the band each cluster's crossings are taken at
BAND_TOP = 0.35  # the band starts where the loss has covered 65% of its fall (above: the warm-up knee)
BAND_MARGIN = 0.03  # ...and ends this share of the fall above the highest cluster's lowest loss
LOCAL_PCIE_MBPS = 1e6  # the local provider does not emulate PCIe: its term is negligible


class FitQuality(BaseModel):
    """How well one fit explains its data."""

    name: str
    params: dict[str, float]
    start: dict[str, float]
    n_points: int
    residuals: list[float]
    rmse: float
    r2: float
    nfev: int
    message: str


@dataclass
class FittedProfile:
    profile: Profile
    quality: dict[str, FitQuality]


def r_squared(observed: np.ndarray, predicted: np.ndarray) -> float:
    ss_res = float(np.sum((observed - predicted) ** 2))
    ss_tot = float(np.sum((observed - observed.mean()) ** 2))
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


def _require_points(name: str, n_points: int, n_params: int, hint: str) -> None:
    if n_points < n_params + 1:
        raise ProfilingError(f"{name} fit: too few points ({n_points}) for {n_params} parameters; {hint}")


def _require_finite(name: str, *arrays: np.ndarray) -> None:
    for a in arrays:
        if not np.all(np.isfinite(a)):
            raise ProfilingError(f"{name} fit: the measurements contain NaN or infinite values "
                                 "(a diverged or broken run)")


def _least_squares(name: str, residuals: Callable[[np.ndarray], np.ndarray], starts: Sequence[np.ndarray],
                   lower: np.ndarray, upper: np.ndarray, max_nfev: int | None):
    """Bounded least squares from several starting points; the best converged one wins."""
    best = None
    failures = []
    for x0 in starts:
        x0 = np.clip(np.asarray(x0, dtype=float), lower, upper)
        result = least_squares(residuals, x0, bounds=(lower, upper), x_scale="jac", max_nfev=max_nfev)
        if not result.success or not np.all(np.isfinite(result.fun)):
            failures.append(result.message)
            continue
        if best is None or result.cost < best[0].cost:
            best = (result, x0)
    if best is None:
        raise ProfilingError(f"{name} fit did not converge from any of {len(starts)} starting points: "
                             f"{failures[0] if failures else 'no result'}")
    return best


# ---------------------------------------------------------------- memory (Eq. 10)


def fit_memory(batches: Sequence[int], peak_bytes: Sequence[int], *, max_nfev: int | None = None) -> FitQuality:
    """batch = alpha2 * memory_gb + beta2 (the paper's Eq. 10 regression)."""
    b = np.asarray(batches, dtype=float)
    m_gb = np.asarray(peak_bytes, dtype=float) / 1e9
    _require_finite("memory", b, m_gb)
    _require_points("memory", len(b), 2, "measure more batch sizes")
    if np.ptp(m_gb) <= 0:
        raise ProfilingError("memory fit: peak memory does not change with the batch size")
    slope, intercept = np.polyfit(m_gb, b, 1)
    start = np.array([slope, intercept])
    (result, x0) = _least_squares("memory", lambda x: x[0] * m_gb + x[1] - b, [start],
                                  np.array([0.0, -np.inf]), np.array([np.inf, np.inf]), max_nfev)
    return _quality("memory", ("alpha2", "beta2"), result, x0, b, b + result.fun)


def max_batch_per_gpu(alpha2: float, beta2: float, memory_gb: float) -> int:
    """Eq. 10: the largest power of two the memory admits (at least 1)."""
    fits = alpha2 * memory_gb + beta2
    return 2 ** max(0, math.floor(math.log2(fits))) if fits >= 1 else 1


# ---------------------------------------------------------------- contention (Eq. 8, 9)


def worker_bandwidth_mbps(n: np.ndarray, alpha1: float, beta1: float, breq_mbps: float, bps_mbps: float) -> np.ndarray:
    """Bwk of Eq. 8 with P of Eq. 9 (the same formula tasks.model evaluates)."""
    n = np.asarray(n, dtype=float)
    share = np.clip(alpha1 * np.sqrt(n) + beta1, 0.0, 1.0)
    contended = share * bps_mbps / np.maximum(n, 1.0) + (1.0 - share) * breq_mbps
    return np.where(n * breq_mbps <= bps_mbps, breq_mbps, contended)


def fit_contention(n_workers: Sequence[int], comm_s: Sequence[float], gpus: Sequence[int], *, param_mb: float,
                   breq_mbps: float, bps_mbps: float, pcie_mbps: float, max_nfev: int | None = None) -> FitQuality:
    """alpha1, beta1 from each cluster worker's median push+pull time; residuals are relative."""
    n = np.asarray(n_workers, dtype=float)
    obs = np.asarray(comm_s, dtype=float)
    g = np.asarray(gpus, dtype=float)
    _require_finite("contention", n, obs)
    contended = n * breq_mbps > bps_mbps
    _require_points("contention", int(contended.sum()), 2,
                    "profile clusters large enough that n * Breq exceeds the PS bandwidth")
    if len(set(n[contended].tolist())) < 2:
        raise ProfilingError("contention fit: the contended workers all come from clusters of one size; "
                             "profile at least two cluster sizes in the contention regime")

    def predicted(x: np.ndarray) -> np.ndarray:
        bwk = worker_bandwidth_mbps(n, x[0], x[1], breq_mbps, bps_mbps)
        return 2 * param_mb / bwk + 2 * g * param_mb / pcie_mbps

    starts = [np.array(s) for s in ((0.8, -1.92), (0.3, -0.3), (0.1, 0.2), (1.5, -3.0))]
    result, x0 = _least_squares("contention", lambda x: (predicted(x) - obs) / obs, starts,
                                np.array([0.0, -10.0]), np.array([5.0, 1.0]), max_nfev)
    return _quality("contention", ("alpha1", "beta1"), result, x0, obs, predicted(result.x),
                    residuals=predicted(result.x) - obs)


# ---------------------------------------------------------------- loss curve (Eq. 3)


@dataclass(frozen=True)
class LossSeries:
    """One cluster's (update count, smoothed loss) points, in fit_profile the first crossing of each
    level of the band, with the cluster's shape."""

    wa_batch: float  # bw
    cc: float  # R
    workers: int  # n
    updates: np.ndarray  # j
    losses: np.ndarray


def cluster_shape(batches: Sequence[float], iteration_times_s: Sequence[float]) -> tuple[float, float]:
    """(bw, R) of Eq. 4, 5 from each worker's batch and iteration time."""
    b = np.asarray(batches, dtype=float)
    t = np.asarray(iteration_times_s, dtype=float)
    v_each = b / t
    v = v_each.sum()
    texp = 1.0 / np.sum(1.0 / t)
    w = np.sort(v_each / v)[::-1]
    cc = math.sqrt(max(0.0, (w[0] - 1.0) ** 2 + float(np.sum(w[1:] ** 2))))
    return float(v * texp), cc


def loss_curve(j: np.ndarray, bw, cc, n, g: np.ndarray) -> np.ndarray:
    """Eq. 3 with gamma4 (the R-aware form)."""
    return (g[1] * bw + g[2]) * np.sqrt((cc + g[3]) * n) / (j + g[0]) + g[4]


def iterations_to_loss(loss: np.ndarray, bw, cc, n, g: np.ndarray) -> np.ndarray:
    """Eq. 3 solved for j: the updates the curve needs to come down to `loss`."""
    return (g[1] * bw + g[2]) * np.sqrt((cc + g[3]) * n) / (loss - g[4]) - g[0]


MIN_ITERATIONS = 10.0  # relative iteration residuals are taken against at least this many updates


def fit_loss_curve(series: Sequence[LossSeries], *, max_nfev: int | None = None) -> FitQuality:
    """gamma1..gamma5 of Eq. 3, fitted in the space the planner uses it in: for every observed
    (j, loss) point, the iterations the curve predicts to reach that loss against the observed j
    (relative residuals). A loss-space fit spends its accuracy on the plateau and misses where
    the curve crosses a target (docs/profiling.md, Measured)."""
    if not series:
        raise ProfilingError("loss-curve fit: no profiled clusters")
    for s in series:
        _require_finite("loss-curve", s.losses)
    j = np.concatenate([s.updates for s in series]).astype(float)
    loss = np.concatenate([s.losses for s in series]).astype(float)
    bw = np.concatenate([np.full(len(s.updates), s.wa_batch) for s in series])
    cc = np.concatenate([np.full(len(s.updates), s.cc) for s in series])
    n = np.concatenate([np.full(len(s.updates), s.workers) for s in series])
    _require_points("loss-curve", len(loss), 5, "run the profiling clusters for longer")
    if len(series) < 2:
        raise ProfilingError("loss-curve fit: one cluster cannot separate the batch-size and cluster-size "
                             "terms; profile at least two clusters")
    low, high = float(loss.min()), float(loss.max())
    if high <= low:
        raise ProfilingError("loss-curve fit: the loss did not fall in any profiled cluster")
    scale = np.maximum(j, MIN_ITERATIONS)
    lower = np.array([0.0, -1e4, -1e4, 1e-3, min(0.0, low - abs(low) - 1.0)])
    upper = np.array([1e6, 1e4, 1e6, 10.0, low - 1e-3 * (high - low)])
    starts = []
    spread = float(np.median(np.sqrt((cc + 0.5) * n)))
    for gamma1 in (10.0, 100.0, 1000.0):
        for floor in (0.9 * low, 0.5 * low):
            gamma3 = max(high - floor, 1e-3) * gamma1 / spread
            starts.append(np.array([gamma1, 0.0, gamma3, 0.5, floor]))
    result, x0 = _least_squares("loss-curve", lambda g: (iterations_to_loss(loss, bw, cc, n, g) - j) / scale,
                                starts, lower, upper, max_nfev)
    predicted_j = iterations_to_loss(loss, bw, cc, n, result.x)
    return _quality("loss-curve", ("gamma1", "gamma2", "gamma3", "gamma4", "gamma5"), result, x0, j, predicted_j)


def _quality(name, names, result, x0, observed, predicted, residuals=None) -> FitQuality:
    residuals = result.fun if residuals is None else residuals
    return FitQuality(
        name=name, params=dict(zip(names, map(float, result.x))), start=dict(zip(names, map(float, x0))),
        n_points=len(observed), residuals=[float(r) for r in residuals],
        rmse=float(np.sqrt(np.mean(np.square(residuals)))), r2=r_squared(np.asarray(observed), np.asarray(predicted)),
        nfev=int(result.nfev), message=str(result.message),
    )


def loss_band(curves: Sequence[Sequence[tuple[int, float]]]) -> tuple[float, float]:
    """(top, bottom) of the loss levels the curve is fitted on: the band every profiled cluster
    crossed, below the warm-up knee (which no hyperbola follows) and above the plateau of the
    slowest cluster (where a 0.01 wobble of the loss moves the crossing by tens of updates).
    Every cluster then weighs the same, whatever its length or speed."""
    curves = [np.asarray(c, dtype=float).reshape(-1, 2) for c in curves]
    if not curves or any(len(c) == 0 for c in curves):
        raise ProfilingError("loss-curve fit: a profiled cluster has no losses")
    first = float(np.median([c[0, 1] for c in curves]))
    lowest = min(float(c[:, 1].min()) for c in curves)
    fall = first - lowest
    top = lowest + BAND_TOP * fall
    bottom = max(float(c[:, 1].min()) for c in curves) + BAND_MARGIN * fall
    if not (fall > 0 and bottom < top):
        raise ProfilingError(f"loss-curve fit: the profiled clusters share no loss band below the warm-up "
                             f"(slowest cluster's lowest loss {bottom - BAND_MARGIN * fall:.4g}, band top {top:.4g}); "
                             "run the clusters longer")
    return top, bottom


def crossings(points: Sequence[tuple[int, float]], top: float, bottom: float,
              levels: int = LOSS_LEVELS) -> tuple[np.ndarray, np.ndarray]:
    """(j, level): the first update at which the smoothed loss was at or below each of `levels`
    evenly spaced levels from `top` to `bottom` (the update count the PS stops on for a target)."""
    arr = np.asarray(points, dtype=float).reshape(-1, 2)
    grid = np.linspace(top, bottom, levels)
    reached = arr[:, 1][None, :] <= grid[:, None]
    crossed = reached.any(axis=1)
    return arr[reached[crossed].argmax(axis=1), 0], grid[crossed]


# ---------------------------------------------------------------- the whole profile


def fit_profile(workload: str, measurements: Sequence[TypeMeasurement], cluster_measurements: Sequence[ClusterMeasurement],
                *, quotas: dict[str, int] | None = None, default_quota: int = 8, pcie_bandwidth_mbps: float = LOCAL_PCIE_MBPS,
                num_ps: int = 1, max_nfev: int | None = None, extra: dict | None = None) -> FittedProfile:
    """A contract profile (docs/formats.md) from single-type and cluster measurements."""
    if not measurements:
        raise ProfilingError("no instance types were profiled")
    sizes = {m.param_mb for m in measurements}
    if max(sizes) > 1.01 * min(sizes):
        raise ProfilingError(f"the types disagree on the parameter size ({sorted(sizes)} MB): not one workload")
    param_mb = measurements[0].param_mb
    breq = float(np.mean([m.required_bandwidth_mbps for m in measurements]))
    by_type = {m.type: m for m in measurements}
    bps_values = {c.ps_bandwidth_mbps for c in cluster_measurements}
    if len(bps_values) != 1:
        raise ProfilingError(f"the profiled clusters ran with different PS bandwidths {sorted(bps_values)}")
    bps = bps_values.pop() / num_ps

    rows_n, rows_comm, rows_g, series = [], [], [], []
    top, bottom = loss_band([c.losses for c in cluster_measurements])
    for c in cluster_measurements:
        unknown = set(c.cluster) - set(by_type)
        if unknown:
            raise ProfilingError(f"cluster {c.cluster} uses types not profiled alone: {sorted(unknown)}")
        for w in c.workers:
            rows_n.append(c.n)
            rows_comm.append(w.comm_time_s)
            rows_g.append(by_type[w.type].gpus)
        bw, cc = cluster_shape([w.batch for w in c.workers], [w.iteration_time_s for w in c.workers])
        j, levels = crossings(c.losses, top, bottom)
        series.append(LossSeries(bw, cc, c.n, j, levels))
    contention = fit_contention(rows_n, rows_comm, rows_g, param_mb=param_mb, breq_mbps=breq, bps_mbps=bps,
                                pcie_mbps=pcie_bandwidth_mbps, max_nfev=max_nfev)
    loss = fit_loss_curve(series, max_nfev=max_nfev)

    instances = []
    for m in measurements:
        compute_s = m.iteration_time_s - 2 * param_mb / breq - 2 * m.gpus * param_mb / pcie_bandwidth_mbps
        if compute_s <= 0:
            raise ProfilingError(f"{m.type}: the iteration alone ({m.iteration_time_s:.4f} s) is shorter than its "
                                 f"modelled communication; Breq of the types differ too much")
        instances.append({
            "type": m.type, "gpus": m.gpus, "batch_per_gpu": m.batch_per_gpu, "compute_time_s": compute_s,
            "spot_price": m.spot_price, "on_demand_price": m.on_demand_price,
            "quota": (quotas or {}).get(m.type, default_quota),
            "iteration_time_alone_s": m.iteration_time_s, "required_bandwidth_mbps": m.required_bandwidth_mbps,
            "alpha2": m.alpha2, "beta2": m.beta2, "max_batch_per_gpu": m.max_batch_per_gpu,
            "memory_device": m.memory_device,
        })
    data = {
        "workload": workload, "param_mb": param_mb, "required_bandwidth_mbps": breq, "ps_bandwidth_mbps": bps,
        "pcie_bandwidth_mbps": pcie_bandwidth_mbps, "num_ps": num_ps,
        "contention": contention.params, "loss": loss.params, "instances": instances,
        "fit_quality": {q.name: {"r2": q.r2, "rmse": q.rmse, "n_points": q.n_points} for q in (contention, loss)},
        **(extra or {}),
    }
    return FittedProfile(profile_from_dict(data, source=f"fitted profile of {workload}"),
                         {"contention": contention, "loss": loss})
