"""Phase edges of a training step, so other parts (inference filling, telemetry) can see the
idle bubbles without the training loop knowing who listens.

A worker's loop calls, every iteration and in this order:
    compute_start(step) -> compute_end(step) -> comm_start(step) -> comm_end(step)
Listeners must return at once: training never waits on them.
"""
from __future__ import annotations

from typing import Protocol


class PhaseListener(Protocol):
    def compute_start(self, step: int) -> None: ...
    def compute_end(self, step: int) -> None: ...
    def comm_start(self, step: int) -> None: ...
    def comm_end(self, step: int) -> None: ...


class NoListener:
    """The default: nobody listens."""

    def compute_start(self, step: int) -> None:
        pass

    def compute_end(self, step: int) -> None:
        pass

    def comm_start(self, step: int) -> None:
        pass

    def comm_end(self, step: int) -> None:
        pass
