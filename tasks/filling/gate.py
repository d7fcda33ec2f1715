"""Gate (token + barrier): offline chunks start only inside an open bubble whose predicted
remainder, scaled by the guard's budget, covers the chunk's measured cost with a margin; online
requests may also use a small guarded reserve outside bubbles.

    allowance_s = (budget * predicted_remaining_s - margin_s) / (1 + margin)

(online: budget 1 and no relative margin, see online_allowance_s). Offline (and shared "any")
lanes: a chunk is admitted if its predicted cost <= allowance_s and fewer than K such chunks are
in flight. When training resumes (comm_end) the bubble closes and nothing new starts; chunks
already running finish on their own (at most K). No offline chunk starts before the guard has
its solo baseline, nor while it re-measures it.

The online lane (one thread, one chunk at a time) runs next to the offline lanes, so a request
never waits behind an offline chunk. It is admitted when its chunk fits the bubble's allowance.
Otherwise it waits for the next bubble, unless the oldest queued request's wait so far plus the
time until that bubble is predicted to open (monitor.predicted_wait_s: the rest of the compute
phase, or the rest of a bubble the chunk does not fit plus a compute phase) exceeds
`online_max_wait_s`; a compute phase that overruns its prediction thus cannot stretch a wait past
the bound (the waiting lane looks again every quarter of it). Then it may run at once from the
online reserve, a token bucket of inference-seconds outside bubbles that fills at
`online_reserve * budget` per second of wall time (at most `online_reserve` * 1 s saved up: the
guard's budget slows the refill, it does not shrink what the bucket holds) and is charged, when a
chunk ends, with the part of it that ran outside bubbles. So a request waits at most about
`online_max_wait_s` for a bubble while the reserve lasts, and only requests that would wait longer
touch training's compute: with compute phases shorter than the bound, none does. The reserve caps
what they take, and the guard's budget shrinks its refill when training slows. Online requests
are served while the guard re-measures its baseline too, but only inside bubbles: the reserve
waits until the baseline is back, so that clean compute phases come (when requests arrive faster
than compute phases end, reserve chunks touched every phase, the guard never finished calibrating
and no offline chunk ever started).

Training never waits on inference: the training thread only flips the monitor's state (a lock held
for microseconds); lanes do all the waiting.

Waking: a lane wakes only when it may start something: a bubble opens (comm_start notifies), a
chunk ends inside an open bubble, the next request arrives inside it, or a queued request's wait
reaches the bound. Nothing wakes lanes when a bubble closes, nor does any lane poll: on the CPU
every wake-up takes the GIL and a core, and one that lands in training's compute phase can
preempt one of training's threads while the other spins at its next barrier, stretching the step
by milliseconds with no inference running at all (docs/filling.md, "Where the step-time tail
came from").
"""
from __future__ import annotations

import threading
from typing import Callable, Protocol, TypeVar

from tasks.filling.guard import StepTimeGuard
from tasks.filling.monitor import BubbleMonitor

C = TypeVar("C")
RESERVE_SAVED_S = 1.0  # the online reserve saves up at most this many seconds' worth of refill


class Admission(Protocol):
    """What a lane asks before it starts a chunk (the gate, or a baseline policy). `lane` is the
    lane's kind (tasks.filling.scheduler.LANES)."""

    def start(self, lane: str, pick: Callable[[float], C | None]) -> C | None:
        """Atomically: compute the allowance (s), let `pick` choose a chunk that fits, count it."""
    def finish(self, lane: str, start_s: float, end_s: float) -> None: ...
    def wait(self, lane: str, timeout_s: float) -> None:
        """Block (at most timeout_s) until trying again could succeed."""


