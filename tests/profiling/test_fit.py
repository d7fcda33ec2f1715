"""Unit tests for the profiling fits, store and validation arithmetic, on synthetic data."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tasks.core.errors import UserInputError
from tasks.core.model import Model, contended_bandwidth_mbps
from tasks.profiling.clusters import smoothed_losses, worker_observations
from tasks.profiling.fit import (
    LossSeries, cluster_shape, crossings, fit_contention, fit_loss_curve, fit_memory, fit_profile, loss_band,
    iterations_to_loss, loss_curve, max_batch_per_gpu,
)
from tasks.profiling.measurements import ProfilingError
from tasks.profiling.store import RawMeasurements, cache_key, cached_profile, save_profile
from tasks.profiling.validate import replay_starts_s, time_on_schedule
from tasks.runtime.stagger import ALIGN_STEP
from tasks.runtime.telemetry import TelemetryReader
from tests.profiling.synthetic import BPS, BREQ, QUICK_DESIGN, S_MB, synthetic_measurements

RNG = np.random.default_rng(7)
GAMMA = np.array([40.0, -0.5, 60.0, 0.4, 1.3])


# ---------------------------------------------------------------- memory


def test_memory_fit_recovers_the_line_and_the_power_of_two_batch():
    batches = [1, 2, 4, 8, 16]
    peak = [int((b + 6.0) / 2000.0 * 1e9) for b in batches]  # batch = 2000 * GB - 6
    q = fit_memory(batches, peak)
    assert q.params["alpha2"] == pytest.approx(2000.0, rel=1e-6)
    assert q.params["beta2"] == pytest.approx(-6.0, abs=1e-3)
    assert q.r2 == pytest.approx(1.0)
    assert max_batch_per_gpu(2000.0, -6.0, 8.0) == 8192  # 15994 -> 2**13
    assert max_batch_per_gpu(2000.0, -6.0, 0.001) == 1


def test_memory_fit_rejects_too_few_points_and_flat_memory():
    with pytest.raises(ProfilingError, match="too few points"):
        fit_memory([1, 2], [10, 20])
    with pytest.raises(ProfilingError, match="does not change"):
        fit_memory([1, 2, 4], [10, 10, 10])


# ---------------------------------------------------------------- contention


def _contention_data(alpha1, beta1, noise=0.01):
    n = np.repeat([2, 4, 7], [2, 4, 7])
    comm = 2 * S_MB / contended_bandwidth_mbps(n, alpha1, beta1, BREQ, BPS)
    return n, comm * (1 + noise * RNG.standard_normal(len(n)))


def test_contention_fit_recovers_alpha1_beta1():
    n, comm = _contention_data(0.6, -0.75, noise=0.0)
    q = fit_contention(n, comm, [1] * len(n), param_mb=S_MB, breq_mbps=BREQ, bps_mbps=BPS, pcie_mbps=1e9)
    bwk = contended_bandwidth_mbps(np.array([4, 7]), q.params["alpha1"], q.params["beta1"], BREQ, BPS)
    assert bwk == pytest.approx(contended_bandwidth_mbps(np.array([4, 7]), 0.6, -0.75, BREQ, BPS), rel=1e-4)
    assert q.r2 > 0.999
    assert len(q.residuals) == len(n)


def test_contention_fit_needs_the_contention_regime_and_two_sizes():
    with pytest.raises(ProfilingError, match="too few points"):
        fit_contention([1, 1, 1], [0.05] * 3, [1] * 3, param_mb=S_MB, breq_mbps=BREQ, bps_mbps=BPS, pcie_mbps=1e9)
    with pytest.raises(ProfilingError, match="one PS load"):
        fit_contention([4] * 4, [0.1] * 4, [1] * 4, param_mb=S_MB, breq_mbps=BREQ, bps_mbps=BPS, pcie_mbps=1e9)


def test_contention_fit_that_does_not_converge_is_an_error():
    n, comm = _contention_data(0.6, -0.75)
    with pytest.raises(ProfilingError, match="did not converge"):
        fit_contention(n, comm, [1] * len(n), param_mb=S_MB, breq_mbps=BREQ, bps_mbps=BPS, pcie_mbps=1e9, max_nfev=1)


# ---------------------------------------------------------------- loss curve


def _series(noise=0.0, one_worker=True):
    """Clusters of 2, 4 and 7 workers (and one worker alone) on the R-aware curve GAMMA."""
    out = []
    for bw, cc, n in ((10.0, 0.6, 2), (14.0, 0.8, 4), (8.0, 0.9, 7)) + (((12.0, 0.0, 1),) if one_worker else ()):
        j = np.arange(1, 400, 2, dtype=float)
        loss = loss_curve(j, bw, cc, n, GAMMA) + noise * RNG.standard_normal(len(j))
        out.append(LossSeries(bw, cc, n, j, loss))
    return out


def test_loss_curve_fit_recovers_iterations_to_target():
    q = fit_loss_curve(_series(noise=0.005))
    g = np.array(list(q.params.values()))
    assert q.r2 > 0.99
    for bw, cc, n in ((12.0, 0.7, 3), (9.0, 0.85, 6)):
        truth = (GAMMA[1] * bw + GAMMA[2]) * np.sqrt((cc + GAMMA[3]) * n) / (1.6 - GAMMA[4]) - GAMMA[0]
        fitted = (g[1] * bw + g[2]) * np.sqrt((cc + g[3]) * n) / (1.6 - g[4]) - g[0]
        assert fitted == pytest.approx(truth, rel=0.03)


def test_loss_curve_fit_leaves_gamma4_null_without_a_one_worker_cluster():
    """Without R = 0 in the data gamma4 is not identified, yet it alone sets the one-worker
    prediction (at gamma4 near 0 one worker converges at once): the fit leaves it null."""
    with_one = fit_loss_curve(_series(noise=0.005))
    without = fit_loss_curve(_series(noise=0.005, one_worker=False))
    assert with_one.params["gamma4"] is not None and without.params["gamma4"] is None
    assert list(without.params) == ["gamma1", "gamma2", "gamma3", "gamma4", "gamma5"]
    assert "gamma4" not in without.start and without.r2 > 0.95
    g = list(without.params.values())
    one, two = (float(iterations_to_loss(np.array(1.6), 12.0, cc, n, g)) for cc, n in ((0.0, 1), (0.707, 2)))
    assert one == pytest.approx((two + g[0]) / np.sqrt(2) - g[0])  # n ** 1/2: no R term
    kappa = fit_loss_curve(_series(one_worker=False), free_kappa=True).params
    assert kappa["gamma4"] is None and 0.25 <= kappa["kappa"] <= 1.0


def test_loss_curve_fit_errors_name_the_cause():
    series = _series()
    nan = LossSeries(1.0, 0.5, 2, series[0].updates, np.where(series[0].updates > 50, np.nan, series[0].losses))
    with pytest.raises(ProfilingError, match="NaN"):
        fit_loss_curve([nan, series[1]])
    short = [LossSeries(s.wa_batch, s.cc, s.workers, s.updates[:1], s.losses[:1]) for s in series[:2]]
    with pytest.raises(ProfilingError, match="too few points"):
        fit_loss_curve(short)
    with pytest.raises(ProfilingError, match="at least two clusters"):
        fit_loss_curve(series[:1])
    with pytest.raises(ProfilingError, match="did not converge"):
        fit_loss_curve(series, max_nfev=2)


def test_crossings_are_the_first_update_at_or_below_each_level():
    points = [(1, 4.0), (2, 3.0), (3, 3.2), (4, 2.5), (5, 2.6), (6, 2.0)]
    j, levels = crossings(points, 3.0, 2.0, levels=3)
    assert list(levels) == [3.0, 2.5, 2.0] and list(j) == [2, 4, 6]  # a later rebound does not count
    j, levels = crossings(points, 3.0, 1.0, levels=5)  # 1.5 and 1.0 never reached: left out
    assert list(levels) == [3.0, 2.5, 2.0] and list(j) == [2, 4, 6]


def test_loss_band_is_what_every_cluster_crossed_below_the_warm_up():
    fast = [(j, 1.0 + 3.0 / j) for j in range(1, 301)]  # 4.0 falling to 1.01
    slow = [(j, 1.5 + 2.5 / j) for j in range(1, 101)]  # 4.0 falling to 1.525
    top, bottom = loss_band([fast, slow])
    fall = 4.0 - fast[-1][1]
    assert top == pytest.approx(fast[-1][1] + 0.35 * fall)
    assert bottom == pytest.approx(slow[-1][1] + 0.03 * fall)  # above the slowest cluster's lowest loss
    with pytest.raises(ProfilingError, match="share no loss band.*run the clusters longer"):
        loss_band([fast, [(j, 3.9 - 0.001 * j) for j in range(1, 101)]])  # one never got past the warm-up


def test_cluster_shape_agrees_with_the_planner_model(shipped_profile_path):
    from tasks.core.profile import load_profile

    model = Model.from_profile(load_profile(shipped_profile_path))
    counts = model.counts_vector({"p3.2xlarge": 2, "g3.8xlarge": 3})
    expected = model.evaluate(counts, 0.9)
    t_i = model.iteration_times_s(np.array(5.0))
    batches, times = [], []
    for name, k in (("p3.2xlarge", 2), ("g3.8xlarge", 3)):
        i = model.types.names.index(name)
        batches += [model.types.batch[i]] * k
        times += [t_i[i]] * k
    bw, cc = cluster_shape(batches, times)
    assert bw == pytest.approx(expected["wa_batch"][0])
    assert cc == pytest.approx(expected["cc"][0])


# ---------------------------------------------------------------- whole profile and store


def test_fit_profile_gives_a_contract_profile_that_predicts_its_own_data():
    types, clusters = synthetic_measurements()
    fitted = fit_profile("synthetic", types, clusters, quotas={"fast": 3})
    p = fitted.profile
    assert p.param_mb == S_MB and p.ps_bandwidth_mbps == BPS
    assert p.instance("fast").quota == 3 and p.instance("slow").quota == 8
    assert fitted.quality["contention"].r2 > 0.999 and fitted.quality["loss"].r2 > 0.999
    model = Model.from_profile(p)
    t_alone = model.iteration_times_s(np.array(1.0))
    assert t_alone == pytest.approx([t.iteration_time_s for t in types])
    t7 = model.iteration_times_s(np.array(7.0))
    assert t7[0] == pytest.approx(clusters[2].workers[0].iteration_time_s, rel=1e-3)
    assert p.model_extra["fit_quality"]["loss-curve"]["workers"] == [2, 7]  # the sizes the curve was fitted on


def test_the_fit_estimates_bpcie_from_the_multi_gpu_types_sums_and_takes_them_out_of_compute():
    from tasks.profiling.fit import LOCAL_PCIE_MBPS, pcie_bandwidth

    types, clusters = synthetic_measurements()
    assert pcie_bandwidth(types) == LOCAL_PCIE_MBPS  # no sum measured
    sum_s = 0.011
    slow = types[1]  # 2 GPUs: its sum is part of its communication, not of the PS link
    types[1] = slow.model_copy(update={"intra_sum_s": sum_s, "comm_time_s": slow.comm_time_s + sum_s,
                                       "iteration_time_s": slow.iteration_time_s + sum_s})
    assert pcie_bandwidth(types) == pytest.approx(2 * 2 * S_MB / sum_s)
    p = fit_profile("synthetic", types, clusters).profile
    assert p.pcie_bandwidth_mbps == pytest.approx(2 * 2 * S_MB / sum_s)
    assert p.instance("slow").compute_time_s == pytest.approx(slow.compute_time_s)
    assert Model.from_profile(p).iteration_times_s(np.array(1.0))[1] == pytest.approx(types[1].iteration_time_s)


@pytest.mark.parametrize("name", ["quick", "full"])
def test_presets_fit_multi_worker_clusters_spanning_the_validation_sizes(name):
    """One worker's updates to a target do not follow the n-shape of two and more under the
    asynchronous rule, so the fit clusters have 2 workers or more, and span the validation
    configurations' sizes and both ends of the batch range (a cluster of each type alone)."""
    from tasks.profiling.presets import preset

    p = preset(name)
    fit_sizes = [sum(c.values()) for c in p.fit_clusters]
    assert min(fit_sizes) >= 2
    assert all(min(fit_sizes) <= sum(c.values()) <= max(fit_sizes) for c in p.validation_configs)
    assert {t for c in p.fit_clusters if len(c) == 1 for t in c} == set(p.types)
    assert not any(c in p.fit_clusters for c in p.validation_configs)


