"""The co-location policies the gate is measured against (same lanes, scheduler and executor).

- OpenAdmission ("naive"): no gate; inference runs whenever it has work, at most K in flight,
  like plain co-location (MPS on a GPU, an extra thread pool on a CPU).
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

    def start(self, pick):
        with self._cond:
            if self.in_flight >= self.max_in_flight:
                return None
            chunk = pick(math.inf)
            if chunk is not None:
                self.in_flight += 1
                return chunk

    def finish(self, busy_s: float) -> None:
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait(min(timeout_s, 0.002))


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

    def start(self, pick):
        with self._lock:
            self._refill()
            if self.in_flight >= self.max_in_flight or self._tokens_s <= 0:
                return None
            chunk = pick(self._tokens_s)
            if chunk is not None:
                self.in_flight += 1
                return chunk

    def finish(self, busy_s: float) -> None:
        with self._lock:
            self._refill()
            self._tokens_s -= busy_s
            self.in_flight -= 1

    def wait(self, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.002))
