"""Unit tests for inference filling: monitor, gate, guard, scheduler, baselines (no threads)."""
from __future__ import annotations

import math
import os
import random
import threading
import time

import pytest

from tasks.filling.baselines import OpenAdmission
from tasks.filling.executor import CpuExecutor
from tasks.filling.filler import Filler
from tasks.filling.gate import RESERVE_SAVED_S, Gate
from tasks.filling.guard import StepTimeGuard, reaction_steps
from tasks.filling.models import build_workload
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


def test_monitor_predicts_the_wait_for_the_next_bubble_from_the_median_compute_phase():
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, window=3, clock=clock)
    assert monitor.predicted_wait_s() == 0.0  # nothing seen yet: no reason to serve outside bubbles
    for compute_s in (0.04, 0.9, 0.05, 0.06):  # the last 3: one long phase does not move a median
        monitor.compute_start(0)
        clock.now += compute_s
        monitor.compute_end(0)
        monitor.comm_start(0)
        clock.now += 0.1
        monitor.comm_end(0)
    assert monitor.compute_estimate_s == pytest.approx(0.06)
    assert monitor.predicted_wait_s() == pytest.approx(0.06)  # between steps: a whole phase
    monitor.compute_start(1)
    clock.now += 0.02
    assert monitor.predicted_wait_s() == pytest.approx(0.04)
    clock.now += 0.1  # a phase longer than predicted: the bubble is due
    assert monitor.predicted_wait_s() == 0.0
    monitor.compute_end(1)
    monitor.comm_start(1)
    clock.now += 0.03  # 0.07 of the predicted 0.1 s bubble left, then a compute phase
    assert monitor.predicted_wait_s() == pytest.approx(0.07 + monitor.compute_estimate_s)


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
    assert gate.start("offline", lambda a: "never") is None  # closed: training computes
    open_bubble(monitor, clock, 3)
    seen = []
    assert gate.start("offline", lambda a: seen.append(a) or "chunk") == "chunk"
    assert seen == [pytest.approx(0.1 / 1.25)]
    clock.now += 0.06
    assert gate.allowance_s() == pytest.approx(0.04 / 1.25)
    monitor.comm_end(3)
    assert gate.start("offline", lambda a: "late") is None  # training resumed: nothing new starts


def test_an_online_request_fits_the_bubble_without_the_relative_margin():
    """A request turned away at a bubble's end waits a whole compute phase; its cost is already
    scaled by its lane's overrun factor, so the margin applies to offline chunks only."""
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    gate = Gate(monitor, calibrated_guard(budget=0.5), max_in_flight=1, margin=0.25, margin_s=0.002)
    open_bubble(monitor, clock, 3)
    clock.now += 0.09  # 10 ms of the bubble left
    assert gate.allowance_s() == pytest.approx((0.5 * 0.01 - 0.002) / 1.25)
    assert gate.online_allowance_s() == pytest.approx(0.01 - 0.002)
    assert gate.start("offline", fits(0.007)) is None
    assert gate.start("online", fits(0.007)) == 0.007


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
    assert gate.start("offline", lambda a: "chunk") is None


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
            chunk = gate.start("offline", lambda a: cost if cost <= a else None)
            if chunk is not None:
                admitted += 1
                in_flight += 1
                assert phase == "comm" and monitor.is_open()
                assert in_flight <= k
                assert cost * 1.1 <= monitor.predicted_remaining_s() + 1e-12
        elif action == "finish" and in_flight:
            gate.finish("offline", 0.0, 0.01)
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
    assert gate.start("offline", lambda a: None) is None
    assert not gate._worth_trying()  # same bubble: do not spin
    monitor.comm_end(3)
    open_bubble(monitor, clock, 4)
    assert gate._worth_trying()


def test_online_lane_runs_next_to_a_full_offline_lane_inside_a_bubble():
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    gate = Gate(monitor, calibrated_guard(), max_in_flight=1, margin=0.0, online_reserve=0.0)
    open_bubble(monitor, clock, 3)
    assert gate.start("offline", lambda a: "offline") == "offline"
    assert gate.start("offline", lambda a: "second") is None  # K = 1 offline chunk in flight
    seen = []
    assert gate.start("online", lambda a: seen.append(a) or "online") == "online"
    assert seen == [pytest.approx(0.1)]  # the request does not wait for the offline chunk
    monitor.comm_end(3)
    assert gate.start("online", lambda a: "late") is None  # no reserve: nothing outside bubbles