@pytest.mark.parametrize("by, chosen", [("workers", "paper"), ("load", "load")])
def test_fit_chooses_the_form_that_predicts_held_out_clusters(by, chosen):
    """Data made by a form: that form is chosen, with about the smallest leave-one-cluster-out
    error (a form with more terms can only match it), every form's error is recorded, and the
    chosen one's spread is the profile's uncertainty."""
    from tasks.profiling.fit import FORMS

    fitted = fit_profile("synthetic", *synthetic_measurements(by=by))
    form = fitted.form
    assert form.chosen == chosen and [c.name for c in form.candidates] == list(FORMS)
    assert list(FORMS)[:7] == ["paper", "kappa", "load", "overlap", "stale", "noise", "cap"]
    assert "kappa+load+overlap+stale+noise+cap" in FORMS
    assert len(FORMS) == 64  # the batch term's n-exponent is a profile field, not a form the fit offers
    errors = {c.name: c.cv_time_log_rms for c in form.candidates}
    assert all(e is not None and len(c.cv_cluster_errors) == 3 for c, e in zip(form.candidates, errors.values()))
    assert errors[chosen] <= min(errors.values()) + 1e-3 and errors[chosen] < 0.02
    p = fitted.profile
    assert p.uncertainty.time_log_sd == errors[chosen]
    assert p.contention.by == by and p.loss.kappa is None
    assert p.contention.overlap is None and p.loss.batch_staleness is None  # absent: the paper's terms
    assert p.loss.batch_noise is None
    assert p.loss.batch_n_exponent is None
    assert 0.25 <= form.candidate("kappa").loss["kappa"] <= 1.0
    assert p.model_extra["fit_quality"]["form"]["cv_time_log_rms"] == errors


