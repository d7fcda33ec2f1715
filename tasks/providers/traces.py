"""Real spot preemption traces, as step functions of how many instances were alive.

Formats (shared/data/README.md):
- Bamboo: `time,live_instances` rows, a step function. Times are seconds since the start, except
  in the p2.xlarge 2020-11-20-to-2020-11-23 file, whose times are hours (its last row is 88.695
  for a three-day trace); a file whose last time is under 200 is read as hours.
- Parcae: `milliseconds,add|remove,node_id`; the live count is the running sum.
"""
from __future__ import annotations

import csv
from pathlib import Path

from tasks.errors import UserInputError

HOURS_IF_SPAN_BELOW = 200.0


def load_trace(path: Path) -> list[tuple[float, int]]:
    """[(seconds since start, live instances)] at every change, first row at time 0."""
    try:
        rows = [row for row in csv.reader(Path(path).read_text().splitlines()) if row]
    except OSError as err:
        raise UserInputError(f"cannot read trace {path}: {err.strerror}") from None
    if not rows:
        raise UserInputError(f"trace {path} is empty")
    try:
        if len(rows[0]) == 3:
            points, live = [], 0
            for ms, action, _node in rows:
                if action not in ("add", "remove"):
                    raise ValueError(f"action {action!r}")
                live += 1 if action == "add" else -1
                points.append((float(ms) / 1000.0, live))
        else:
            points = [(float(t), int(n)) for t, n in rows]
            if points[-1][0] < HOURS_IF_SPAN_BELOW:
                points = [(t * 3600.0, n) for t, n in points]
    except ValueError as err:
        raise UserInputError(f"trace {path} is neither Bamboo (time,live) nor Parcae (ms,add|remove,node): {err}") from None
    steps: list[tuple[float, int]] = []
    for t, n in points:
        if steps and steps[-1][0] == t:
            steps[-1] = (t, n)  # several rows at one instant: the last one holds
        elif not steps or steps[-1][1] != n:
            steps.append((t, n))
    return steps


def revocations(steps: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """[(time, fraction of the live instances taken)] at each drop of the live count."""
    return [(t, (prev - n) / prev) for (_, prev), (t, n) in zip(steps, steps[1:]) if n < prev]
