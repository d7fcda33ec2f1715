"""Guard: shrink the inference budget when training's compute phase slows down (AIMD).

Inference can only hurt training by spilling past a bubble into the compute phase, so the guard
watches the compute time (compute_start -> compute_end), not the whole step: the communication
phase follows the network and would drown the signal. The first `calibration_steps` compute
phases (with no filling) give the solo baseline (median). After that, when the median of the last
`window` compute times exceeds baseline * (1 + tolerance), the budget (the fraction of a predicted
bubble that inference may use) is multiplied by `decrease`; otherwise it grows by `increase`.
"""
from __future__ import annotations

import statistics
import threading
from collections import deque


class StepTimeGuard:
    def __init__(self, tolerance: float, calibration_steps: int = 5, window: int = 5,
                 decrease: float = 0.5, increase: float = 0.1, floor: float = 0.05):
        self.tolerance = tolerance
        self.calibration_steps = calibration_steps
        self.decrease = decrease
        self.increase = increase
        self.floor = floor
        self.budget = 1.0
        self.baseline_s: float | None = None
        self.shrinks = 0
        self._calibration: list[float] = []
        self._recent: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    @property
    def calibrated(self) -> bool:
        return self.baseline_s is not None

    def observe_compute_s(self, compute_s: float) -> None:
        with self._lock:
            if self.baseline_s is None:
                self._calibration.append(compute_s)
                if len(self._calibration) >= self.calibration_steps:
                    self.baseline_s = statistics.median(self._calibration)
                return
            self._recent.append(compute_s)
            if statistics.median(self._recent) > self.baseline_s * (1 + self.tolerance):
                self.budget = max(self.floor, self.budget * self.decrease)
                self.shrinks += 1
                self._recent.clear()  # judge the shrunk budget on fresh steps
            else:
                self.budget = min(1.0, self.budget + self.increase)