@pytest.mark.parametrize("terms, chosen", [
    ({"kappa": 0.7}, "kappa"),
    ({"link_cap": True}, "cap"),
    ({"kappa": 0.7, "link_cap": True}, "kappa+cap"),
    ({"overlap": 0.3}, "overlap"),
    ({"batch_staleness": 0.1}, "stale"),
    ({"overlap": 0.3, "batch_staleness": 0.1}, "overlap+stale"),
    ({"kappa": 0.4, "batch_staleness": 0.1}, "kappa+stale"),
    ({"batch_noise": 200.0}, "noise"),
    ({"batch_staleness": 0.1, "batch_noise": 200.0}, "stale+noise"),
])
def test_the_further_terms_are_recovered_and_chosen_from_the_quick_design(terms, chosen):
    """Data made with a further term, profiled on the quick preset's design (mixed clusters and a
    same-speed one of each type): the term is identified (its value recovered), the form with it
    predicts held-out clusters clearly better than the paper's, and it is chosen."""
    fitted = fit_profile("synthetic", *synthetic_measurements(design=QUICK_DESIGN, **terms))
    errors = {c.name: c.cv_time_log_rms for c in fitted.form.candidates}
    assert fitted.form.chosen == chosen and errors[chosen] < min(0.02, errors["paper"] / 2)
    p = fitted.profile
    if "overlap" in terms:
        assert p.contention.overlap == pytest.approx(terms["overlap"], abs=0.01) and p.contention.overlap_width == 0.2
    else:
        assert p.contention.overlap is None
    if "batch_staleness" in terms:
        assert p.loss.batch_staleness == pytest.approx(terms["batch_staleness"], abs=0.01)
    else:
        assert p.loss.batch_staleness is None
    if "batch_noise" in terms:
        assert p.loss.batch_noise == pytest.approx(terms["batch_noise"], rel=0.05)
    else:
        assert p.loss.batch_noise is None
    assert p.loss.batch_n_exponent is None
    if "kappa" in terms:
        assert p.loss.kappa == pytest.approx(terms["kappa"], abs=0.02)
    else:
        assert p.loss.kappa is None
    assert p.contention.link_cap is (True if "link_cap" in terms else None)
    paper = fitted.form.candidate("paper")
    assert "overlap" not in paper.contention and "batch_staleness" not in paper.loss and "batch_noise" not in paper.loss


