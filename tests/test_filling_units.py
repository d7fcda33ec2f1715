"""Unit tests for inference filling: monitor, gate, guard, scheduler, baselines (no threads)."""
from __future__ import annotations

import math
import random

import pytest

from tasks.filling.baselines import OpenAdmission
from tasks.filling.gate import Gate
from tasks.filling.guard import StepTimeGuard
from tasks.filling.monitor import BubbleMonitor
from tasks.filling.scheduler import Chunk, CostModel, OnlineQueue, PoissonArrivals, Scheduler


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(monitor: BubbleMonitor, clock: FakeClock, compute_s: float, bubbles_s: list[float],
              first: int = 0) -> None:
    for i, bubble_s in enumerate(bubbles_s, start=first):
        monitor.compute_start(i)
        clock.now += compute_s
        monitor.compute_end(i)
        monitor.comm_start(i)
        clock.now += bubble_s
        monitor.comm_end(i)


def calibrated_guard(budget: float = 1.0) -> StepTimeGuard:
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=1)
    guard.observe_compute_s(1.0)
    guard.budget = budget
    return guard


# -- monitor -------------------------------------------------------------------------------------
def test_monitor_estimates_each_slot_from_its_own_bubbles():
    clock = FakeClock()
    monitor = BubbleMonitor(slots=2, quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.10, 0.30] * 5)
    assert monitor.slots[0].predicted_s() == pytest.approx(0.10)
    assert monitor.slots[1].predicted_s() == pytest.approx(0.30)
    assert monitor.bubble_count == 10
    assert monitor.bubble_total_s == pytest.approx(2.0)
    assert list(monitor.compute_times_s) == pytest.approx([0.05] * 10)


def test_monitor_predicted_remaining_shrinks_and_is_zero_when_closed():
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    assert monitor.predicted_remaining_s() == 0.0
    run_steps(monitor, clock, 0.05, [0.2] * 3)
    monitor.compute_start(3)
    assert monitor.predicted_remaining_s() == 0.0  # training computes: no bubble
    monitor.compute_end(3)
    monitor.comm_start(3)
    assert monitor.predicted_remaining_s() == pytest.approx(0.2)
    clock.now += 0.15
    assert monitor.predicted_remaining_s() == pytest.approx(0.05)
    clock.now += 0.1
    assert monitor.predicted_remaining_s() == 0.0  # overran its prediction


def test_monitor_low_quantile_is_conservative_against_a_noisy_slot():
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.2, clock=clock)
    run_steps(monitor, clock, 0.01, [0.1, 0.2, 0.3, 0.4, 0.5] * 4)
    assert monitor.slots[0].predicted_s() < monitor.slots[0].ewma_s
    assert monitor.slots[0].predicted_s() <= 0.2


def test_monitor_overlap_counts_only_time_inside_bubbles():
    clock = FakeClock()
    monitor = BubbleMonitor(clock=clock)
    run_steps(monitor, clock, 1.0, [1.0, 1.0])  # bubbles [1, 2] and [3, 4]
    assert monitor.overlap_s(0.0, 1.0) == 0.0
    assert monitor.overlap_s(0.5, 1.5) == pytest.approx(0.5)
    assert monitor.overlap_s(1.5, 3.5) == pytest.approx(1.0)
    monitor.compute_start(2)
    clock.now += 1.0
    monitor.compute_end(2)
    monitor.comm_start(2)  # open bubble from 5.0
    clock.now += 0.25
    assert monitor.overlap_s(4.5, 5.25) == pytest.approx(0.25)


def test_compute_start_closes_a_bubble_whose_comm_end_never_came():
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    open_bubble(monitor, clock, 3)
    clock.now += 5.0  # lost the PS, rejoined, never called comm_end
    monitor.compute_start(4)
    assert not monitor.is_open()
    assert monitor.slots[0].predicted_s() == pytest.approx(0.1)  # kept out of the estimate
    assert monitor.bubble_count == 4


def test_monitor_reports_compute_times_to_listeners():
    clock = FakeClock()
    monitor = BubbleMonitor(clock=clock)
    seen = []
    monitor.on_compute_time(seen.append)
    run_steps(monitor, clock, 0.07, [0.1, 0.1])
    assert seen == pytest.approx([0.07, 0.07])


# -- gate ----------------------------------------------------------------------------------------
def open_bubble(monitor: BubbleMonitor, clock: FakeClock, step: int) -> None:
    monitor.compute_start(step)
    clock.now += 0.05
    monitor.compute_end(step)
    monitor.comm_start(step)


