"""Spot capacity over time on the local provider: a capacity trace (tasks/core/capacity.py) played
against one instance type of a run, so that the emulated market runs dry and fills up again.

At each step of the trace the type's capacity (`LocalProvider.capacity`, what spot launches are
refused above) becomes the trace's count, and running spot instances of the type beyond it get a
revocation notice (the excess, newest first). When the trace ends, the type's capacity is what it
was before (unlimited, unless one was set). On-demand instances are another market: never refused
by spot capacity, never revoked by a trace. A drought is the trace "0 for SECONDS".
`provider` is the LocalProvider that calls these (its `capacity` and `inject_revocation`).
"""
from __future__ import annotations

import threading
import time

import numpy as np

from tasks.core.capacity import CapacityTrace
from tasks.providers.base import Provider


def drought(instance_type: str, duration_s: float) -> CapacityTrace:
    """No spot capacity of a type for `duration_s`."""
    return CapacityTrace(f"drought-{instance_type}", "", None, None, "", np.array([0.0]), np.array([0]),
                         float(duration_s))


def revoke_excess(provider: Provider, run_id: str, instance_type: str, available: int, notice_s: float) -> int:
    """Give a notice to the running spot instances of a type beyond `available` (those already on
    notice are leaving anyway); returns how many got one."""
    running = [i for i in provider.describe(run_id)
               if i.type == instance_type and i.market == "spot" and i.state == "running"]
    excess = max(0, len(running) - available)
    for victim in running[len(running) - excess:]:
        provider.inject_revocation(run_id, victim.instance_id, notice_s)
    return excess


def play(provider: Provider, run_id: str, instance_type: str, trace: CapacityTrace, time_scale: float,
         notice_s: float, start: threading.Event, stop: threading.Event, *,
         started_s: float | None = None) -> threading.Thread:
    """Play `trace` (trace seconds at `time_scale` per real second) from when `start` is set, or
    from `started_s` (time.time(): a replay another process began, `spotfill run --resume`), in a
    background thread (returned), until the trace ends or `stop` is set (set `start` too, then).
    Of the steps already due, only the last is played: it is the market's capacity now."""

    def replay() -> None:
        start.wait()
        if stop.is_set():
            return
        began_s = time.monotonic() - (0.0 if started_s is None else max(0.0, time.time() - started_s))
        played_s = time.monotonic() - began_s
        if played_s >= trace.duration_s / time_scale:
            return  # the trace ended while no one played it
        steps = list(zip(trace.times_s.tolist(), trace.available.tolist()))
        due = sum(1 for at_s, _ in steps if at_s / time_scale <= played_s)
        before = provider.capacity.get(instance_type)
        try:
            for at_s, available in steps[max(0, due - 1):]:
                if stop.wait(max(0.0, at_s / time_scale - (time.monotonic() - began_s))):
                    return
                provider.capacity[instance_type] = int(available)
                revoke_excess(provider, run_id, instance_type, int(available), notice_s)
            stop.wait(max(0.0, trace.duration_s / time_scale - (time.monotonic() - began_s)))
        finally:
            if before is None:
                provider.capacity.pop(instance_type, None)
            else:
                provider.capacity[instance_type] = before

    thread = threading.Thread(target=replay, daemon=True, name=f"capacity-{run_id}-{instance_type}")
    thread.start()
    return thread