def test_the_link_cap_turns_the_saturated_clusters_fold_from_an_outlier_into_a_prediction():
    """The quick design has one cluster that fills the PS link (7 workers). Without it, Eq. 9's
    curve through the others puts it beyond the link, so every form without the cap misses it
    most (its fold an outlier, as measured: by 20-60% in log time in every such form, which
    let that fold decide the choice); the cap, which has no parameter to fit, predicts it,
    and is chosen."""
    fitted = fit_profile("synthetic", *synthetic_measurements(design=QUICK_DESIGN, kappa=0.7, link_cap=True))
    errors = fitted.form.candidate("kappa").cv_cluster_errors
    saturated = errors.pop("fast=6,slow=1")
    assert saturated > 3 * max(errors.values())
    assert fitted.form.chosen == "kappa+cap"
    assert max(fitted.form.candidate("kappa+cap").cv_cluster_errors.values()) < 0.01


def test_the_overlap_fit_tells_same_speed_workers_from_mixed_ones():
    """Two workers of one period push together on every iteration (share 1), a mixed pair's
    drift apart (share 0): at one PS load, the overlap omega is what separates their push+pull
    times, and the fit recovers it; without the shares the fit has no such term."""
    n = np.array([2, 2, 2, 2, 4, 4, 4, 4], dtype=float)
    shares = np.array([1, 1, 0, 0, 1, 1, 1, 1], dtype=float)
    comm = 2 * S_MB / contended_bandwidth_mbps(n, 0.6, -0.75, BREQ, BPS) * (1 + 0.25 * shares)
    q = fit_contention(n, comm, [1] * len(n), param_mb=S_MB, breq_mbps=BREQ, bps_mbps=BPS, pcie_mbps=1e9, shares=shares)
    assert q.params["overlap"] == pytest.approx(0.25, abs=1e-3) and q.r2 > 0.999
    plain = fit_contention(n, comm, [1] * len(n), param_mb=S_MB, breq_mbps=BREQ, bps_mbps=BPS, pcie_mbps=1e9)
    assert "overlap" not in plain.params and plain.rmse > q.rmse


