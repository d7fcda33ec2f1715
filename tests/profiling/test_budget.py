"""Profiling that adapts to the model and its target: the clusters' common loss band, training on
toward a loss target, and the target checked against the fitted curve (tasks/profiling/clusters.py)."""
import pytest

from tasks.profiling.clusters import (
    band_reached, budget_to_reach, check_target_profiled, floor_blocks, laggard, lowest_reachable_target,
    trained_enough, wave_done,
)
from tasks.profiling.fit import cluster_shape, curve_floor, fit_profile, iterations_to_loss, loss_band
from tasks.profiling.measurements import ProfilingError
from tasks.runtime.evaluation import parse_target_metric
from tests.profiling.synthetic import GAMMA_WITHOUT_R, synthetic_measurements


def _curve(first: float, floor: float, updates: int, speed: float = 1.0) -> list[tuple[int, float]]:
    """A hyperbolic fall from `first` towards `floor`, `speed` times as fast per update."""
    return [(j, floor + (first - floor) * 20 / (20 + speed * j)) for j in range(1, updates + 1)]


def test_band_reached_once_every_cluster_has_come_down():
    fast, slow = _curve(10.0, 1.0, 400, speed=4.0), _curve(10.0, 1.0, 400, speed=1.0)
    assert band_reached([fast, slow])
    assert not band_reached([fast, slow[:20]])  # the slow cluster is still near its start
    assert not band_reached([fast, [(1, 10.0), (2, 10.0)] * 50])  # one that never learns
    assert not band_reached([fast, []])


def test_a_wave_stopped_early_is_the_laggard_a_later_wave_leaves_behind():
    """A first wave judged alone stops as soon as its loss moved at all; a later wave that falls far
    leaves it above every band they could share: that one, and only that one, is trained again."""
    stopped_early = _curve(10.0, 1.0, 400)[:3]
    later = _curve(10.0, 1.0, 400, speed=2.0)
    assert band_reached([stopped_early])  # alone, any fall makes a band
    assert not band_reached([stopped_early, later])
    assert laggard([stopped_early, later]) == 0 and laggard([later, stopped_early]) == 1
    assert band_reached([_curve(10.0, 1.0, 400)[:200], later])  # trained again further: a band they share


def _trained_for(clusters, updates: int):
    """The synthetic clusters as if profiling had stopped them after `updates` updates."""
    return [c.model_copy(update={"losses": c.losses[:updates], "updates_total": updates}) for c in clusters]


def test_a_loss_target_keeps_the_clusters_training_past_the_band_until_each_is_near_it():
    """The issue's case: the clusters share a band far above the target; without one they would
    stop there, with it they train on until each has come within TARGET_APPROACH of it."""
    _, clusters = synthetic_measurements()
    at_band = [c.losses for c in _trained_for(clusters, 150)]
    assert band_reached(at_band) and trained_enough(at_band, None)
    assert not trained_enough(at_band, 1.35)  # the slowest cluster is still above 1.5 x 1.35
    assert trained_enough([c.losses for c in clusters], 1.35)


def test_a_target_below_the_fitted_curves_floor_is_refused_with_the_lowest_that_can_be_planned():
    """The synthetic curve levels off at 1.3: a target below it is unreachable however long
    profiling trains, and the refusal names the lowest target the planner takes."""
    types, clusters = synthetic_measurements()
    curve = fit_profile("synthetic", types, clusters).profile.loss
    assert curve.gamma5 == pytest.approx(GAMMA_WITHOUT_R[4], rel=0.01)
    assert lowest_reachable_target(clusters) < curve.gamma5  # the old rule alone would have planned 1.2
    with pytest.raises(ProfilingError, match=r"^loss target 1.2 is unreachable: .* levels off at gamma5 = 1.299; "
                                             r"aim at --loss 1.30\d* or above$"):
        check_target_profiled(clusters, 1.2, curve, budget_s=300.0)
    check_target_profiled(clusters, 1.35, curve, budget_s=300.0)  # below anything seen, above the floor: planned


def test_a_target_the_budget_stopped_short_of_is_refused_with_the_budget_that_would_reach_it():
    types, clusters = synthetic_measurements()
    short = _trained_for(clusters, 100)
    curve = fit_profile("synthetic", types, short).profile.loss
    floor = lowest_reachable_target(short)
    assert curve.gamma5 < floor
    check_target_profiled(short, floor, curve, budget_s=100.0)  # at the floor: planned
    with pytest.raises(ProfilingError, match=r"below what profiling saw within its budget of 100 s .* raise "
                                             r"--profile-budget-s to about \d+ .* or aim at --loss"):
        check_target_profiled(short, floor - 0.005, curve, budget_s=100.0)


def test_the_budget_that_would_reach_a_target_follows_the_slowest_clusters_curve():
    """On clusters that trained long enough for an accurate fit, the budget named for a target
    below what they saw is the true curve's updates to it, over those they made, times the budget."""
    types, clusters = synthetic_measurements()
    curve = fit_profile("synthetic", types, clusters).profile.loss
    true_scale = max(
        float(iterations_to_loss(1.45, *cluster_shape([w.batch for w in c.workers], [w.iteration_time_s for w in c.workers]),
                                 c.n, GAMMA_WITHOUT_R)) / c.losses[-1][0]
        for c in clusters)
    assert true_scale > 1
    assert budget_to_reach(clusters, curve, 1.45, 100.0) == pytest.approx(100.0 * true_scale, rel=0.1)