def fits(cost_s: float):
    """A scheduler's pick for one chunk of this cost: taken only if the allowance covers it."""
    return lambda allowance_s: cost_s if cost_s <= allowance_s else None


def reserve_gate(budget: float = 1.0):
    """A gate with a 2% online reserve and a 20 ms wait bound after three steps of 0.05 s compute
    and 0.1 s bubbles."""
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    guard = calibrated_guard(budget=budget)
    return clock, monitor, guard, Gate(monitor, guard, max_in_flight=1, margin=0.0, online_reserve=0.02,
                                       online_max_wait_s=0.02)


def test_online_reserve_admits_outside_bubbles_only_what_it_has_saved():
    clock, monitor, _guard, gate = reserve_gate()
    clock.now += 0.5
    monitor.compute_start(3)  # training computes: the next bubble is 0.05 s away, over the bound

    assert gate.online_allowance_s() == pytest.approx(0.01)  # 0.02 s per s for 0.5 s
    assert gate.start("online", fits(0.011)) is None  # never more than the reserve holds
    t0 = clock.now
    assert gate.start("online", fits(0.008)) == 0.008
    clock.now += 0.008
    gate.finish("online", t0, clock.now)  # ran outside a bubble: charged to the reserve
    assert gate.reserve_s == pytest.approx(0.002)
    assert gate.start("online", fits(0.008)) is None
    clock.now += 10.0
    gate.online_allowance_s()
    assert gate.reserve_s == pytest.approx(0.02 * RESERVE_SAVED_S)  # saved up, capped


def test_a_request_waits_for_a_bubble_predicted_within_the_bound_and_is_served_at_once_otherwise():
    clock, monitor, _guard, gate = reserve_gate()
    clock.now += 1.0  # the reserve is full
    monitor.compute_start(3)
    assert monitor.predicted_wait_s() == pytest.approx(0.05)
    assert gate.start("online", fits(0.001)) == 0.001  # 50 ms to the bubble: served now
    clock.now += 0.035
    assert gate.start("online", fits(0.001)) is None  # 15 ms to the bubble: it waits
    clock.now += 0.015
    monitor.compute_end(3)
    assert monitor.predicted_wait_s() == 0.0  # the bubble opens next
    monitor.comm_start(3)
    assert gate.start("online", fits(0.001)) == 0.001  # inside the bubble
    clock.now += 0.0995  # 0.5 ms of the predicted 100 ms bubble left: the next is 50.5 ms away
    assert monitor.predicted_wait_s() == pytest.approx(0.0505)
    assert gate.start("online", fits(0.001)) == 0.001  # from the reserve, not the bubble
    lenient = Gate(monitor, gate.guard, max_in_flight=1, margin=0.0, online_reserve=0.02,
                   online_max_wait_s=0.06)
    clock.now += 1.0
    monitor.comm_end(3)
    monitor.compute_start(4)
    assert lenient.start("online", fits(0.001)) is None  # within its bound: wait for the bubble


def test_the_wait_bound_counts_what_a_request_has_waited_not_only_what_is_predicted():
    """A compute phase that overruns its prediction must not stretch a request's wait past the
    bound: the oldest queued request's wait so far counts against it."""
    clock, monitor, guard, _gate = reserve_gate()
    waited = {"s": 0.0}
    gate = Gate(monitor, guard, max_in_flight=1, margin=0.0, online_reserve=0.02,
                online_max_wait_s=0.02, waited_s=lambda now: waited["s"])
    clock.now += 1.0  # the reserve is full
    monitor.compute_start(3)
    clock.now += 0.04  # 10 ms of the predicted 50 ms compute phase left
    assert gate.start("online", fits(0.001)) is None  # a fresh request waits for the bubble
    waited["s"] = 0.012  # one that has waited 12 ms would wait 22 ms in all: served now
    assert gate.start("online", fits(0.001)) == 0.001
    clock.now += 0.03  # the phase overran: predicted wait 0, yet the request has waited 30 ms
    waited["s"] = 0.03
    assert monitor.predicted_wait_s() == 0.0
    assert gate.start("online", fits(0.001)) == 0.001


