"""Real spot revocation traces, parsed into revocation events an instance of any count can replay.

Two formats (profiles/traces/, sources in profiles/sources/README.md):
- Bamboo: `seconds_since_start,live_instances`, a step function of how many instances were live.
  The 3-day p2 file writes its timestamps with a decimal point, and they only make sense as hours
  (88.7 at the end of a multi-day window), so such timestamps are read as hours, whole numbers as
  seconds.
- Parcae: `milliseconds,add|remove,node_id`, one row per instance arrival or revocation.

A trace becomes a list of events (time, fraction of the live instances revoked then). Replaying it
against a cluster of any size thins it: at each event every live instance of the mapped type is
revoked with that fraction as its probability, so a mass revocation (fraction 1) takes them all.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.core.errors import UserInputError, shown
from tasks.core.inputs import read_text
from tasks.core.limits import MAX_DURATION_S, strict_float, strict_int

REPO = Path(__file__).resolve().parents[2]
TRACE_DIR = REPO / "profiles" / "traces"
MIN_TRACE_S = 1.0  # a shorter trace gives a hazard of its own rounding, not of a market


@dataclass(frozen=True)
class Trace:
    name: str
    family: str  # instance family the trace was recorded on, e.g. "p3"
    live_from_s: float  # first time any instance was live: replays start no earlier
    duration_s: float
    event_times_s: np.ndarray  # sorted times at which instances were revoked
    revoked_fraction: np.ndarray  # at each event, revoked / live just before it (0 < f <= 1)
    revocations: int
    instance_hours: float


def trace_path(name: str) -> Path:
    """A trace file given by path, or by name under profiles/traces/ (never outside it); whether
    it exists, load_trace says."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = (TRACE_DIR / name).resolve()
    if shipped.parent != TRACE_DIR.resolve():
        raise UserInputError(f"trace '{shown(name)}' is neither a file nor a trace name under profiles/traces/")
    return shipped


def family_of(type_or_trace: str) -> str:
    """'p3.2xlarge' -> 'p3'; a trace's file name -> the first family token in it:
    'bamboo_aws-spot-instances-g4dn-xlarge-...' -> 'g4dn', 'parcae_p3trace' -> 'p3', 'p3-mine' -> 'p3'."""
    if "." in type_or_trace:
        return type_or_trace.split(".", 1)[0]
    m = re.search(r"(?:^|[-_])([a-z]{1,4}\d+[a-z]*?)(?:trace|[-_.]|$)", type_or_trace)
    if not m:
        raise UserInputError(f"cannot tell the instance family of trace {type_or_trace!r} from its name "
                             f"(name it after the family, e.g. p3-{type_or_trace}.csv)")
    return m.group(1)


def _number(text: str, where: str) -> float:
    """A timestamp read by core's strict parser: `1_000` or `١٢` is a typo or another script's
    digits, not 1000 or 12."""
    try:
        value = strict_float(text)
    except UserInputError:
        raise UserInputError(f"{where}: timestamp is not a number: {shown(text)}") from None
    if not np.isfinite(value):
        raise UserInputError(f"{where}: timestamp is not finite: {text!r}")
    if value < 0:
        raise UserInputError(f"{where}: negative timestamp {text}")
    return value


def _check_monotone(times: list[float], where: str) -> None:
    if len(times) >= 2 and times[-1] < times[-2]:
        raise UserInputError(f"{where}: time goes backwards ({times[-1]:g} after {times[-2]:g})")


