"""Fit the model's parameters (docs/model.md) to measurements with bounded least squares.

Three fits, each with bounds, starting points and a quality report (residuals, RMSE, R^2):
- memory (Eq. 10): batch_per_gpu = alpha2 * memory_gb + beta2, from (batch, peak memory) points;
- contention (Eq. 8, 9): alpha1, beta1 (and the overlap omega) from each cluster worker's
  communication time;
- loss curve (Eq. 3): gamma1..gamma5 from the smoothed loss of each profiled cluster against its
  update count, with the cluster's WA batch size bw, convergence coefficient R and size n; the
  residuals are in iterations (Eq. 3 solved for j), where the planner uses the curve, taken where
  each cluster first crossed a common grid of loss levels (`loss_band`, `crossings`).
The model's form (the paper's, or any set of its terms: a free n-exponent kappa, contention by
PS load, the overlap of same-period transfers, the staleness cost of the batch, the gradient
noise of small batches, the PS link's cap on the update rate) is chosen by
leave-one-cluster-out error (`choose_form`), whose spread becomes the profile's uncertainty.
Too few points, a fit that does not converge, and non-finite data are ProfilingErrors naming the
cause, never a silent profile.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from pydantic import BaseModel
from scipy.optimize import least_squares

from tasks.core.model import Model, cluster_spread, contended_bandwidth_mbps, curve_numerator, overlap_shares
from tasks.core.profile import (BATCH_NOISE_MAX, BATCH_STALENESS_MAX, DEFAULT_OVERLAP_WIDTH, OVERLAP_MAX, Profile,
                                profile_from_dict)
from tasks.profiling.measurements import ClusterMeasurement, ProfilingError, TypeMeasurement, cluster_label

LOSS_LEVELS = 30  # loss levels of the band each cluster's crossings are taken at
BAND_TOP = 0.35  # the band starts where the loss has covered 65% of its fall (above: the warm-up knee)
BAND_MARGIN = 0.03  # ...and ends this share of the fall above the highest cluster's lowest loss
# Bpcie when no multi-GPU type was measured (pcie_bandwidth): its term is then negligible
LOCAL_PCIE_MBPS = 1e6


class FitQuality(BaseModel):
    """How well one fit explains its data."""

    name: str
    params: dict[str, float | None]  # None: a parameter the data cannot identify, left null
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
    form: "FormChoice | None" = None  # the model's form and every candidate's held-out error


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


def fit_contention(loads: Sequence[float], comm_s: Sequence[float], gpus: Sequence[int], *, param_mb: float,
                   breq_mbps: float, bps_mbps: float, pcie_mbps: float, shares: Sequence[float] | None = None,
                   max_nfev: int | None = None) -> FitQuality:
    """alpha1, beta1 from each cluster worker's median push+pull time against its cluster's PS
    load (the worker count n, or n_eff for contention by load); residuals are relative. With
    each worker's overlap share (`shares`, tasks.core.model.overlap_shares) also the overlap
    omega in [0, OVERLAP_MAX], which stretches a contended worker's PS time by 1 + omega * share:
    a pair of one speed against a mixed pair of the same size is what tells it from Eq. 9."""
    n = np.asarray(loads, dtype=float)
    obs = np.asarray(comm_s, dtype=float)
    g = np.asarray(gpus, dtype=float)
    _require_finite("contention", n, obs)
    contended = n * breq_mbps > bps_mbps
    _require_points("contention", int(contended.sum()), 2,
                    "profile clusters large enough that n * Breq exceeds the PS bandwidth")
    if len(set(n[contended].tolist())) < 2:
        raise ProfilingError("contention fit: the contended workers all come from clusters of one PS load; "
                             "profile at least two cluster sizes in the contention regime")

    stretch = None if shares is None else np.asarray(shares, dtype=float) * contended

    def predicted(x: np.ndarray) -> np.ndarray:
        bwk = contended_bandwidth_mbps(n, x[0], x[1], breq_mbps, bps_mbps)
        ps_s = 2 * param_mb / bwk if stretch is None else 2 * param_mb / bwk * (1.0 + x[2] * stretch)
        return ps_s + 2 * g * param_mb / pcie_mbps

    starts = [np.array(s) for s in ((0.8, -1.92), (0.3, -0.3), (0.1, 0.2), (1.5, -3.0))]
    lower, upper, names = np.array([0.0, -10.0]), np.array([5.0, 1.0]), ("alpha1", "beta1")
    if stretch is not None:
        starts = [np.append(x, omega) for x in starts for omega in (0.0, 0.2)]
        lower, upper, names = np.append(lower, 0.0), np.append(upper, OVERLAP_MAX), names + ("overlap",)
    result, x0 = _least_squares("contention", lambda x: (predicted(x) - obs) / obs, starts, lower, upper, max_nfev)
    return _quality("contention", names, result, x0, obs, predicted(result.x), residuals=predicted(result.x) - obs)


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


def _numerator(bw, cc, n, g: Sequence):
    """Eq. 3's numerator for g = gamma1..gamma5 (the paper's), then optionally kappa (the n-shape
    extension), eta (the batch term's n-exponent), psi (the batch's staleness cost) and beta (the
    gradient noise of small batches), None where not used; gamma4 None for the form without R
    (the released prototype's)."""
    kappa, eta, psi, beta = (list(g[5:]) + [None] * 4)[:4]
    return curve_numerator(bw, cc, n, g[1], g[2], g[3], kappa, eta, psi, beta)


def loss_curve(j: np.ndarray, bw, cc, n, g: Sequence) -> np.ndarray:
    """Eq. 3 (g as for _numerator)."""
    return _numerator(bw, cc, n, g) / (j + g[0]) + g[4]


def iterations_to_loss(loss: np.ndarray, bw, cc, n, g: Sequence) -> np.ndarray:
    """Eq. 3 solved for j: the updates the curve needs to come down to `loss` (g as for _numerator)."""
    return _numerator(bw, cc, n, g) / (loss - g[4]) - g[0]


MIN_ITERATIONS = 10.0  # relative iteration residuals are taken against at least this many updates


KAPPA_BOUNDS = (0.25, 1.0)  # the n-shape exponents the profile contract allows
GAMMA4_BOUNDS = (1e-3, 10.0)


def fit_loss_curve(series: Sequence[LossSeries], *, free_kappa: bool = False, free_staleness: bool = False,
                   free_noise: bool = False, max_nfev: int | None = None) -> FitQuality:
    """gamma1..gamma5 of Eq. 3 (and, with free_kappa, the exponent kappa of (R + gamma4) n in
    KAPPA_BOUNDS instead of the paper's 1/2; with free_staleness, the batch's staleness cost
    psi * bw * (n - 1) in [0, BATCH_STALENESS_MAX] instead of 0; with free_noise, the gradient
    noise beta / bw in [0, BATCH_NOISE_MAX] instead of 0), fitted in the space the planner uses
    it in: for
    every observed (j, loss) point, the iterations the curve predicts to reach that loss against
    the observed j (relative residuals). A loss-space fit spends its accuracy on the plateau and
    misses where the curve crosses a target (docs/profiling.md).

    gamma4 is fitted only when a cluster of one worker (R = 0) is among the series: clusters of
    two workers and more span R of about 0.7-0.9, where gamma4 moves the fit little, but it sets
    what the curve predicts for one worker, down to converging at once (gamma4 near 0). Without
    one, gamma4 is null (n ** kappa, no R term: the released prototype's form)."""
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
    with_gamma4 = any(s.workers == 1 for s in series)
    lower = np.array([0.0, -1e4, -1e4, GAMMA4_BOUNDS[0], min(0.0, low - abs(low) - 1.0)])
    upper = np.array([1e6, 1e4, 1e6, GAMMA4_BOUNDS[1], low - 1e-3 * (high - low)])
    names = ("gamma1", "gamma2", "gamma3", "gamma4", "gamma5")
    if not with_gamma4:
        lower, upper, names = np.delete(lower, 3), np.delete(upper, 3), names[:3] + names[4:]
    if free_kappa:
        lower, upper, names = np.append(lower, KAPPA_BOUNDS[0]), np.append(upper, KAPPA_BOUNDS[1]), names + ("kappa",)
    if free_staleness:
        lower, upper = np.append(lower, 0.0), np.append(upper, BATCH_STALENESS_MAX)
        names = names + ("batch_staleness",)
    if free_noise:
        lower, upper, names = np.append(lower, 0.0), np.append(upper, BATCH_NOISE_MAX), names + ("batch_noise",)
    starts = []
    for kappa in ((0.5, 0.75) if free_kappa else (0.5,)):
        spread = float(np.median(cluster_spread(cc, n, 0.5 if with_gamma4 else None, kappa)))
        for gamma1 in (10.0, 100.0, 1000.0):
            for floor in (0.9 * low, 0.5 * low):
                gamma3 = max(high - floor, 1e-3) * gamma1 / spread
                starts.append(np.array([gamma1, 0.0, gamma3] + ([0.5] if with_gamma4 else []) + [floor]
                                       + ([kappa] if free_kappa else []) + ([0.0] if free_staleness else [])
                                       + ([0.0] if free_noise else [])))

    def gammas(x: np.ndarray) -> list:
        """gamma1..gamma5, kappa, eta (never fitted: None), psi and beta (None where not fitted)
        from the fitted vector, gamma4 None without one worker."""
        g = list(x[:5]) if with_gamma4 else [x[0], x[1], x[2], None, x[3]]
        rest = list(x[len(g) - (0 if with_gamma4 else 1):])
        return g + [rest.pop(0) if free_kappa else None, None, rest.pop(0) if free_staleness else None,
                    rest.pop(0) if free_noise else None]

    result, x0 = _least_squares("loss-curve", lambda x: (iterations_to_loss(loss, bw, cc, n, gammas(x)) - j) / scale,
                                starts, lower, upper, max_nfev)
    predicted_j = iterations_to_loss(loss, bw, cc, n, gammas(result.x))
    quality = _quality("loss-curve", names, result, x0, j, predicted_j)
    if not with_gamma4:
        quality.params = {name: quality.params.get(name) for name in names[:3] + ("gamma4",) + names[3:]}
    return quality


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


FLOOR_MIN_POINTS = 5  # points below the warm-up knee a curve needs before its floor is estimated


def curve_floor(points: Sequence[tuple[int, float]]) -> float | None:
    """Where one cluster's curve levels off: Eq. 3's form for a single cluster, a / (j + b) + c,
    fitted (in loss space) to its points below the warm-up knee (BAND_TOP of its fall above its
    lowest); c, or None while there are too few points to tell or no fall."""
    arr = np.asarray(points, dtype=float).reshape(-1, 2)
    if len(arr) < FLOOR_MIN_POINTS:
        return None
    lowest = float(arr[:, 1].min())
    fall = float(arr[0, 1]) - lowest
    if not fall > 0:
        return None
    knee = int(np.argmax(arr[:, 1] <= lowest + BAND_TOP * fall))
    j, loss = arr[knee:, 0], arr[knee:, 1]
    if len(j) < FLOOR_MIN_POINTS or not float(loss.max()) > lowest:
        return None
    lower = np.array([0.0, 0.0, min(0.0, lowest - abs(lowest) - 1.0)])
    upper = np.array([np.inf, 1e6, lowest - 1e-3 * (float(loss.max()) - lowest)])
    starts = [np.array([max(float(loss[0]) - c, 1e-6) * (float(j[0]) + b), b, c])
              for b in (10.0, 100.0, 1000.0) for c in (0.9 * lowest, 0.5 * lowest)]
    try:
        result, _ = _least_squares("loss floor", lambda x: x[0] / (j + x[1]) + x[2] - loss, starts, lower, upper, None)
    except ProfilingError:
        return None
    return float(result.x[2])


def crossings(points: Sequence[tuple[int, float]], top: float, bottom: float,
              levels: int = LOSS_LEVELS) -> tuple[np.ndarray, np.ndarray]:
    """(j, level): the first update at which the smoothed loss was at or below each of `levels`
    evenly spaced levels from `top` to `bottom` (the update count the PS stops on for a target)."""
    arr = np.asarray(points, dtype=float).reshape(-1, 2)
    grid = np.linspace(top, bottom, levels)
    reached = arr[:, 1][None, :] <= grid[:, None]
    crossed = reached.any(axis=1)
    return arr[reached[crossed].argmax(axis=1), 0], grid[crossed]


# ---------------------------------------------------------------- the model's form, by held-out error


@dataclass(frozen=True)
class ProfiledCluster:
    """One profiled cluster as the fits read it."""

    cluster: dict[str, int]
    series: LossSeries  # its crossings of the common loss band
    loads: dict[str, float]  # its PS load by each contention form: {"workers": n, "load": n_eff}
    types: tuple[str, ...]  # each worker's type
    compute_s: np.ndarray  # each worker's median compute time
    comm_s: np.ndarray  # each worker's median push + pull time
    gpus: np.ndarray  # each worker's GPUs
    overlap_shares: np.ndarray  # each worker's overlap share (tasks.core.model.overlap_shares)


# The model's optional terms (docs/model.md, Extensions and Further terms); a form is a set of
# them, and the fit chooses among every set: the paper's form (none), each term alone, each
# pair, and so on, fewest terms first.
TERMS = ("kappa", "load", "overlap", "stale", "noise", "cap")


@dataclass(frozen=True)
class Form:
    terms: frozenset[str]

    @property
    def name(self) -> str:
        return "+".join(t for t in TERMS if t in self.terms) or "paper"

    @property
    def contention_key(self) -> tuple[str, bool]:
        """Which contention fit the form uses: (what loads the PS, with the overlap or not)."""
        return ("load" if "load" in self.terms else "workers", "overlap" in self.terms)

    @property
    def loss_key(self) -> tuple[bool, bool, bool]:
        """Which loss-curve fit the form uses: (free kappa, free staleness cost of the batch, free
        gradient noise)."""
        return ("kappa" in self.terms, "stale" in self.terms, "noise" in self.terms)


FORMS = {f.name: f for f in (Form(frozenset(c)) for k in range(len(TERMS) + 1) for c in itertools.combinations(TERMS, k))}


class FormCandidate(BaseModel):
    """One form of the model, fitted on all profiled clusters, and its held-out error: each
    profiled cluster predicted by the form fitted on the others (time to every loss level of the
    band, `_held_out_errors`)."""

    name: str
    contention: dict  # alpha1, beta1, by (and overlap, overlap_width; link_cap)
    loss: dict  # gamma1..gamma5 and kappa (null: the paper's 1/2) (and batch_staleness, batch_noise)
    cv_time_log_rms: float | None  # RMS over held-out clusters of their RMS log(predicted / observed)
    cv_cluster_errors: dict[str, float]  # held-out cluster -> its RMS log(predicted / observed) time
    cv_failed: str | None = None  # why the cross-validation of this form could not run


class FormChoice(BaseModel):
    chosen: str
    method: str = "leave-one-cluster-out"
    candidates: list[FormCandidate]
    # held-out clusters without which the contention fit had too few PS loads: their folds reuse
    # the contention fit on all clusters (only the loss curve was held out)
    contention_not_held_out: list[str] = []

    def candidate(self, name: str) -> FormCandidate:
        return next(c for c in self.candidates if c.name == name)


def ps_loads(clusters: Sequence[ClusterMeasurement], alone_s: dict[str, float]) -> list[dict[str, float]]:
    """Each cluster's PS load by both contention forms: n, and n_eff = sum_i T_fast / T_i_alone."""
    out = []
    for c in clusters:
        fastest = min(alone_s[t] for t, k in c.cluster.items() if k)
        out.append({"workers": float(c.n), "load": sum(k * fastest / alone_s[t] for t, k in c.cluster.items())})
    return out


def _fit_parts(clusters: Sequence[ProfiledCluster], comm_args: dict, max_nfev: int | None,
               contention_if_unfit: dict[tuple, FitQuality] | None = None):
    """Every contention fit the forms use (by workers or load, with the overlap or not) and every
    loss fit (kappa, the batch's staleness cost and the gradient noise free or not): the two are
    independent, the loss fit reads measured shapes, the contention fit no losses. Where the clusters leave the contention
    fit too few PS loads, `contention_if_unfit` stands in."""
    contention = {}
    for by, overlap in {f.contention_key for f in FORMS.values()}:
        try:
            contention[by, overlap] = fit_contention(
                np.concatenate([np.full(len(c.comm_s), c.loads[by]) for c in clusters]),
                np.concatenate([c.comm_s for c in clusters]), np.concatenate([c.gpus for c in clusters]),
                shares=np.concatenate([c.overlap_shares for c in clusters]) if overlap else None,
                max_nfev=max_nfev, **comm_args)
        except ProfilingError:
            if contention_if_unfit is None:
                raise
            contention[by, overlap] = contention_if_unfit[by, overlap]
    loss = {(kappa, stale, noise): fit_loss_curve([c.series for c in clusters], free_kappa=kappa,
                                                  free_staleness=stale, free_noise=noise, max_nfev=max_nfev)
            for kappa, stale, noise in {f.loss_key for f in FORMS.values()}}
    return contention, loss


def _form_params(contention: dict[tuple, FitQuality], loss: dict[tuple, FitQuality], form: str) -> tuple[dict, dict]:
    """The profile's `contention` and `loss` sections of a form; a term the form leaves out is
    absent (the paper's), except kappa, which is always written (null: the paper's 1/2)."""
    by, overlap = FORMS[form].contention_key
    contention_params = {**contention[by, overlap].params, "by": by}
    if overlap:
        contention_params["overlap_width"] = DEFAULT_OVERLAP_WIDTH
    if "cap" in FORMS[form].terms:
        contention_params["link_cap"] = True
    return contention_params, {"kappa": None, **loss[FORMS[form].loss_key].params}


def _held_out_errors(model: Model, c: ProfiledCluster) -> np.ndarray:
    """log(predicted / observed) time to each loss level the cluster crossed: predicted
    iterations times Texp of the workers' measured compute plus the model's push + pull, against
    the observed crossing times Texp of the measured compute plus push + pull. Compute is
    measured, not predicted, on both sides: the model takes it from each type alone, and a busy
    host stretches the emulated compute of a cluster's workers beyond that, which is no error
    of the model's forms. A prediction of 0 or infinity counts as a factor of 1000."""
    counts = model.counts_vector(c.cluster)
    r = model.evaluate(counts, float(c.series.losses[0]))
    predicted_j = model.iterations(r["wa_batch"], r["cc"], r["workers"], c.series.losses)
    index = [model.types.names.index(t) for t in c.types]
    comm_s = (model.cluster_iteration_times_s(counts)[0] - model.types.compute_s)[index]
    ratio = (predicted_j / np.sum(1.0 / (c.compute_s + comm_s))) / (
        np.maximum(c.series.updates, 1.0) / np.sum(1.0 / (c.compute_s + c.comm_s)))
    return np.log(np.clip(ratio, 1e-3, 1e3))


def simplest_within_one_se(candidates: Sequence[FormCandidate]) -> str:
    """The one-standard-error rule: the simplest form (fewest extensions, FORMS' order on a tie)
    whose mean squared held-out error is within one standard error (over the held-out clusters)
    of the best form's. With five held-out clusters the forms' errors differ by less than their
    spread, and the smallest alone picks noise (docs/profiling.md: a free kappa that won by
    0.02-0.05 predicted the validation clusters worse than the paper's sqrt in two profiles of
    three). "paper" when no form could be scored."""
    scored = [c for c in candidates if c.cv_time_log_rms is not None and c.cv_cluster_errors]
    if not scored:
        return "paper"
    squared = {c.name: np.square(list(c.cv_cluster_errors.values())) for c in scored}
    best = min(scored, key=lambda c: float(squared[c.name].mean()))
    spread = squared[best.name]
    limit = float(spread.mean()) + (float(spread.std(ddof=1) / math.sqrt(len(spread))) if len(spread) > 1 else 0.0)
    simplest_first = sorted(scored, key=lambda c: len(FORMS[c.name].terms))
    return next(c.name for c in simplest_first if float(squared[c.name].mean()) <= limit)


def choose_form(clusters: Sequence[ProfiledCluster], profile_with: Callable[[dict, dict], Profile],
                comm_args: dict, max_nfev: int | None = None) -> tuple[FormChoice, dict[str, FitQuality]]:
    """Fit every form of FORMS on all clusters and, leaving each cluster out in turn, on the
    others; the simplest form within one standard error of the smallest held-out error wins
    (`simplest_within_one_se`), and the chosen form's fits are returned. A held-out fit that
    cannot run (too few clusters left) leaves that form without an error; with none left, the
    paper's form is kept."""
    contention, loss = _fit_parts(clusters, comm_args, max_nfev)
    errors: dict[str, dict[str, float]] = {form: {} for form in FORMS}
    failed: dict[str, str] = {}
    kept_contention = []
    for k, held_out in enumerate(clusters):
        try:
            parts = _fit_parts([c for i, c in enumerate(clusters) if i != k], comm_args, max_nfev, contention)
        except ProfilingError as err:
            failed = {form: f"without {cluster_label(held_out.cluster)}: {err}" for form in FORMS}
            break
        if any(parts[0][key] is contention[key] for key in contention):
            kept_contention.append(cluster_label(held_out.cluster))
        for form in FORMS:
            model = Model.from_profile(profile_with(*_form_params(*parts, form)))
            errors[form][cluster_label(held_out.cluster)] = float(np.sqrt(np.mean(_held_out_errors(model, held_out) ** 2)))
    candidates = []
    for form in FORMS:
        cv = None if form in failed else float(np.sqrt(np.mean(np.square(list(errors[form].values())))))
        candidates.append(FormCandidate(name=form, contention=_form_params(contention, loss, form)[0],
                                        loss=_form_params(contention, loss, form)[1], cv_time_log_rms=cv,
                                        cv_cluster_errors={} if form in failed else errors[form],
                                        cv_failed=failed.get(form)))
    chosen = simplest_within_one_se(candidates)
    return (FormChoice(chosen=chosen, candidates=candidates, contention_not_held_out=kept_contention),
            {"contention": contention[FORMS[chosen].contention_key], "loss": loss[FORMS[chosen].loss_key]})


# ---------------------------------------------------------------- the whole profile


def pcie_bandwidth(measurements: Sequence[TypeMeasurement]) -> float:
    """Bpcie (MB/s) as the multi-GPU types trained: each sums g gradients of S MB over its PCIe in
    `intra_sum_s`, the model's 2 g S / Bpcie; the median over those types (the model has one
    Bpcie). LOCAL_PCIE_MBPS when no multi-GPU type was measured."""
    rates = [2 * m.gpus * m.param_mb / m.intra_sum_s for m in measurements
             if m.gpus > 1 and m.intra_sum_s is not None and m.intra_sum_s > 0]
    return float(np.median(rates)) if rates else LOCAL_PCIE_MBPS


def fit_profile(workload: str, measurements: Sequence[TypeMeasurement], cluster_measurements: Sequence[ClusterMeasurement],
                *, quotas: dict[str, int] | None = None, default_quota: int = 8, pcie_bandwidth_mbps: float | None = None,
                num_ps: int = 1, max_nfev: int | None = None, extra: dict | None = None) -> FittedProfile:
    """A contract profile (docs/formats.md) from single-type and cluster measurements, in the
    form of the model (choose_form) that predicts held-out clusters best, with that form's
    held-out error spread as the profile's `uncertainty`. Bpcie: `pcie_bandwidth_mbps`, else as the
    multi-GPU types trained (pcie_bandwidth)."""
    if not measurements:
        raise ProfilingError("no instance types were profiled")
    sizes = {m.param_mb for m in measurements}
    if max(sizes) > 1.01 * min(sizes):
        raise ProfilingError(f"the types disagree on the parameter size ({sorted(sizes)} MB): not one workload")
    param_mb = measurements[0].param_mb
    breq = float(np.mean([m.required_bandwidth_mbps for m in measurements]))
    pcie_bandwidth_mbps = pcie_bandwidth_mbps or pcie_bandwidth(measurements)
    by_type = {m.type: m for m in measurements}
    bps_values = {c.ps_bandwidth_mbps for c in cluster_measurements}
    if len(bps_values) != 1:
        raise ProfilingError(f"the profiled clusters ran with different PS bandwidths {sorted(bps_values)}")
    bps = bps_values.pop() / num_ps

    top, bottom = loss_band([c.losses for c in cluster_measurements])
    for c in cluster_measurements:
        unknown = set(c.cluster) - set(by_type)
        if unknown:
            raise ProfilingError(f"cluster {c.cluster} uses types not profiled alone: {sorted(unknown)}")
    loads = ps_loads(cluster_measurements, {t: m.iteration_time_s for t, m in by_type.items()})
    type_order = list(by_type)
    alone_s = np.array([by_type[t].iteration_time_s for t in type_order])
    profiled = []
    for c, load in zip(cluster_measurements, loads):
        times_s = [w.iteration_time_s for w in c.workers]
        bw, cc = cluster_shape([w.batch for w in c.workers], times_s)
        j, levels = crossings(c.losses, top, bottom)
        shares = overlap_shares([c.cluster.get(t, 0) for t in type_order], alone_s, DEFAULT_OVERLAP_WIDTH)[0]
        profiled.append(ProfiledCluster(
            cluster=c.cluster, series=LossSeries(bw, cc, c.n, j, levels), loads=load,
            types=tuple(w.type for w in c.workers), compute_s=np.array([w.compute_time_s for w in c.workers]),
            comm_s=np.array([w.comm_time_s for w in c.workers]),
            gpus=np.array([by_type[w.type].gpus for w in c.workers], dtype=float),
            overlap_shares=np.array([shares[type_order.index(w.type)] for w in c.workers])))

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
    base = {"workload": workload, "param_mb": param_mb, "required_bandwidth_mbps": breq, "ps_bandwidth_mbps": bps,
            "pcie_bandwidth_mbps": pcie_bandwidth_mbps, "num_ps": num_ps, "instances": instances}

    def profile_with(contention: dict, loss: dict, **more) -> Profile:
        return profile_from_dict({**base, "contention": contention, "loss": loss, **more},
                                 source=f"fitted profile of {workload}")

    form, quality = choose_form(profiled, profile_with,
                                dict(param_mb=param_mb, breq_mbps=breq, bps_mbps=bps, pcie_mbps=pcie_bandwidth_mbps),
                                max_nfev)
    chosen = form.candidate(form.chosen)
    spread = chosen.cv_time_log_rms
    summary = {q.name: {"r2": q.r2, "rmse": q.rmse, "n_points": q.n_points} for q in quality.values()}
    # the cluster sizes the curve was fitted on: outside them a prediction extrapolates the n-shape
    summary["loss-curve"]["workers"] = [min(c.n for c in cluster_measurements), max(c.n for c in cluster_measurements)]
    summary["form"] = {"chosen": form.chosen, "cv_time_log_rms": {c.name: c.cv_time_log_rms for c in form.candidates}}
    profile = profile_with(chosen.contention, chosen.loss, fit_quality=summary, **(extra or {}),
                           **({} if spread is None else {"uncertainty": {"time_log_sd": spread, "method": form.method}}))
    return FittedProfile(profile, quality, form)