def test_a_waiting_online_lane_looks_again_within_the_bound_only_while_a_request_waits():
    """With a request queued the lane re-checks every quarter of the bound (its wait may reach
    the bound before any bubble edge); with none it sleeps the whole timeout, not busy-polling."""
    import time as _time

    monitor = BubbleMonitor(quantile=0.5)
    waited = {"s": 0.001}
    gate = Gate(monitor, calibrated_guard(), max_in_flight=1, margin=0.0, online_reserve=0.02,
                online_max_wait_s=0.004, waited_s=lambda now: waited["s"])
    t0 = _time.monotonic()
    gate.wait("online", 30.0)
    assert _time.monotonic() - t0 < 20.0  # woke for the queued request, long before the timeout
    waited["s"] = 0.0
    t0 = _time.monotonic()
    gate.wait("online", 0.3)
    assert _time.monotonic() - t0 >= 0.29  # nothing queued: no early wake-ups


def test_the_online_lane_sleeps_through_a_compute_phase_unless_a_request_would_pass_its_bound():
    """A lane woken during training's compute takes the GIL and a core from it: the online lane
    sleeps until the bubble opens (which wakes it), except for a request that arrives inside
    the open bubble or whose wait would pass the bound (20 ms here; compute 50 ms, bubble 100 ms)."""
    clock, monitor, guard, _gate = reserve_gate()
    waited = {"s": 0.0}
    gate = Gate(monitor, guard, max_in_flight=1, margin=0.0, online_reserve=0.02,
                online_max_wait_s=0.02, waited_s=lambda now: waited["s"])
    clock.now += 1.0
    monitor.comm_start(3)  # a bubble is open, 100 ms predicted
    assert gate._online_sleep_s(0.03) == pytest.approx(0.03)  # the next request arrives inside it
    clock.now += 0.09  # 10 ms of the bubble left; the next request arrives 15 ms from now
    # it will find the next bubble 10 + 50 - 15 = 45 ms away, past the bound: look at its arrival
    assert gate._online_sleep_s(0.015) == pytest.approx(0.015)
    clock.now += 0.01
    monitor.comm_end(3)
    monitor.compute_start(4)
    clock.now += 0.04  # 10 ms of compute left; a request arriving in 5 ms waits 5 ms: within the bound
    assert gate._online_sleep_s(0.005) == pytest.approx(0.005 + 0.02)  # only an overrun could pass it
    waited["s"] = 0.012  # one queued 12 ms ago: 22 ms in all at the predicted opening, past the bound
    assert gate._online_sleep_s(0.5) == pytest.approx(0.02 / 4)  # it was not served: look again soon
    waited["s"] = 0.004  # one queued 4 ms ago: 14 ms in all, so it waits for the bubble
    assert gate._online_sleep_s(0.5) == pytest.approx(0.016)  # or until the bound, if compute overruns


def test_an_online_lane_that_looked_before_a_bubble_opened_does_not_sleep_through_it():
    """The lane looks (closed: nothing starts), the bubble opens and notifies before the lane is
    waiting: its wait returns at once instead of sleeping until the next edge or its bound."""
    import time as _time

    clock, monitor, guard, _gate = reserve_gate()
    gate = Gate(monitor, guard, max_in_flight=1, margin=0.0, online_reserve=0.02,
                online_max_wait_s=25.0, waited_s=lambda now: 0.001)  # a bound it would sleep to
    monitor.compute_start(3)
    assert gate.start("online", fits(0.001)) is None  # compute: the request waits
    monitor.compute_end(3)
    monitor.comm_start(3)  # opens and notifies, with no lane waiting yet
    t0 = _time.monotonic()
    gate.wait("online", 30.0)
    assert _time.monotonic() - t0 < 20.0  # it looks again now
    assert gate.start("online", fits(0.001)) == 0.001