def _series_on_curve(g, first_batch: float) -> list[LossSeries]:
    """Five clusters of 2 to 7 workers on Eq. 3 with parameters g (as loss_curve takes them), two
    of them at 2 workers (WA batches first_batch and 24)."""
    shapes = ((first_batch, 0.6, 2), (24.0, 0.7, 2), (14.0, 0.8, 4), (8.0, 0.9, 7), (20.0, 0.8, 3))
    j = np.arange(1, 400, 2, dtype=float)
    return [LossSeries(bw, cc, n, j, loss_curve(j, bw, cc, n, g)) for bw, cc, n in shapes]


def _gammas(q) -> list:
    return [q.params[k] for k in ("gamma1", "gamma2", "gamma3", "gamma4", "gamma5")]


def test_loss_curve_fit_recovers_the_staleness_cost_of_the_batch():
    """Clusters of several sizes and WA batches on a curve whose batch slope -0.5 + 0.12 (n - 1)
    changes sign with n (a larger batch needs fewer updates at 2 workers, more at 7): the free
    psi recovers it, and the iterations to a target follow, on both sides of the sign change."""
    g = [40.0, -0.5, 60.0, None, 1.3, None, None, 0.12]
    series = _series_on_curve(g, first_batch=10.0)
    q = fit_loss_curve(series, free_staleness=True)
    assert q.params["batch_staleness"] == pytest.approx(0.12, abs=0.005)
    fitted = _gammas(q) + [None, None, q.params["batch_staleness"]]
    for bw, cc, n in ((12.0, 0.7, 3), (9.0, 0.85, 6), (30.0, 0.85, 6)):
        assert float(iterations_to_loss(np.array(1.6), bw, cc, n, fitted)) == pytest.approx(
            float(iterations_to_loss(np.array(1.6), bw, cc, n, g)), rel=0.01)
    small, large = (float(iterations_to_loss(np.array(1.6), bw, 0.8, n, g)) for bw, n in ((8.0, 2), (24.0, 2)))
    assert large < small  # at 2 workers a larger batch needs fewer updates
    small, large = (float(iterations_to_loss(np.array(1.6), bw, 0.8, n, g)) for bw, n in ((8.0, 7), (24.0, 7)))
    assert large > small  # at 7 more
    assert "batch_staleness" not in fit_loss_curve(series).params