def test_gate_admits_only_what_fits_the_predicted_remainder_with_margin():
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    gate = Gate(monitor, calibrated_guard(), max_in_flight=4, margin=0.25)
    assert gate.start(lambda a: "never") is None  # closed: training computes
    open_bubble(monitor, clock, 3)
    seen = []
    assert gate.start(lambda a: seen.append(a) or "chunk") == "chunk"
    assert seen == [pytest.approx(0.1 / 1.25)]
    clock.now += 0.06
    assert gate.allowance_s() == pytest.approx(0.04 / 1.25)
    monitor.comm_end(3)
    assert gate.start(lambda a: "late") is None  # training resumed: nothing new starts


def test_gate_scales_the_allowance_by_the_guard_budget():
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    gate = Gate(monitor, calibrated_guard(budget=0.5), max_in_flight=1, margin=0.0)
    open_bubble(monitor, clock, 3)
    assert gate.allowance_s() == pytest.approx(0.05)


def test_gate_waits_for_the_guard_baseline():
    clock = FakeClock()
    monitor = BubbleMonitor(clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    gate = Gate(monitor, StepTimeGuard(0.05, calibration_steps=10), max_in_flight=1, margin=0.0)
    open_bubble(monitor, clock, 3)
    assert gate.start(lambda a: "chunk") is None


def test_gate_never_admits_outside_a_bubble_or_beyond_k_in_a_random_schedule():
    rng = random.Random(7)
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    k = 2
    gate = Gate(monitor, calibrated_guard(), max_in_flight=k, margin=0.1)
    in_flight, admitted, step = 0, 0, 3
    phase = "compute"
    for _ in range(2000):
        action = rng.choice(["edge", "start", "start", "finish", "tick"])
        if action == "edge":
            clock.now += rng.uniform(0.0, 0.02)
            if phase == "compute":
                open_bubble(monitor, clock, step)
                phase = "comm"
            else:
                monitor.comm_end(step)
                step += 1
                phase = "compute"
        elif action == "start":
            cost = rng.uniform(0.0, 0.01)
            chunk = gate.start(lambda a: cost if cost <= a else None)
            if chunk is not None:
                admitted += 1
                in_flight += 1
                assert phase == "comm" and monitor.is_open()
                assert in_flight <= k
                assert cost * 1.1 <= monitor.predicted_remaining_s() + 1e-12
        elif action == "finish" and in_flight:
            gate.finish(0.01)
            in_flight -= 1
        elif action == "tick":
            clock.now += rng.uniform(0, 0.02)
    assert admitted > 50  # the schedule did exercise admission


def test_gate_waits_for_the_next_bubble_after_nothing_fitted():
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    gate = Gate(monitor, calibrated_guard(), max_in_flight=1, margin=0.0)
    open_bubble(monitor, clock, 3)
    assert gate.start(lambda a: None) is None
    assert not gate._worth_trying()  # same bubble: do not spin
    monitor.comm_end(3)
    open_bubble(monitor, clock, 4)
    assert gate._worth_trying()


def test_open_admission_ignores_bubbles_but_keeps_k():
    admission = OpenAdmission(max_in_flight=1)
    assert admission.start(lambda a: a) == math.inf
    assert admission.start(lambda a: a) is None
    admission.finish(0.1)
    assert admission.start(lambda a: "again") == "again"


# -- guard ---------------------------------------------------------------------------------------
def test_guard_learns_baseline_then_shrinks_multiplicatively_and_grows_additively():
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=3, window=1, decrease=0.5,
                          increase=0.1, floor=0.1)
    for s in (0.10, 0.12, 0.11):
        guard.observe_compute_s(s)
    assert guard.baseline_s == pytest.approx(0.11)
    assert guard.budget == 1.0
    guard.observe_compute_s(0.2)
    assert guard.budget == pytest.approx(0.5)
    guard.observe_compute_s(0.2)
    assert guard.budget == pytest.approx(0.25)
    for _ in range(5):
        guard.observe_compute_s(0.2)
    assert guard.budget == pytest.approx(0.1)  # floor
    guard.observe_compute_s(0.11)
    assert guard.budget == pytest.approx(0.2)
    for _ in range(20):
        guard.observe_compute_s(0.115)  # within tolerance
    assert guard.budget == 1.0
    assert guard.shrinks == 7


def test_guard_takes_a_fresh_baseline_periodically_and_shuts_the_gate_meanwhile():
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=2, rebaseline_every=4, window=1)
    assert guard.calibrating
    for s in (1.0, 1.0):
        guard.observe_compute_s(s)
    assert not guard.calibrating and guard.baseline_s == 1.0
    for s in (1.0, 1.0, 1.0, 1.0):
        guard.observe_compute_s(s)
    assert guard.calibrating  # 4 steps since the baseline: measure solo again
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    open_bubble(monitor, clock, 3)
    assert Gate(monitor, guard, max_in_flight=1, margin=0.0).start(lambda a: "chunk") is None
    for s in (2.0, 2.0):  # the machine got slower for reasons of its own
        guard.observe_compute_s(s)
    assert guard.baseline_s == 2.0
    guard.observe_compute_s(2.0)
    assert guard.shrinks == 0 and guard.budget == 1.0  # not blamed on inference