def test_closing_a_bubble_wakes_no_lane_and_opening_one_does():
    """Nothing may start in a closed bubble, so its close notifies no one (a woken lane would land
    in training's compute phase); its opening and a chunk's end inside it do."""
    monitor = BubbleMonitor()
    woken = []

    def waiter():
        with monitor.changed:
            woken.append(monitor.changed.wait(30.0))

    def waiting_threads(n: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=waiter) for _ in range(n)]
        for t in threads:
            t.start()
        while len(monitor.changed._waiters) < n:  # both are waiting on the condition
            time.sleep(0.001)
        return threads

    threads = waiting_threads(1)
    monitor.comm_start(0)  # opens: notifies
    threads[0].join(10)
    assert woken == [True]
    threads = waiting_threads(1)
    monitor.comm_end(0)  # closes: no notify
    gate = Gate(monitor, calibrated_guard(), max_in_flight=1, margin=0.0)
    gate.in_flight = 1
    gate.finish("offline", 0.0, 0.001)  # a chunk ending after the close: no notify either
    assert len(monitor.changed._waiters) == 1 and woken == [True]
    monitor.comm_start(1)
    threads[0].join(10)
    assert woken == [True, True]


def test_the_scheduler_says_how_long_its_oldest_request_has_waited():
    queue = OnlineQueue(capacity=4, slo_s=1.0)
    scheduler = Scheduler(queue, None, CostModel(8), dataset_size=16)
    assert scheduler.oldest_wait_s(5.0) == 0.0
    queue.offer(4.0)
    queue.offer(4.5)
    assert scheduler.oldest_wait_s(5.0) == pytest.approx(1.0)
    queue.take(1)
    assert scheduler.oldest_wait_s(5.0) == pytest.approx(0.5)


def test_online_reserve_is_charged_only_for_time_outside_bubbles_and_follows_the_guard():
    clock, monitor, guard, gate = reserve_gate(budget=0.5)
    clock.now += 1.0
    assert gate.online_allowance_s() == pytest.approx(0.01)  # budget 0.5 halves the refill
    open_bubble(monitor, clock, 3)
    t0 = clock.now
    clock.now += 0.08  # inside the bubble, then 0.004 s past its end
    monitor.comm_end(3)
    clock.now += 0.004
    gate.finish("online", t0, clock.now)
    assert gate.reserve_s == pytest.approx(0.01 - 0.004, abs=1e-3)
    guard.calibrating = True  # re-measuring solo: offline waits, online is still served
    open_bubble(monitor, clock, 4)
    assert gate.online_allowance_s() == pytest.approx(0.1)  # the bubble is not scaled by 0.5
    assert gate.start("offline", lambda a: "offline") is None
    assert gate.start("online", lambda a: "online") == "online"


def test_while_the_guard_calibrates_the_reserve_waits_so_that_clean_phases_come():
    clock, monitor, guard, gate = reserve_gate()
    clock.now += 0.5
    monitor.compute_start(3)
    guard.calibrating = True
    assert gate.online_allowance_s() == 0.0  # training computes: the saved reserve is not spent
    assert gate.start("online", fits(0.001)) is None
    guard.calibrating = False
    assert gate.online_allowance_s() == pytest.approx(0.01)  # it kept refilling meanwhile


def test_a_shrunk_budget_slows_the_reserve_refill_but_keeps_its_capacity():
    clock, monitor, guard, gate = reserve_gate(budget=0.05)
    clock.now += 1.0
    monitor.compute_start(3)
    assert gate.online_allowance_s() == pytest.approx(0.001)  # refills at 0.02 * 0.05 per s
    assert gate.start("online", fits(0.005)) is None  # a 5 ms request must wait for its tokens ...
    monitor.compute_end(3)
    clock.now += 4.0
    monitor.compute_start(4)
    assert gate.online_allowance_s() == pytest.approx(0.005)
    assert gate.start("online", fits(0.005)) == 0.005  # ... but is not shut out for good
    clock.now += 100.0
    gate.online_allowance_s()
    assert gate.reserve_s == pytest.approx(0.02 * RESERVE_SAVED_S)  # same cap as budget 1