def test_loss_curve_fit_recovers_the_gradient_noise_of_small_batches():
    """Clusters whose updates to a loss fall as 1 / bw towards a floor (beta / bw in the
    numerator: steeply from a small batch, little from a large one, as measured at two workers):
    the free beta recovers it, and the updates to a target follow at batches outside the fitted
    ones at each size; the batch term alone, affine in bw, cannot bend to them."""
    g = [40.0, -0.2, 60.0, None, 1.3, None, None, None, 300.0]
    series = _series_on_curve(g, first_batch=12.0)
    q = fit_loss_curve(series, free_noise=True)
    assert q.params["batch_noise"] == pytest.approx(300.0, rel=0.01)
    fitted = _gammas(q) + [None, None, None, q.params["batch_noise"]]
    plain = fit_loss_curve(series)
    affine = _gammas(plain)
    for bw, cc, n in ((8.0, 0.6, 2), (32.0, 0.8, 4), (10.0, 0.85, 6)):
        truth = float(iterations_to_loss(np.array(1.6), bw, cc, n, g))
        assert float(iterations_to_loss(np.array(1.6), bw, cc, n, fitted)) == pytest.approx(truth, rel=0.01)
    assert float(iterations_to_loss(np.array(1.6), 8.0, 0.6, 2, affine)) < 0.97 * float(
        iterations_to_loss(np.array(1.6), 8.0, 0.6, 2, g))  # the affine term under-predicts the small batch
    assert q.rmse < plain.rmse / 5
    assert "batch_noise" not in plain.params


def _candidate(name, errors):
    from tasks.profiling.fit import FormCandidate

    return FormCandidate(name=name, contention={}, loss={}, cv_cluster_errors={f"c{k}": e for k, e in enumerate(errors)},
                         cv_time_log_rms=None if not errors else float(np.sqrt(np.mean(np.square(errors)))))


def test_the_simplest_form_within_one_standard_error_of_the_best_is_chosen():
    from tasks.profiling.fit import simplest_within_one_se

    paper = _candidate("paper", [0.1, 0.4, 0.2, 0.1, 0.3])
    close = _candidate("kappa", [0.1, 0.37, 0.2, 0.1, 0.28])  # better, by less than its spread
    assert simplest_within_one_se([paper, close]) == "paper"
    clear = _candidate("load", [0.02, 0.03, 0.02, 0.03, 0.02])  # better beyond one standard error
    both = _candidate("kappa+load", [0.02, 0.03, 0.02, 0.03, 0.01])
    assert simplest_within_one_se([paper, close, clear, both]) == "load"  # fewer extensions than kappa+load
    three = _candidate("load+overlap+stale", [0.001, 0.002, 0.001, 0.002, 0.001])
    assert simplest_within_one_se([paper, close, clear, both, three]) == "load+overlap+stale"  # beyond its spread
    assert simplest_within_one_se([_candidate("paper", []), _candidate("kappa", [])]) == "paper"
    # one fold every form misses alike inflates the spread, and the simplest form wins whatever
    # the other folds say; a fold that only the simpler form misses is held against it (the
    # spread is the best form's)
    shared = _candidate("paper", [0.05, 0.08, 0.6, 0.05, 0.06])
    assert simplest_within_one_se([shared, _candidate("kappa", [0.01, 0.02, 0.55, 0.01, 0.02])]) == "paper"
    outlier = _candidate("paper", [0.05, 0.05, 0.6, 0.05, 0.05])
    assert simplest_within_one_se([outlier, _candidate("cap", [0.05, 0.06, 0.05, 0.04, 0.05])]) == "cap"


def test_store_is_atomic_keyed_and_keeps_raw_csv(tmp_path):
    types, clusters = synthetic_measurements()
    fitted = fit_profile("synthetic", types, clusters)
    settings = {"ps_megabits_per_s": 160.0}
    key = cache_key("synthetic", ["fast", "slow"], {"seq_len": 16}, settings)
    assert key != cache_key("synthetic", ["fast", "slow"], {"seq_len": 32}, settings)
    assert cached_profile("synthetic", ["slow", "fast"], workload_options={"seq_len": 16}, settings=settings,
                          directory=tmp_path) is None
    path = save_profile(fitted, RawMeasurements(types, clusters), tmp_path, key=key, provenance_info={"provider": "x"})
    assert cached_profile("synthetic", ["slow", "fast"], workload_options={"seq_len": 16}, settings=settings,
                          directory=tmp_path) == path
    data = json.loads(path.read_text())
    assert data["provenance"] == {"provider": "x"} and data["fit"]["loss"]["n_points"] > 0
    assert {p.name for p in path.parent.iterdir()} == {
        "profile.json", "types.csv", "type_steps.csv", "cluster_workers.csv", "cluster_losses.csv"}
    import pandas as pd

    assert len(pd.read_csv(path.parent / "cluster_losses.csv")) == sum(len(c.losses) for c in clusters)
    save_profile(fitted, RawMeasurements(types, clusters), tmp_path, key=key)  # replaces the old one whole
    assert json.loads(path.read_text())["provenance"] == {}
    before = sorted(p.name for p in (tmp_path / "measured").iterdir())
    with pytest.raises(AttributeError):
        save_profile(fitted, RawMeasurements(types, [None]), tmp_path, key="broken")
    assert sorted(p.name for p in (tmp_path / "measured").iterdir()) == before  # nothing half-written


