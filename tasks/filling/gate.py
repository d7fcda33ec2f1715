"""Gate (token + barrier): an inference chunk starts only inside an open bubble whose predicted
remainder, scaled by the guard's budget, covers the chunk's measured cost with a margin.

    allowance_s = (budget * predicted_remaining_s - margin_s) / (1 + margin)

A chunk is admitted if its predicted cost <= allowance_s and fewer than K chunks are in flight.
When training resumes (comm_end) the bubble closes and nothing new starts; chunks already running
finish on their own (at most K). Nothing starts before the guard has its solo baseline. Training
never waits on inference: the training thread only flips the monitor's state (a lock held for
microseconds); lanes do all the waiting.
"""
from __future__ import annotations

import threading
from typing import Callable, Protocol, TypeVar

from tasks.filling.guard import StepTimeGuard
from tasks.filling.monitor import BubbleMonitor

C = TypeVar("C")


class Admission(Protocol):
    """What a lane asks before it starts a chunk (the gate, or a baseline policy)."""

    def start(self, pick: Callable[[float], C | None]) -> C | None:
        """Atomically: compute the allowance (s), let `pick` choose a chunk that fits, count it."""
    def finish(self, busy_s: float) -> None: ...
    def wait(self, timeout_s: float) -> None:
        """Block (at most timeout_s) until trying again could succeed."""


class Gate:
    def __init__(self, monitor: BubbleMonitor, guard: StepTimeGuard, max_in_flight: int,
                 margin: float, margin_s: float = 0.0):
        self.monitor = monitor
        self.guard = guard
        self.max_in_flight = max_in_flight
        self.margin = margin
        self.margin_s = margin_s
        self.in_flight = 0
        self._lock = threading.Lock()
        self._failed_generation = -1  # the bubble in which nothing fitted: wait for the next one

    def allowance_s(self) -> float:
        if self.guard.calibrating or self.in_flight >= self.max_in_flight:
            return 0.0
        remaining_s = self.monitor.predicted_remaining_s()
        return max(0.0, (self.guard.budget * remaining_s - self.margin_s) / (1 + self.margin))

    def start(self, pick):
        # Under the monitor's lock: the bubble cannot close between the check and the pick, so
        # every admitted chunk was picked (chunk.picked_s) while its bubble was open.
        with self._lock, self.monitor.changed:
            generation = self.monitor.generation
            if not self.monitor.is_open():
                return None
            allowance_s = self.allowance_s()
            chunk = pick(allowance_s) if allowance_s > 0 else None
            if chunk is None:
                self._failed_generation = generation
                return None
            self.in_flight += 1
            return chunk

    def finish(self, busy_s: float) -> None:
        with self._lock:
            self.in_flight -= 1
        with self.monitor.changed:
            self.monitor.changed.notify_all()

    def _worth_trying(self) -> bool:
        m = self.monitor
        return (m.is_open() and m.generation != self._failed_generation
                and self.in_flight < self.max_in_flight)

    def wait(self, timeout_s: float) -> None:
        with self.monitor.changed:
            self.monitor.changed.wait_for(self._worth_trying, timeout_s)
