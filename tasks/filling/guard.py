"""Guard: shrink the inference budget when training's compute phase slows down (AIMD).

Inference can only hurt training by spilling past a bubble into the compute phase, so the guard
watches the compute time (compute_start -> compute_end), not the whole step: the communication
phase follows the network and would drown the signal. The solo baseline is the median of the last
`calibration_steps` clean compute phases - ones no inference chunk overlapped. Clean phases keep
coming while the filler works (most chunks end inside their bubble), so the baseline follows the
shared machine's background load minute by minute instead of blaming its drift on inference.
Only the phases inference touched are judged: one that is stretched (longer than
baseline * (1 + tolerance)) multiplies the budget (the fraction of a predicted bubble that
inference may use) by `decrease` at once, so the very next bubble admits smaller chunks; every
other phase grows it back by `increase`. Judging a window of touched phases instead (its median)
let a few stretched steps among untouched ones pass unanswered: the step-time tail grew while the
median looked fine. When fewer than `calibration_steps` clean phases came in `rebaseline_every`
steps, the guard calibrates: the gate starts no offline chunk until that many clean phases were
seen (online requests are still served, and the phases they touch are left out). It does so at
the start, too. `history` keeps the recent decisions, for the bench's reaction-time report.
"""
from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class GuardStep:
    """One compute phase as the guard judged it."""
    index: int  # counts every phase the guard has seen
    compute_s: float
    clean: bool  # no inference chunk ran during it
    stretched: bool  # touched by inference and longer than baseline * (1 + tolerance)
    shrunk: bool  # the budget was cut after it
    budget: float  # after this phase
    calibrating: bool  # after this phase: the gate admits no offline chunk


class StepTimeGuard:
    def __init__(self, tolerance: float, calibration_steps: int = 5, rebaseline_every: int = 50,
                 decrease: float = 0.5, increase: float = 0.1, floor: float = 0.05,
                 history: int = 4096):
        self.tolerance = tolerance
        self.calibration_steps = calibration_steps
        self.rebaseline_every = rebaseline_every
        self.decrease = decrease
        self.increase = increase
        self.floor = floor
        self.budget = 1.0
        self.baseline_s: float | None = None
        self.shrinks = 0
        self.calibrating = True  # the gate admits no offline chunk while this is true
        self.history: deque[GuardStep] = deque(maxlen=history)
        self.phases_seen = 0
        self._clean: deque[float] = deque(maxlen=calibration_steps)
        self._clean_since_check = 0
        self._since_check = 0
        self._lock = threading.Lock()
        # Every compute phase, clean and touched: [count, total s] each, for the slowdown report.
        self._totals = {True: [0, 0.0], False: [0, 0.0]}

    def slowdown(self) -> float | None:
        """Mean compute phase inference touched / mean clean one - 1 (None before both exist):
        what filling cost training's compute, as the worker reports it."""
        with self._lock:
            (n_touched, s_touched), (n_clean, s_clean) = self._totals[False], self._totals[True]
        if not n_touched or not n_clean:
            return None
        return (s_touched / n_touched) / (s_clean / n_clean) - 1

    def steps_since(self, index: int) -> list[GuardStep]:
        """The judged phases from the `index`-th on (of the recent ones kept)."""
        with self._lock:
            return [step for step in self.history if step.index >= index]

    def is_stretched(self, compute_s: float) -> bool:
        """Longer than the solo baseline allows (False before there is one)."""
        return self.baseline_s is not None and compute_s > self.baseline_s * (1 + self.tolerance)

    def observe_compute_s(self, compute_s: float, clean: bool = True) -> None:
        """One compute phase; `clean`: no inference chunk ran during it."""
        with self._lock:
            self._totals[clean][0] += 1
            self._totals[clean][1] += compute_s
            stretched = not clean and self.is_stretched(compute_s)
            shrunk = self._judge(compute_s, clean, stretched)
            self.history.append(GuardStep(self.phases_seen, compute_s, clean, stretched, shrunk,
                                          self.budget, self.calibrating))
            self.phases_seen += 1

    def _judge(self, compute_s: float, clean: bool, stretched: bool) -> bool:
        """Update the baseline and the budget; True when the budget was cut."""
        if clean:
            self._clean.append(compute_s)
            self._clean_since_check += 1
            if len(self._clean) >= self.calibration_steps:
                self.baseline_s = statistics.median(self._clean)
        if self.calibrating:
            if self._clean_since_check >= self.calibration_steps:
                self._start_period()
            return False
        if stretched:
            self.budget = max(self.floor, self.budget * self.decrease)
            self.shrinks += 1
        else:
            self.budget = min(1.0, self.budget + self.increase)
        self._since_check += 1
        if self._since_check >= self.rebaseline_every:
            if self._clean_since_check >= self.calibration_steps:
                self._start_period()  # the baseline is fresh: no need to stop offline work
            else:
                self.calibrating = True
                self._clean_since_check = 0
        return stretched

    def _start_period(self) -> None:
        self.calibrating = False
        self._since_check = 0
        self._clean_since_check = 0


def reaction_steps(steps: list[GuardStep]) -> list[int | None]:
    """For each stretched phase in `steps`, how many phases later the budget was cut (0: right
    after it), or None when it was not cut within `steps`."""
    out = []
    for i, step in enumerate(steps):
        if step.stretched:
            out.append(next((j - i for j in range(i, len(steps)) if steps[j].shrunk), None))
    return out