# ---------------------------------------------------------------- telemetry arithmetic


def test_smoothed_losses_are_the_ps_moving_average(tmp_path):
    updates = [{"kind": "update", "t": float(k), "worker": k % 2, "instance_type": "x", "step": k // 2, "samples": 8,
                "loss": 3.0 - 0.01 * k + 0.1 * (-1) ** k, "compute_s": 0.1, "comm_s": 0.05 if k > 1 else None,
                "version": k + 1, "updates_total": k + 1, "samples_total": 8 * (k + 1), "staleness": 0}
               for k in range(40)]
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(u) + "\n" for u in updates))
    reader = TelemetryReader(tmp_path)
    assert smoothed_losses(updates, reader.loss_smoothing)[-1][1] == pytest.approx(reader.poll().smoothed_loss)
    obs = worker_observations(updates, {0: 8, 1: 16}, "test")
    assert [(o.worker, o.batch, o.updates) for o in obs] == [(0, 8, 20), (1, 16, 20)]
    assert obs[0].iteration_time_s == pytest.approx(0.15)
    with pytest.raises(ProfilingError, match="too few"):
        worker_observations(updates[:8], {0: 8, 1: 16}, "test")


def test_time_on_schedule_counts_each_workers_updates_from_its_first():
    # one worker: its 10th update comes 9 periods after its first
    assert time_on_schedule(10, [0.0], [0.5]) == pytest.approx(4.5)
    # worker 2's first update at 2 s: updates at 0, .5, 1, 1.5, 2, 2, 2.5, 3, 3, 3.5
    assert time_on_schedule(10, [0.0, 2.0], [0.5, 1.0]) == pytest.approx(3.5)
    assert time_on_schedule(2, [3.0, 0.0], [1.0, 1.0]) == pytest.approx(1.0)
    # a fractional count lies between the updates on either side; one update or less takes no time
    assert time_on_schedule(2.5, [0.0], [1.0]) == pytest.approx(1.5)
    assert time_on_schedule(0.4, [0.0, 1.0], [1.0, 1.0]) == 0.0


def test_time_on_schedule_matches_merging_every_workers_updates():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(1, 8))
        starts, periods = rng.uniform(0, 2, n), rng.uniform(0.05, 0.4, n)
        k = int(rng.integers(1, 300))
        events = np.sort(np.concatenate([s + p * np.arange(k) for s, p in zip(starts, periods)]))
        assert time_on_schedule(k, list(starts), list(periods)) == pytest.approx(events[k - 1] - starts.min(), abs=1e-9)


def test_the_replay_puts_each_workers_aligned_update_where_it_was_observed():
    """A worker that waited for its phase slot (stagger.py) after ALIGN_STEP updates: the replay
    has it make its update at ALIGN_STEP at the observed time and one every T after it, with as
    many updates before as it made; a worker that never got that far starts from its first."""
    starts = replay_starts_s([0.0, 0.05], [0.9, None], [0.2, 0.3])
    assert starts == [pytest.approx(0.9 - ALIGN_STEP * 0.2), 0.05]
    # the first worker's updates: ALIGN_STEP + 1 of them by 0.9 s, then one every 0.2 s
    assert time_on_schedule(ALIGN_STEP + 1, starts[:1], [0.2]) + starts[0] == pytest.approx(0.9)
    assert time_on_schedule(ALIGN_STEP + 3, starts[:1], [0.2]) + starts[0] == pytest.approx(1.3)