def test_open_admission_ignores_bubbles_but_keeps_k():
    admission = OpenAdmission(max_in_flight=1)
    assert admission.start("any", lambda a: a) == math.inf
    assert admission.start("any", lambda a: a) is None
    assert admission.start("online", lambda a: "own lane") == "own lane"  # naive_split
    admission.finish("any", 0.0, 0.1)
    assert admission.start("any", lambda a: "again") == "again"


class SleepyExecutor:
    """Offline chunks take `offline_s` of wall time, online ones none."""

    def __init__(self, offline_s: float):
        self.offline_s = offline_s

    def lane_setup(self, lane: str) -> None:
        pass

    def run(self, chunk: Chunk) -> None:
        if chunk.kind == "offline":
            time.sleep(self.offline_s)


class OneRequestAt:
    """An arrival process with one request, `after_s` after begin()."""

    def __init__(self, after_s: float):
        self.at_s = after_s

    def begin(self, start_s: float) -> None:
        self.at_s += start_s

    def next_s(self) -> float:
        return self.at_s

    def due(self, now_s: float) -> list[float]:
        if now_s < self.at_s:
            return []
        arrival_s, self.at_s = self.at_s, math.inf
        return [arrival_s]


@pytest.mark.parametrize("policy", ["gated", "naive"])
def test_a_request_overtakes_a_running_offline_chunk_only_with_its_own_lane(policy):
    """Ordering, not speed: the request arrives while a long offline chunk runs; the gated filler's
    online lane starts it before that chunk ends, the naive shared lane only after."""
    monitor = BubbleMonitor()
    monitor.slots[0].add(60.0)  # one long bubble, open throughout
    guard = calibrated_guard()
    sched = Scheduler(OnlineQueue(4, slo_s=60.0), OneRequestAt(0.3), costs_linear(), 100)
    if policy == "gated":
        admission, lanes = Gate(monitor, guard, max_in_flight=1, margin=0.0), ["online", "offline"]
    else:
        admission, lanes = OpenAdmission(max_in_flight=1), ["any"]
    filler = Filler(monitor, guard, admission, sched, SleepyExecutor(offline_s=1.5), lanes)
    monitor.comm_start(0)
    filler.start()
    try:
        deadline = time.perf_counter() + 30
        while sched.online_served == 0 and time.perf_counter() < deadline:
            time.sleep(0.02)
    finally:
        filler.close()
    log = list(filler.chunk_log)
    online_start = next(c.start_s for c in log if c.kind == "online")
    first_offline_end = min(c.end_s for c in log if c.kind == "offline")
    assert (online_start < first_offline_end) == (policy == "gated")


# -- guard ---------------------------------------------------------------------------------------
def test_guard_learns_baseline_then_shrinks_multiplicatively_and_grows_additively():
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=3, decrease=0.5,
                          increase=0.1, floor=0.1)
    for s in (0.10, 0.12, 0.11):
        guard.observe_compute_s(s)
    assert guard.baseline_s == pytest.approx(0.11)
    assert guard.budget == 1.0
    guard.observe_compute_s(0.2, clean=False)  # a chunk ran into this compute phase
    assert guard.budget == pytest.approx(0.5)
    guard.observe_compute_s(0.2, clean=False)
    assert guard.budget == pytest.approx(0.25)
    for _ in range(5):
        guard.observe_compute_s(0.2, clean=False)
    assert guard.budget == pytest.approx(0.1)  # floor
    guard.observe_compute_s(0.11)
    assert guard.budget == pytest.approx(0.2)
    for _ in range(20):
        guard.observe_compute_s(0.115)  # within tolerance
    assert guard.budget == 1.0
    assert guard.shrinks == 7


def test_guard_takes_a_fresh_baseline_periodically_and_shuts_the_gate_meanwhile():
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=2, rebaseline_every=4)
    assert guard.calibrating
    for s in (1.0, 1.0):
        guard.observe_compute_s(s)
    assert not guard.calibrating and guard.baseline_s == 1.0
    for s in (1.0, 1.0, 1.0, 1.0):
        guard.observe_compute_s(s, clean=False)
    assert guard.calibrating  # 4 steps, none of them clean: measure solo again
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    open_bubble(monitor, clock, 3)
    assert Gate(monitor, guard, max_in_flight=1, margin=0.0).start("offline", lambda a: "chunk") is None
    for s in (2.0, 2.0):  # the machine got slower for reasons of its own
        guard.observe_compute_s(s)
    assert guard.baseline_s == 2.0
    guard.observe_compute_s(2.0)
    assert guard.shrinks == 0 and guard.budget == 1.0  # not blamed on inference