def _as_accuracy_shortfall(clusters):
    """The synthetic clusters' curves as 1 - accuracy: a tenth of the loss (levels off at 0.13)."""
    return [c.model_copy(update={"losses": [(j, 0.1 * loss) for j, loss in c.losses]}) for c in clusters]


def test_a_target_metric_the_fitted_curve_cannot_reach_is_refused_in_the_metrics_words():
    """Profiled on a metric's curve (1 - val_acc for a higher-is-better one, docs/model.md), the
    refusal names the metric and the best target of it that can be planned."""
    types, clusters = synthetic_measurements()
    loss_curve = fit_profile("synthetic", types, clusters).profile.loss
    val_loss = parse_target_metric("val_loss<=1.2")
    with pytest.raises(ProfilingError, match=r"^target metric val_loss<=1.2 is unreachable: profiling trained toward it "
                                             r"\(best val_loss 1.528\) and the fitted val_loss curve levels off at "
                                             r"gamma5 = 1.299; aim at val_loss<=1.30\d* or above$"):
        check_target_profiled(clusters, val_loss.curve_target, loss_curve, 300.0, val_loss)

    shortfall = _as_accuracy_shortfall(clusters)
    acc_curve = fit_profile("synthetic", types, shortfall).profile.loss
    assert acc_curve.gamma5 == pytest.approx(0.1 * GAMMA_WITHOUT_R[4], rel=0.01)
    val_acc = parse_target_metric("val_acc>=0.9")
    with pytest.raises(ProfilingError, match=r"^target metric val_acc>=0.9 is unreachable: .* \(best val_acc 0.8472\) "
                                             r".* aim at val_acc>=0.86\d* or below$"):
        check_target_profiled(shortfall, val_acc.curve_target, acc_curve, 300.0, val_acc)
    reachable = parse_target_metric("val_acc>=0.86")
    check_target_profiled(shortfall, reachable.curve_target, acc_curve, 300.0, reachable)  # above the floor: planned


def test_a_target_met_where_a_profiled_curve_begins_is_refused_with_the_easiest_target_it_predicts():
    """A target a cluster had already met at its curve's first point (a metric at its first
    evaluation) lies in its warm-up: the fitted curve cannot count the updates to it, and the
    planner would read "no update needed". Refused in the target's own words, with the band's top."""
    types, clusters = synthetic_measurements()
    loss_curve = fit_profile("synthetic", types, clusters).profile.loss
    top, _ = loss_band([c.losses for c in clusters])
    with pytest.raises(ProfilingError, match=rf"^loss target 3.5 was already met where the profiled curve of "
                                             rf"fast=1, slow=1 begins \(smoothed loss 3.182 at update 1\): the fitted "
                                             rf"curve starts after it .*; aim at --loss {top:.4g} or below$"):
        check_target_profiled(clusters, 3.5, loss_curve, budget_s=300.0)
    check_target_profiled(clusters, 3.1, loss_curve, budget_s=300.0)  # below every curve's start: planned

    shortfall = _as_accuracy_shortfall(clusters)
    acc_curve = fit_profile("synthetic", types, shortfall).profile.loss
    val_acc = parse_target_metric("val_acc>=0.6")  # 0.4 on the curve: two clusters began past it
    with pytest.raises(ProfilingError, match=rf"^target metric val_acc>=0.6 was already met where the profiled curve "
                                             rf"of fast=1, slow=1 begins \(val_acc 0.6818 at its first evaluation, "
                                             rf"update 1\): .*; aim at val_acc>={1 - 0.1 * top:.4g} or above$"):
        check_target_profiled(shortfall, val_acc.curve_target, acc_curve, 300.0, val_acc)
    val_loss = parse_target_metric("val_loss<=3.5")
    with pytest.raises(ProfilingError, match=rf"aim at val_loss<={top:.4g} or below$"):
        check_target_profiled(clusters, val_loss.curve_target, loss_curve, 300.0, val_loss)


def test_a_curves_floor_is_estimated_from_its_points_below_the_warm_up_knee():
    assert curve_floor(_curve(10.0, 1.0, 400)) == pytest.approx(1.0, abs=0.05)
    assert curve_floor(_curve(10.0, 0.2, 400, speed=0.5)) == pytest.approx(0.2, abs=0.05)
    assert curve_floor(_curve(10.0, 1.0, 400)[:3]) is None  # too few points to tell
    assert curve_floor([(j, 5.0) for j in range(1, 50)]) is None  # no fall


def test_a_wave_trains_on_while_a_clusters_curve_levels_off_above_the_target():
    """The issue's refusal: the clusters came near the target (within TARGET_APPROACH) but their
    curves level off above it. The wave trains on (within its budget) instead of stopping there;
    a target above the floors stops it as before."""
    curves = [_curve(10.0, 0.5, 2000, speed=1.0), _curve(10.0, 0.5, 2000, speed=1.5)]  # down to about 0.59
    assert trained_enough(curves, 0.45) and floor_blocks(curves, 0.45)  # approached, yet 0.45 < floor 0.5
    assert not wave_done(curves, 0, 0.45)
    assert trained_enough(curves, 0.55) and not floor_blocks(curves, 0.55) and wave_done(curves, 0, 0.55)
    assert wave_done(curves, 0, None) and not floor_blocks(curves, None)  # no target: the band alone, as before
    stopped_early = _curve(10.0, 1.0, 400)[:3]
    assert wave_done([stopped_early, *curves], 1, 0.45)  # an earlier laggard still ends the wave