def test_validation_runs_in_rounds_and_scores_each_configurations_mean(monkeypatch, shipped_profile_path, tmp_path):
    """Every configuration once per round: a slow spell lands on different configurations."""
    from tasks.core import profile as profile_module
    from tasks.profiling import validate

    profile = profile_module.load_profile(shipped_profile_path)
    calls = []

    def fake_run_once(provider, run_id, profile, workload, prediction, loss_target, **kwargs):
        calls.append((run_id, dict(prediction.cluster)))
        seconds = 10.0 + len(calls)  # every run a different length, so the means are checkable
        return validate.RunObservation(
            observed_time_s=seconds, observed_iterations=100 + len(calls), predicted_time_s=11.0, paper_time_s=12.0, baseline_time_s=9.0,
            speed_time_s=10.5, baseline_speed_time_s=8.5, observed_iteration_time_s=0.1, start_skew_s=0.5, wall_s=seconds,
            compute_stretch=1.0 + len(calls) / 10)

    monkeypatch.setattr(validate, "run_once", fake_run_once)
    a, b = {"p3.2xlarge": 2}, {"p3.2xlarge": 1, "g3.8xlarge": 2}
    seen = []
    report = validate.validate_profile(None, profile, "transformer-lm", [a, b], 1.9, run_id="v", repeats=2,
                                       on_run=lambda cluster, run: seen.append(cluster), plot_path=tmp_path / "v.png")
    assert calls == [("v-v0-r0", a), ("v-v1-r0", b), ("v-v0-r1", a), ("v-v1-r1", b)]
    assert seen == [a, b, a, b]
    first, second = report.configs
    assert first.cluster == a and first.observed_time_s == pytest.approx((11.0 + 13.0) / 2)
    assert second.observed_iterations == pytest.approx((102 + 104) / 2)
    assert second.time_error == pytest.approx(abs(11.0 - 13.0) / 13.0)
    assert second.compute_stretch == pytest.approx((1.2 + 1.4) / 2)
    assert report.plot == str(tmp_path / "v.png") and (tmp_path / "v.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.png"]  # written whole, nothing beside it


def test_validation_refuses_an_unreachable_target_before_any_run(monkeypatch, shipped_profile_path):
    from tasks.core import profile as profile_module
    from tasks.profiling import validate

    profile = profile_module.load_profile(shipped_profile_path)
    monkeypatch.setattr(validate, "run_once", lambda *a, **k: pytest.fail("no run may start"))
    with pytest.raises(UserInputError, match="unreachable: the fitted loss curve never goes below gamma5"):
        validate.validate_profile(None, profile, "transformer-lm", [{"p3.2xlarge": 2}], profile.loss.gamma5 - 0.1)


def test_the_quick_preset_validates_one_gpu_multi_gpu_and_mixed_clusters():
    from tasks.profiling.presets import preset
    from tasks.providers.local import default_types

    gpus = {t.name: t.gpus for t in default_types()[0]}
    kinds = {frozenset(gpus[t] > 1 for t in c) for c in preset("quick").validation_configs}
    assert kinds == {frozenset({False}), frozenset({True}), frozenset({False, True})}


def test_validation_reports_each_clusters_gpus_per_worker_and_the_error_of_each_kind(monkeypatch, shipped_profile_path):
    from tasks.core import profile as profile_module
    from tests.helpers import validated_with_fake_runs

    profile = profile_module.load_profile(shipped_profile_path)
    one, multi, mixed = {"p3.2xlarge": 2}, {"g3.8xlarge": 3}, {"p3.2xlarge": 1, "g3.8xlarge": 2}
    report = validated_with_fake_runs(monkeypatch, profile, [one, multi, mixed],
                                      {"p3.2xlarge=2": 11.0, "g3.8xlarge=3": 8.0, "p3.2xlarge=1,g3.8xlarge=2": 12.5})
    assert [r.gpus_per_worker for r in report.configs] == [{"p3.2xlarge": 1}, {"g3.8xlarge": 2},
                                                           {"p3.2xlarge": 1, "g3.8xlarge": 2}]
    assert report.one_gpu_median_time_error == pytest.approx(1 / 11)
    assert report.multi_gpu_median_time_error == pytest.approx((2 / 8 + 2.5 / 12.5) / 2)