def test_guard_baseline_follows_clean_phases_and_judges_only_the_touched_ones():
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=2, rebaseline_every=4)
    for s in (1.0, 1.0):
        guard.observe_compute_s(s)
    for s in (2.0, 2.0, 2.0, 2.0, 2.0):  # the machine got slower; no chunk touched these phases
        guard.observe_compute_s(s)
    assert guard.baseline_s == 2.0 and guard.shrinks == 0 and guard.budget == 1.0
    assert not guard.calibrating  # clean phases kept the baseline fresh: no need to stop offline work
    guard.observe_compute_s(2.05, clean=False)  # a chunk ran into it, within tolerance
    assert guard.shrinks == 0
    guard.observe_compute_s(2.5, clean=False)  # a chunk ran into it and slowed it
    assert guard.shrinks == 1 and guard.budget == pytest.approx(0.5)


def test_guard_baseline_leaves_out_compute_phases_that_inference_touched():
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=2)
    guard.observe_compute_s(1.0)
    guard.observe_compute_s(1.5, clean=False)  # an online chunk ran during it
    assert guard.calibrating
    guard.observe_compute_s(1.0)
    assert not guard.calibrating and guard.baseline_s == 1.0


def test_filler_marks_a_compute_phase_clean_only_if_no_chunk_ran_in_it():
    clock = FakeClock()
    monitor = BubbleMonitor(clock=clock)
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=1)
    seen = []
    guard.observe_compute_s = lambda compute_s, clean: seen.append(clean)
    filler = Filler(monitor, guard, OpenAdmission(1), Scheduler(OnlineQueue(1, 1.0), None,
                                                                costs_linear(), 10), None, [])
    filler.compute_start(0)
    filler.compute_end(0)
    filler.compute_start(1)
    filler._busy_begin()  # a chunk starts during the compute phase
    filler._busy_end()
    filler.compute_end(1)
    filler._busy_begin()  # one still running when the next compute phase starts
    filler.compute_start(2)
    filler.compute_end(2)
    filler._busy_end()
    assert seen == [True, False, False]


def test_guard_leaves_an_untouched_slow_phase_alone():
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=1)
    for s in (1.0, 1.0, 1.0, 5.0):  # the machine's own hiccup: no chunk touched it
        guard.observe_compute_s(s)
    assert guard.shrinks == 0 and not any(step.stretched for step in guard.history)


@pytest.mark.parametrize("seed", range(5))
def test_a_stretched_step_among_untouched_ones_cuts_the_budget_at_once(seed):
    """A synthetic trace: clean phases with noise, inference touching some phases without harm,
    and now and then one touched phase stretched by half. Each stretched phase cuts the budget
    before the next bubble (0 phases later), however few they are among the others, and the
    budget then grows back step by step, not at once."""
    rng = random.Random(seed)
    guard = StepTimeGuard(tolerance=0.05, calibration_steps=3, rebaseline_every=30)
    for _ in range(3):
        guard.observe_compute_s(0.010)
    stretched_at = set(rng.sample(range(10, 200), 6))
    for i in range(200):
        if i in stretched_at:
            guard.observe_compute_s(0.015, clean=False)
        else:
            guard.observe_compute_s(0.010 * (1 + rng.uniform(-0.02, 0.02)), clean=rng.random() < 0.5)
    assert reaction_steps(list(guard.history)) == [0] * 6
    assert guard.shrinks == 6
    after = [step.budget for step in guard.history][-200:]
    cut = next(i for i, step in enumerate(list(guard.history)[-200:]) if step.shrunk)
    assert after[cut] == pytest.approx(after[cut - 1] * 0.5)
    assert after[cut + 1] - after[cut] == pytest.approx(0.1)  # recovers by 0.1 a phase


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


