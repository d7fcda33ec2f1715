"""Profiling that adapts to the model: the clusters' common loss band, and the loss target checked
against what profiling saw (tasks/profiling/clusters.py)."""
import pytest

from tasks.profiling.clusters import band_reached, check_target_profiled, laggard, lowest_reachable_target
from tasks.profiling.measurements import ClusterMeasurement, ProfilingError


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


def _cluster(losses) -> ClusterMeasurement:
    return ClusterMeasurement(cluster={"t": 1}, workers=[], ps_bandwidth_mbps=10.0, updates_total=len(losses),
                              duration_s=10.0, ps_throughput_mbps=1.0, losses=losses, wall_s=10.0)


def test_a_target_far_below_what_profiling_saw_is_refused_naming_the_flag():
    clusters = [_cluster(_curve(10.0, 1.0, 100, speed=2.0)), _cluster(_curve(10.0, 1.0, 100))]
    lowest = min(loss for c in clusters for _, loss in c.losses)
    first = (clusters[0].losses[0][1] + clusters[1].losses[0][1]) / 2
    floor = lowest_reachable_target(clusters)
    assert floor == pytest.approx(lowest - 0.25 * (first - lowest))
    check_target_profiled(clusters, floor)  # at the floor: planned
    with pytest.raises(ProfilingError, match="raise --profile-budget-s .* or aim at --loss"):
        check_target_profiled(clusters, floor - 0.01)
