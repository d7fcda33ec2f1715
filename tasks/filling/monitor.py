"""Bubble monitor: phase edges from the training loop -> open/closed bubble, per-slot length estimate.

A bubble is the communication phase of a step (comm_start -> comm_end): the worker's compute
device is idle while it pushes gradients and pulls parameters. Bubbles are grouped in `slots`
(slot = step % slots) so that a loop whose steps alternate (e.g. every other step pulls a larger
update) keeps one estimate per position. The estimate used for admission is a low quantile of the
slot's recent lengths (conservative: a chunk sized to it rarely outlives the bubble); the EWMA is
reported for telemetry. The compute phases' median (of the last `window`) predicts how long a
request queued now would wait for the next bubble (`predicted_wait_s`), which the gate's online
wait bound uses.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import numpy as np


class SlotEstimate:
    """Recent bubble lengths of one slot: a low quantile for admission, an EWMA for reporting."""

    def __init__(self, window: int, quantile: float, ewma_weight: float = 0.2):
        self.lengths_s: deque[float] = deque(maxlen=window)
        self.quantile = quantile
        self.ewma_weight = ewma_weight
        self.ewma_s: float | None = None

    def add(self, length_s: float) -> None:
        self.lengths_s.append(length_s)
        w = self.ewma_weight
        self.ewma_s = length_s if self.ewma_s is None else (1 - w) * self.ewma_s + w * length_s

    def predicted_s(self) -> float | None:
        if not self.lengths_s:
            return None
        return float(np.quantile(np.fromiter(self.lengths_s, float), self.quantile))


class BubbleMonitor:
    """A tasks.core.phases.PhaseListener that knows whether a bubble is open and how long it will last.

    Listener calls only take a lock briefly and notify waiters: training never waits on filling.
    """

    def __init__(self, slots: int = 1, window: int = 32, quantile: float = 0.2,
                 clock: Callable[[], float] = time.perf_counter):
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.clock = clock
        self.slots = [SlotEstimate(window, quantile) for _ in range(slots)]
        self.changed = threading.Condition()
        self.generation = 0  # counts opened bubbles; waiters use it to see a new one
        self.open_since: float | None = None
        self._open_slot = 0
        self._compute_since: float | None = None
        self.recent_bubbles: deque[tuple[float, float]] = deque(maxlen=512)
        self.bubble_total_s = 0.0
        self.bubble_count = 0
        self.compute_times_s: deque[float] = deque(maxlen=4096)  # recent compute phases
        self._recent_compute_s: deque[float] = deque(maxlen=window)  # what compute_estimate_s is of
        self.compute_estimate_s: float | None = None  # median of the last `window` compute phases
        self._awaiting_comm = False  # compute ended, its bubble not yet opened
        self._compute_listeners: list[Callable[[float], None]] = []

    def on_compute_time(self, callback: Callable[[float], None]) -> None:
        """Call `callback(compute_s)` after each compute phase (the guard watches it)."""
        self._compute_listeners.append(callback)

    # -- PhaseListener -------------------------------------------------------------------------
    def compute_start(self, step: int) -> None:
        # A loop that skipped comm_end (e.g. it lost its parameter server and rejoined) must not
        # leave the gate open while it computes: close the bubble, keep it out of the estimate.
        if self.open_since is not None:
            self._close(estimate=False)
        self._awaiting_comm = False
        self._compute_since = self.clock()

    def compute_end(self, step: int, compute_s: float | None = None) -> None:
        """`compute_s`: the phase's length as the device timed it (CUDA events); default: the
        host's clock between the two edges."""
        if self._compute_since is None:
            return
        if compute_s is None:
            compute_s = self.clock() - self._compute_since
        with self.changed:
            self._compute_since = None
            self._awaiting_comm = True
            self.compute_times_s.append(compute_s)
            self._recent_compute_s.append(compute_s)
            self.compute_estimate_s = float(np.median(self._recent_compute_s))
        for callback in self._compute_listeners:
            callback(compute_s)

    def comm_start(self, step: int) -> None:
        with self.changed:
            self._awaiting_comm = False
            self.open_since = self.clock()
            self._open_slot = step % len(self.slots)
            self.generation += 1
            self.changed.notify_all()

    def comm_end(self, step: int) -> None:
        self._close(estimate=True)

    def _close(self, estimate: bool) -> None:
        with self.changed:
            if self.open_since is None:
                return
            now = self.clock()
            length_s = now - self.open_since
            if estimate:
                self.slots[self._open_slot].add(length_s)
            self.recent_bubbles.append((self.open_since, now))
            self.bubble_total_s += length_s
            self.bubble_count += 1
            self.open_since = None
            # No notify: nothing may start in a closed bubble, and a lane woken now would take
            # the GIL and a core just as training's compute phase begins (gate.py, "Waking").

    # -- queries -------------------------------------------------------------------------------
    def is_open(self) -> bool:
        return self.open_since is not None

    def predicted_remaining_s(self, now: float | None = None) -> float:
        """Predicted time left in the open bubble; 0 when closed or when this slot has no history."""
        with self.changed:
            if self.open_since is None:
                return 0.0
            predicted = self.slots[self._open_slot].predicted_s()
            if predicted is None:
                return 0.0
            now = self.clock() if now is None else now
            return max(0.0, predicted - (now - self.open_since))

    def predicted_wait_s(self, now: float | None = None) -> float:
        """Predicted time until the next bubble opens, for a request that finds no room now: the
        rest of the running compute phase; inside a bubble, its predicted remainder plus a whole
        compute phase (a request that does not fit it waits for the one after); 0 before any
        compute phase was seen."""
        with self.changed:
            compute_s = self.compute_estimate_s
            if compute_s is None or self._awaiting_comm:
                return 0.0
            now = self.clock() if now is None else now
            if self._compute_since is not None:
                return max(0.0, compute_s - (now - self._compute_since))
            if self.open_since is None:  # between comm_end and the next compute_start
                return compute_s
            predicted = self.slots[self._open_slot].predicted_s() or 0.0
            return max(0.0, predicted - (now - self.open_since)) + compute_s

    def overlap_s(self, start: float, end: float) -> float:
        """Seconds of [start, end] that fell inside bubbles (closed ones and the open one)."""
        with self.changed:
            total = 0.0
            if self.open_since is not None:
                total += max(0.0, end - max(start, self.open_since))
            for b0, b1 in reversed(self.recent_bubbles):
                if b1 <= start:
                    break
                total += max(0.0, min(end, b1) - max(start, b0))
            return total

    def estimate(self, slot: int = 0) -> tuple[float | None, float | None]:
        """(admission estimate, EWMA) of a slot's bubble length, None before its first bubble."""
        with self.changed:
            return self.slots[slot].predicted_s(), self.slots[slot].ewma_s