def _from_steps(path: Path, rows: list[list[str]]) -> tuple[list[float], list[float], float, float, int, float]:
    """Bamboo step function -> events."""
    unit_s = 3600.0 if any("." in r[0] for r in rows) else 1.0
    times: list[float] = []
    events: list[float] = []
    fracs: list[float] = []
    live_prev, t_prev, inst_s, revocations, live_from_s = None, 0.0, 0.0, 0, None
    for line_no, row in enumerate(rows, 1):
        where = f"{shown(path)}:{line_no}"
        t = _number(row[0], where) * unit_s
        if t > MAX_DURATION_S:  # a typo (or, with a dot, hours overflowing)
            raise UserInputError(f"{where}: timestamp {row[0]} is more than ten years{' (in hours: it has a dot)' if unit_s > 1 else ''}")
        try:
            live = strict_int(row[1])
        except UserInputError:
            raise UserInputError(f"{where}: live instance count is not an integer: {shown(row[1])}") from None
        if live < 0:
            raise UserInputError(f"{where}: negative live instance count {live}")
        times.append(t)
        _check_monotone(times, where)
        if live > 0 and live_from_s is None:
            live_from_s = t
        if live_prev is not None:
            inst_s += live_prev * (t - t_prev)
            if live < live_prev:
                events.append(t)
                fracs.append((live_prev - live) / live_prev)
                revocations += live_prev - live
        live_prev, t_prev = live, t
    return events, fracs, live_from_s or 0.0, times[-1], revocations, inst_s / 3600.0


def _from_nodes(path: Path, rows: list[list[str]]) -> tuple[list[float], list[float], float, float, int, float]:
    """Parcae add/remove events -> events (removes at one instant are one event revoking a share)."""
    live: set[str] = set()
    times: list[float] = []
    events: list[float] = []
    removed: list[int] = []
    live_before: list[int] = []
    t_prev, inst_s = 0.0, 0.0
    for line_no, row in enumerate(rows, 1):
        where = f"{shown(path)}:{line_no}"
        t = _number(row[0], where) / 1000.0
        if t > MAX_DURATION_S:
            raise UserInputError(f"{where}: timestamp {row[0]} ms is more than ten years")
        times.append(t)
        _check_monotone(times, where)
        inst_s += len(live) * (t - t_prev)
        t_prev = t
        kind, node = row[1], row[2]
        if kind == "add":
            live.add(node)
        elif kind == "remove":
            if node not in live:
                raise UserInputError(f"{where}: remove of {node!r}, which is not live")
            if events and events[-1] == t:
                removed[-1] += 1
            else:
                events.append(t)
                removed.append(1)
                live_before.append(len(live))
            live.discard(node)
        else:
            raise UserInputError(f"{where}: unknown event {kind!r} (expected add or remove)")
    fracs = [r / b for r, b in zip(removed, live_before)]
    return events, fracs, times[0], times[-1], sum(removed), inst_s / 3600.0


def load_trace(path: str | Path) -> Trace:
    """Parse one trace file; every problem is a UserInputError naming the file and line."""
    path = Path(path)
    text = read_text(path, "trace")
    rows = [[c.strip() for c in r] for r in csv.reader(text.splitlines()) if any(c.strip() for c in r)]
    if not rows:
        raise UserInputError(f"{shown(path)}: trace has no events")
    widths = {len(r) for r in rows}
    if widths == {2}:
        parse = _from_steps
    elif widths == {3}:
        parse = _from_nodes
    else:
        bad = next(i for i, r in enumerate(rows, 1) if len(r) != len(rows[0]) or len(r) not in (2, 3))
        raise UserInputError(f"{shown(path)}:{bad}: unknown trace format (expected `seconds,live_instances` "
                             f"or `milliseconds,add|remove,node_id`)")
    events, fracs, live_from_s, duration_s, revocations, inst_h = parse(path, rows)
    if duration_s - live_from_s < MIN_TRACE_S:
        raise UserInputError(f"{shown(path)}: the trace spans {duration_s - live_from_s:.3g} s with instances live; "
                             f"one that says something about revocations spans at least {MIN_TRACE_S:g} s")
    if inst_h <= 0:
        raise UserInputError(f"{shown(path)}: no instance is ever live, so the trace says nothing about revocations")
    return Trace(path.stem, family_of(path.stem), live_from_s, duration_s, np.array(events), np.array(fracs),
                 revocations, inst_h)


def load_traces(paths: list[str | Path] | None = None) -> list[Trace]:
    """The given trace files, or every shipped one under profiles/traces/."""
    paths = sorted(TRACE_DIR.glob("*.csv")) if paths is None else [Path(p) for p in paths]
    if not paths:
        raise UserInputError(f"no trace files found under {TRACE_DIR}")
    return [load_trace(p) for p in paths]