def test_a_chunk_fits_only_with_the_tail_of_its_measured_overruns():
    """Chunks that mostly end on time but now and then take 1.6x their prediction: the fit uses
    the high quantile of (end - pick) / predicted, not the mean, so a chunk whose predicted cost
    fits the allowance but whose tail would overrun it is not issued; the tail ages out."""
    costs = costs_linear()  # batch 8: 0.08 s
    assert costs.overrun_factor(0.0) == 1.0
    for i in range(40):
        costs.observe_overrun(1.6 if i % 10 == 0 else 1.0, at_s=i * 0.1)
    factor = costs.overrun_factor(4.0)
    assert factor == pytest.approx(1.6)
    assert costs.largest_fitting(0.09, 8) == 8
    assert costs.largest_fitting(0.09, 8, factor) == 4  # 0.08 x 1.6 > 0.09; 0.04 x 1.6 fits
    assert costs.overrun_factor(4.0 + costs.overrun_memory_s) == 1.0  # a load spike passes
    fast = costs_linear()
    fast.observe_overrun(0.7, at_s=0.0)  # ended early: never below the prediction itself
    assert fast.overrun_factor(0.0) == 1.0


def test_the_scheduler_learns_overruns_from_pick_to_end_and_the_gate_issues_nothing_that_would_overrun():
    clock = FakeClock()
    monitor = BubbleMonitor(quantile=0.5, clock=clock)
    run_steps(monitor, clock, 0.05, [0.1] * 3)
    sched = Scheduler(OnlineQueue(4, 1.0), None, costs_linear(per_sample_s=0.005), dataset_size=100)
    gate = Gate(monitor, calibrated_guard(), max_in_flight=1, margin=0.0)
    for _ in range(20):  # chunks started 50% late after their pick: the bubble's end is what counts
        chunk = sched.pick(1.0, now_s=0.0, lane="offline")
        sched.complete(chunk, end_s=1.5 * chunk.predicted_s, busy_s=chunk.predicted_s)
    open_bubble(monitor, clock, 3)
    clock.now += 0.05  # 0.05 s of the 0.1 s bubble left
    chunk = gate.start("offline", lambda a: sched.pick(a, clock(), "offline"))
    assert chunk.batch == 4 and 1.5 * chunk.predicted_s <= 0.05  # 8 (0.04 s) would end at 0.06 s


def test_scheduler_serves_online_before_offline_and_records_latency():
    queue = OnlineQueue(capacity=10, slo_s=1.0)
    sched = Scheduler(queue, None, costs_linear(), dataset_size=100)
    queue.offer(0.0)
    queue.offer(0.1)
    chunk = sched.pick(1.0, now_s=0.2)
    assert chunk.kind == "online" and chunk.batch == 2 and chunk.arrivals_s == [0.0, 0.1]
    sched.complete(chunk, end_s=0.22, busy_s=0.02)
    assert [lat for _, lat, _ in sched.latencies] == pytest.approx([0.22, 0.12])
    assert [wait for _, _, wait in sched.latencies] == pytest.approx([0.2, 0.1])  # formed at 0.2
    chunk = sched.pick(0.05, now_s=0.4)
    assert chunk.kind == "offline" and chunk.batch == 4
    sched.complete(chunk, end_s=0.44, busy_s=0.04)
    assert sched.offline_samples == 4 and sched.online_served == 2


def test_scheduler_does_not_let_offline_jump_a_waiting_request():
    queue = OnlineQueue(capacity=10, slo_s=1.0)
    sched = Scheduler(queue, None, costs_linear(), dataset_size=100)
    queue.offer(0.0)
    assert sched.pick(0.001, now_s=0.0) is None
    assert len(queue) == 1


def test_each_lane_takes_only_its_kind_of_work():
    queue = OnlineQueue(capacity=10, slo_s=1.0)
    sched = Scheduler(queue, None, costs_linear(), dataset_size=100)
    queue.offer(0.0)
    assert sched.pick(1.0, now_s=0.1, lane="offline").kind == "offline"  # the online lane serves it
    assert len(queue) == 1
    assert sched.pick(0.001, now_s=0.1, lane="online") is None  # its cost does not fit
    chunk = sched.pick(1.0, now_s=0.1, lane="online")
    assert chunk.kind == "online" and chunk.arrivals_s == [0.0]
    assert sched.pick(1.0, now_s=0.1, lane="online") is None  # no request: no offline either


