"""Guard: shrink the inference budget when training's compute phase slows down (AIMD).

Inference can only hurt training by spilling past a bubble into the compute phase, so the guard
watches the compute time (compute_start -> compute_end), not the whole step: the communication
phase follows the network and would drown the signal. The solo baseline is the median of
`calibration_steps` clean compute phases - ones no inference chunk overlapped (the gate starts no
offline chunk while the guard calibrates; online requests are still served, and the compute phases
they touch are left out). It is taken at the start and again every `rebaseline_every` steps, because a shared
machine's background load drifts and a stale baseline would blame that drift on inference (and
shrink the budget to nothing). Between calibrations, when the median of the last `window` compute
times exceeds baseline * (1 + tolerance), the budget (the fraction of a predicted bubble that
inference may use) is multiplied by `decrease`; otherwise it grows by `increase`.
"""
from __future__ import annotations

import statistics
import threading
from collections import deque


class StepTimeGuard:
    def __init__(self, tolerance: float, calibration_steps: int = 5, rebaseline_every: int = 50,
                 window: int = 5, decrease: float = 0.5, increase: float = 0.1,
                 floor: float = 0.05):
        self.tolerance = tolerance
        self.calibration_steps = calibration_steps
        self.rebaseline_every = rebaseline_every
        self.decrease = decrease
        self.increase = increase
        self.floor = floor
        self.budget = 1.0
        self.baseline_s: float | None = None
        self.shrinks = 0
        self.calibrating = True  # the gate admits nothing while this is true
        self._calibration: list[float] = []
        self._since_baseline = 0
        self._recent: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe_compute_s(self, compute_s: float, clean: bool = True) -> None:
        """One compute phase; `clean`: no inference chunk ran during it."""
        with self._lock:
            if self.calibrating:
                if not clean:
                    return
                self._calibration.append(compute_s)
                if len(self._calibration) >= self.calibration_steps:
                    self.baseline_s = statistics.median(self._calibration)
                    self._calibration.clear()
                    self._recent.clear()
                    self._since_baseline = 0
                    self.calibrating = False
                return
            self._recent.append(compute_s)
            if statistics.median(self._recent) > self.baseline_s * (1 + self.tolerance):
                self.budget = max(self.floor, self.budget * self.decrease)
                self.shrinks += 1
                self._recent.clear()  # judge the shrunk budget on fresh steps
            else:
                self.budget = min(1.0, self.budget + self.increase)
            self._since_baseline += 1
            if self._since_baseline >= self.rebaseline_every:
                self.calibrating = True