class Gate:
    def __init__(self, monitor: BubbleMonitor, guard: StepTimeGuard, max_in_flight: int,
                 margin: float, margin_s: float = 0.0, online_reserve: float = 0.0,
                 online_max_wait_s: float = 0.0, waited_s: Callable[[float], float] | None = None):
        self.monitor = monitor
        self.waited_s = waited_s or (lambda now: 0.0)  # clock -> the oldest queued request's wait so far
        self.guard = guard
        self.max_in_flight = max_in_flight
        self.margin = margin
        self.margin_s = margin_s
        self.online_reserve = online_reserve
        self.online_max_wait_s = online_max_wait_s
        self.in_flight = 0  # offline / shared-lane chunks (the online lane runs one at a time)
        self.reserve_s = 0.0
        self._reserve_at = monitor.clock()
        self._lock = threading.Lock()
        self._failed_generation = -1  # the bubble in which nothing fitted: wait for the next one
        self._online_generation = -1  # the bubble (or the compute phase after it) the online lane last looked in

    def _bubble_allowance_s(self, budget: float, margin: float) -> float:
        remaining_s = self.monitor.predicted_remaining_s()
        return max(0.0, (budget * remaining_s - self.margin_s) / (1 + margin))

    def allowance_s(self) -> float:
        """Seconds an offline chunk may take now (0 when none may start)."""
        if self.guard.calibrating or self.in_flight >= self.max_in_flight:
            return 0.0
        return self._bubble_allowance_s(self.guard.budget, self.margin)

    def online_allowance_s(self) -> float:
        """Seconds an online chunk may take now: the bubble's allowance, or the reserve when the
        next bubble is predicted to open more than online_max_wait_s from now, whichever is
        larger. The guard's budget scales the reserve, not the bubble: a chunk that fits the
        predicted remainder leaves the compute phase alone, and squeezing requests out of bubbles
        would only make them wait for the next one. Nor does the relative margin: the chunk's cost
        is already scaled by its lane's measured overrun (the 95th percentile of end-to-pick over
        prediction) and the bubble's remainder is a low quantile of recent bubbles; a request
        turned away at a bubble's end waits a whole compute phase, where an offline chunk turned
        away costs only fill."""
        now = self.monitor.clock()
        rate = self.online_reserve * self.guard.budget
        # The budget slows the refill, not the capacity: a capacity scaled by a shrunk budget
        # would fall below one request's cost and shut the reserve instead of slowing it.
        self.reserve_s = min(self.online_reserve * RESERVE_SAVED_S,
                             self.reserve_s + rate * (now - self._reserve_at))
        self._reserve_at = now
        bubble_s = self._bubble_allowance_s(1.0, 0.0)
        if self.guard.calibrating or self.waited_s(now) + self.monitor.predicted_wait_s(now) <= self.online_max_wait_s:
            return bubble_s
        return max(bubble_s, self.reserve_s)

    def start(self, lane, pick):
        # Under the monitor's lock: the bubble cannot close between the check and the pick, so
        # every admitted offline chunk was picked (chunk.picked_s) while its bubble was open.
        with self._lock, self.monitor.changed:
            if lane == "online":
                self._online_generation = self.monitor.generation
                allowance_s = self.online_allowance_s()
                return pick(allowance_s) if allowance_s > 0 else None
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

    def finish(self, lane: str, start_s: float, end_s: float) -> None:
        with self._lock:
            if lane == "online":
                self.reserve_s -= (end_s - start_s) - self.monitor.overlap_s(start_s, end_s)
            else:
                self.in_flight -= 1
        with self.monitor.changed:
            if self.monitor.is_open():  # the freed slot is of use only inside a bubble
                self.monitor.changed.notify_all()

    def _worth_trying(self) -> bool:
        m = self.monitor
        return (m.is_open() and m.generation != self._failed_generation
                and self.in_flight < self.max_in_flight)

    def wait(self, lane: str, timeout_s: float) -> None:
        """`timeout_s`: for the online lane with nothing queued, the time until the next request
        arrives (Scheduler.idle_wait_s); otherwise a cap."""
        with self.monitor.changed:
            if lane == "online":
                # A bubble that opened since the lane last looked would have notified before this
                # wait began: look again now rather than sleep through it.
                if self.monitor.is_open() and self.monitor.generation != self._online_generation:
                    return
                self.monitor.changed.wait(self._online_sleep_s(timeout_s))
            else:
                self.monitor.changed.wait_for(self._worth_trying, timeout_s)

    def _online_sleep_s(self, timeout_s: float) -> float:
        """How long the online lane may sleep before a request could start: a bubble's opening
        wakes it anyway (comm_start notifies), so it looks earlier only for a request that
        arrives inside the open bubble, or for one whose wait would pass `online_max_wait_s`
        (served from the reserve). During a compute phase a request's predicted wait (its wait
        so far plus the time until the predicted opening) does not grow, so it is either past
        the bound when it arrives or only once the phase overruns, `online_max_wait_s` after
        its arrival at the earliest."""
        now = self.monitor.clock()
        waited_s = self.waited_s(now)
        if self.guard.calibrating:  # no reserve while the guard re-measures: only bubbles serve
            return timeout_s
        if waited_s == 0 and self.monitor.is_open() and timeout_s <= self.monitor.predicted_remaining_s(now):
            return timeout_s  # the next request arrives inside this bubble
        request_s = now - waited_s if waited_s > 0 else now + timeout_s  # the oldest or the next
        opens_s = now + self.monitor.predicted_wait_s(now)
        wake_s = request_s if opens_s - request_s > self.online_max_wait_s else request_s + self.online_max_wait_s
        if wake_s <= now:  # past the bound, yet not started (the reserve ran dry): look again soon
            return max(0.0005, self.online_max_wait_s / 4)
        return wake_s - now