def test_guard_judges_the_median_of_its_window():
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=1, window=3)
    for s in (1.0, 1.0, 1.0, 5.0):  # one outlier among normal steps
        guard.observe_compute_s(s)
    assert guard.shrinks == 0


# -- scheduler -----------------------------------------------------------------------------------
def costs_linear(max_batch: int = 8, per_sample_s: float = 0.01) -> CostModel:
    costs = CostModel(max_batch)
    for size in costs.batch_sizes:
        costs.update(size, per_sample_s * size)
    return costs


def test_cost_model_sizes_and_largest_fitting_batch():
    costs = costs_linear(max_batch=12)
    assert costs.batch_sizes == [1, 2, 4, 8, 12]
    assert costs.largest_fitting(0.005, 12) == 0
    assert costs.largest_fitting(0.05, 12) == 4
    assert costs.largest_fitting(1.0, 12) == 12
    assert costs.largest_fitting(1.0, 3) == 3
    assert costs.predict_s(3) == pytest.approx(0.04)  # charged as the next size up
    assert CostModel(4).largest_fitting(1.0, 4) == 0  # nothing measured: nothing fits


def test_cost_model_tracks_measurements_with_ewma():
    costs = CostModel(1, weight=0.5)
    costs.update(1, 1.0)
    costs.update(1, 3.0)
    assert costs.predict_s(1) == pytest.approx(2.0)


def test_scheduler_serves_online_before_offline_and_records_latency():
    queue = OnlineQueue(capacity=10, slo_s=1.0)
    sched = Scheduler(queue, None, costs_linear(), dataset_size=100)
    queue.offer(0.0)
    queue.offer(0.1)
    chunk = sched.pick(1.0, now_s=0.2)
    assert chunk.kind == "online" and chunk.batch == 2 and chunk.arrivals_s == [0.0, 0.1]
    sched.complete(chunk, end_s=0.3, busy_s=0.02)
    assert [lat for _, lat in sched.latencies] == pytest.approx([0.3, 0.2])
    chunk = sched.pick(0.05, now_s=0.4)
    assert chunk.kind == "offline" and chunk.batch == 4
    sched.complete(chunk, end_s=0.5, busy_s=0.04)
    assert sched.offline_samples == 4 and sched.online_served == 2


def test_scheduler_does_not_let_offline_jump_a_waiting_request():
    queue = OnlineQueue(capacity=10, slo_s=1.0)
    sched = Scheduler(queue, None, costs_linear(), dataset_size=100)
    queue.offer(0.0)
    assert sched.pick(0.001, now_s=0.0) is None
    assert len(queue) == 1


def test_offline_cursor_wraps_over_the_dataset():
    sched = Scheduler(OnlineQueue(1, 1.0), None, costs_linear(), dataset_size=10)
    starts = [sched.pick(1.0, now_s=0.0).offline_start for _ in range(3)]
    assert starts == [0, 8, 6]


def test_queue_sheds_overflow_and_expired_requests():
    queue = OnlineQueue(capacity=2, slo_s=0.5)
    assert queue.offer(0.0) and queue.offer(0.4)
    assert not queue.offer(0.45)
    assert queue.shed_overflow == 1
    queue.drop_expired(now_s=0.6)
    assert queue.shed_expired == 1 and len(queue) == 1
    assert queue.take(5) == [0.4]


def test_scheduler_sheds_overflowing_arrivals_it_cannot_serve():
    queue = OnlineQueue(capacity=3, slo_s=10.0)
    arrivals = PoissonArrivals(rate_per_s=100.0, seed=1)
    arrivals.begin(0.0)
    sched = Scheduler(queue, arrivals, costs_linear(), dataset_size=10)
    assert sched.pick(0.0, now_s=1.0) is None  # nothing fits: the queue fills and overflows
    assert len(queue) == 3
    assert queue.offered > 50 and queue.shed_overflow == queue.offered - 3


def test_poisson_arrivals_are_seeded_and_near_their_rate():
    a, b = PoissonArrivals(50.0, seed=3), PoissonArrivals(50.0, seed=3)
    a.begin(0.0)
    b.begin(0.0)
    times = a.due(20.0)
    assert times == b.due(20.0)
    assert 900 < len(times) < 1100
    assert times == sorted(times)
    assert PoissonArrivals(50.0).due(100.0) == []  # nothing before begin()


def test_chunk_defaults():
    chunk = Chunk("offline", 4, 0.1)
    assert chunk.arrivals_s == [] and chunk.offline_start == 0