def test_an_idle_online_lane_sleeps_until_the_next_arrival():
    arrivals = PoissonArrivals(rate_per_s=5.0, seed=2)
    arrivals.begin(0.0)
    queue = OnlineQueue(capacity=10, slo_s=1.0)
    sched = Scheduler(queue, arrivals, costs_linear(), dataset_size=100)
    assert sched.idle_wait_s("online", 0.0, cap_s=100.0) == pytest.approx(arrivals.next_s())
    assert sched.idle_wait_s("online", 0.0, cap_s=1e-4) == 1e-4
    assert sched.idle_wait_s("offline", 0.0, cap_s=0.05) == 0.05
    due_s = arrivals.next_s()  # the admission said no before pick: the lane must not spin
    assert sched.idle_wait_s("online", due_s + 1e-6, cap_s=0.05) == 0.05  # woken by an edge
    assert len(queue) == 1 and arrivals.next_s() > due_s


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


def _lane_setup_in_thread(executor: CpuExecutor, lane: str) -> int:
    """Run lane_setup in a fresh thread (as a lane would); return that thread's scheduling policy."""
    policy = []

    def lane_thread():
        executor.lane_setup(lane)
        policy.append(os.sched_getscheduler(0))

    thread = threading.Thread(target=lane_thread)
    thread.start()
    thread.join()
    return policy[0]


def test_online_lane_runs_realtime_when_allowed_and_says_so_when_not(monkeypatch):
    workload = build_workload("cnn", dataset_size=8)
    executor = CpuExecutor(workload, intra_op_threads=1, online_priority="realtime")
    assert _lane_setup_in_thread(executor, "offline") == os.SCHED_OTHER
    assert executor.online_priority is None  # no online lane yet
    policy = _lane_setup_in_thread(executor, "online")
    if executor.online_priority == "realtime":
        assert policy == os.SCHED_FIFO and executor.online_priority_refused is None
    else:  # this machine does not grant CAP_SYS_NICE
        assert policy == os.SCHED_OTHER and "SCHED_FIFO refused" in executor.online_priority_refused

    def refuse(*_args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    refused = CpuExecutor(workload, intra_op_threads=1, online_priority="realtime")
    assert _lane_setup_in_thread(refused, "online") == os.SCHED_OTHER
    assert refused.online_priority == "normal"
    assert refused.online_priority_refused == "SCHED_FIFO refused: [Errno 1] Operation not permitted"
    normal = CpuExecutor(workload, intra_op_threads=1, online_priority="normal")
    assert _lane_setup_in_thread(normal, "online") == os.SCHED_OTHER and normal.online_priority == "normal"


def test_an_instances_metrics_add_up_its_replicas_harvest_and_keep_the_worst_latency():
    from tasks.filling.attach import SUMMED, instance_metrics

    def replica(samples: int, bubble_s: float, inside_s: float, p99_s, slowdown, budget: float) -> dict:
        m = {key: 0 for key in SUMMED}
        m.update(inference_samples=samples, offline_samples=samples, bubble_s=bubble_s, busy_in_bubble_s=inside_s,
                 online_p50_s=p99_s, online_p95_s=p99_s, online_p99_s=p99_s, compute_slowdown=slowdown,
                 elapsed_s=10.0, guard_budget=budget, fill_efficiency=inside_s / bubble_s, error=None)
        return m

    m = instance_metrics([replica(30, 2.0, 1.0, 0.05, None, 1.0), replica(10, 1.0, 0.8, None, 0.01, 0.5)])
    assert (m["replicas"], m["inference_samples"], m["offline_samples"]) == (2, 40, 40)
    assert m["fill_efficiency"] == pytest.approx(1.8 / 3.0)  # over the summed bubbles, not a mean of ratios
    assert (m["online_p99_s"], m["compute_slowdown"], m["guard_budget"]) == (0.05, 0.01, 0.5)
    assert instance_metrics([{}, {}]) == {}  # filling off on every replica
