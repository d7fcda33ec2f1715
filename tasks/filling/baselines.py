"""The co-location policies the gate is measured against (same lanes, scheduler and executor).

- OpenAdmission ("naive", "naive_split"): no gate; inference runs whenever it has work, at most K
  in flight, like plain co-location. "naive" shares its K lanes between online and offline work
  (a thread pool on a CPU: a request waits for the chunk running ahead of it); "naive_split" gives
  online requests their own lane next to K offline lanes, as an online server and an offline job
  co-located as separate MPS clients would run (their work overlaps instead of queueing).
- RateLimitedAdmission ("TGS-like"): no bubble awareness; inference may use a share `duty` of
  wall time (a token bucket of inference-seconds), and the share follows the same step-time guard
  as the gate (AIMD), as TGS adapts the opportunistic job's launch rate to keep the production
  job's throughput.
"""
from __future__ import annotations

import math
import threading
import time

from tasks.filling.guard import StepTimeGuard


class OpenAdmission:
    def __init__(self, max_in_flight: int):
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._cond = threading.Condition()

    def start(self, lane, pick):
        with self._cond:
            if lane == "online":  # its own lane, one chunk at a time
                return pick(math.inf)
            if self.in_flight >= self.max_in_flight:
                return None
            chunk = pick(math.inf)
            if chunk is not None:
                self.in_flight += 1
                return chunk

    def finish(self, lane: str, start_s: float, end_s: float) -> None:
        with self._cond:
            if lane != "online":
                self.in_flight -= 1
            self._cond.notify_all()

    def wait(self, lane: str, timeout_s: float) -> None:
        with self._cond:
            # the online lane's timeout is the time to the next arrival
            self._cond.wait(timeout_s if lane == "online" else min(timeout_s, 0.002))


class RateLimitedAdmission:
    def __init__(self, guard: StepTimeGuard, duty: float, burst_s: float, max_in_flight: int):
        self.guard = guard
        self.duty = duty
        self.burst_s = burst_s
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self._tokens_s = 0.0
        self._last = time.perf_counter()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = time.perf_counter()
        rate = 0.0 if self.guard.calibrating else self.duty * self.guard.budget
        self._tokens_s = min(self.burst_s, self._tokens_s + rate * (now - self._last))
        self._last = now

    def start(self, lane, pick):
        with self._lock:
            self._refill()
            if self.in_flight >= self.max_in_flight or self._tokens_s <= 0:
                return None
            chunk = pick(self._tokens_s)
            if chunk is not None:
                self.in_flight += 1
                return chunk

    def finish(self, lane: str, start_s: float, end_s: float) -> None:
        with self._lock:
            self._refill()
            self._tokens_s -= end_s - start_s
            self.in_flight -= 1

    def wait(self, lane: str, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.002))
