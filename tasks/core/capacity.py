"""Spot capacity over time: how many instances of a type the market would hand out at each moment.

A revocation trace says when running instances were taken; a capacity trace says how many could
be had at all, so a launch above it is refused and a drop below what runs revokes the excess.
Three shapes are read (docs/market.md, "Capacity"):
- CSV `seconds,available`: a step function, each row the count from its time on; the last row
  marks the end. An optional header names the unit (`seconds,available` or `hours,available`);
  without one, Bamboo's rule holds (timestamps with a decimal point are hours). Bamboo's own
  `seconds_since_start,live_instances` files are such records: what its cluster could keep live.
- JSON `{"metadata": {"gap_seconds": G, "zone": Z}, "data": [counts]}`: a count every G seconds.
- A comment row `# zone: us-east-1c` (CSV), `metadata.zone` (JSON), or a zone in the file's name
  (Bamboo's `...-us-east-1c-...`) says which availability zone the record is from.
Every problem is one line naming the file and line.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.core.errors import UserInputError
from tasks.core.inputs import loads_json, read_text
from tasks.core.limits import MAX_DURATION_S, max_count, strict_float, strict_int
from tasks.core.traces import family_of

ZONE = r"[a-z]{2}(?:-gov)?-[a-z]+-\d[a-z](?:-[a-z0-9]+-\d[a-z])?"
_ZONE_IN_NAME = re.compile(r"(?:^|[-_])(" + ZONE + r")(?=[-_.]|$)")
ZONE_KEY = '"zone"'
_HEADERS = {"seconds": 1.0, "seconds_since_start": 1.0, "hours": 3600.0}


@dataclass(frozen=True)
class CapacityTrace:
    name: str
    path: str
    family: str | None  # instance family from the file name; None: it names none
    zone: str | None
    zone_where: str  # "file:line" (or "file (its name)") that named the zone, for errors
    times_s: np.ndarray  # step times from the record's start (first 0), increasing
    available: np.ndarray  # instances obtainable from times_s[i] on
    duration_s: float  # the record's length; replays wrap around after it

    def at(self, t_s: float) -> int:
        """The count at t_s into the record (wrapping)."""
        i = np.searchsorted(self.times_s, t_s % self.duration_s, side="right") - 1
        return int(self.available[i])

    def window(self, offset_s: float, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
        """The steps seen by a replay starting `offset_s` into the record, over [0, horizon_s]:
        times (first 0) and counts, wrapping around the record's end."""
        laps = np.arange(0, int(np.ceil((offset_s + horizon_s) / self.duration_s)) + 1)
        times = (self.times_s[None, :] + laps[:, None] * self.duration_s).ravel() - offset_s
        counts = np.tile(self.available, len(laps))
        first = max(int(np.searchsorted(times, 0.0, side="right")) - 1, 0)
        keep = slice(first, int(np.searchsorted(times, horizon_s, side="right")))
        times, counts = times[keep].copy(), counts[keep]
        times[0] = 0.0
        change = np.r_[True, counts[1:] != counts[:-1]]
        return times[change], counts[change]

    def check_region(self, region: str) -> None:
        """A zone outside the region would put capacity where the plan's instances cannot be."""
        if self.zone is not None and not re.fullmatch(re.escape(region) + r"[a-z](?:-[a-z0-9]+-\d[a-z])?", self.zone):
            raise UserInputError(f"{self.zone_where}: zone {self.zone} is not in region {region}")


def _count(text: str, where: str) -> int:
    try:
        n = strict_int(text)
    except UserInputError:
        raise UserInputError(f"{where}: available count is not an integer: {text[:40]!r}") from None
    if n < 0:
        raise UserInputError(f"{where}: negative available count {n}")
    if n > max_count():
        raise UserInputError(f"{where}: available count {n} is more than {max_count()} (SPOTFILL_MAX_COUNT)")
    return n


def _time(text: str, unit_s: float, where: str) -> float:
    try:
        value = strict_float(text)
    except UserInputError:
        raise UserInputError(f"{where}: timestamp is not a number: {text[:40]!r}") from None
    if not np.isfinite(value) or value < 0:
        raise UserInputError(f"{where}: timestamp must be zero or more, got {text[:40]}")
    if value * unit_s > MAX_DURATION_S:
        raise UserInputError(f"{where}: timestamp {text[:40]} is more than ten years")
    return value * unit_s


def _zone(text: str, where: str) -> str:
    if not re.fullmatch(ZONE, text):
        raise UserInputError(f"{where}: {text[:40]!r} is not an availability zone (like us-east-1c)")
    return text


def _from_csv(path: Path, text: str) -> tuple[list[float], list[int], float, str | None, str, bool]:
    """Rows -> steps; the last value says whether it is Bamboo's headerless record, which is
    replayed from the first moment an instance was live (its cluster started late)."""
    rows = [(n, [c.strip() for c in r]) for n, r in enumerate(csv.reader(text.splitlines()), 1) if any(c.strip() for c in r)]
    zone, zone_where, unit_s, data = None, "", None, []
    for line_no, row in rows:
        where = f"{path}:{line_no}"
        if row[0].startswith("#"):
            key, sep, value = ",".join(row).lstrip("#").partition(":")
            if sep and key.strip() == "zone":
                zone, zone_where = _zone(value.strip(), where), where
            continue
        if len(row) != 2:
            raise UserInputError(f"{where}: expected `seconds,available`, got {len(row)} fields")
        if not data and unit_s is None and row[0] in _HEADERS:
            unit_s = _HEADERS[row[0]]
            continue
        data.append((line_no, row))
    if not data:
        raise UserInputError(f"{path}: capacity trace has no rows")
    header = unit_s
    if unit_s is None:
        unit_s = 3600.0 if any("." in r[0] for _, r in data) else 1.0
    times: list[float] = []
    counts: list[int] = []
    for line_no, (t_text, n_text) in data:
        where = f"{path}:{line_no}"
        t = _time(t_text, unit_s, where)
        if times and t < times[-1]:
            raise UserInputError(f"{where}: time goes backwards ({t:g} s after {times[-1]:g} s)")
        times.append(t)
        counts.append(_count(n_text, where))
    return times, counts, times[-1], zone, zone_where, header is None


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _from_json(path: Path, text: str) -> tuple[list[float], list[int], float, str | None, str, bool]:
    doc = loads_json(text, f"capacity trace {path}")
    if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), dict) or not isinstance(doc.get("data"), list):
        raise UserInputError(f"{path}: expected {{\"metadata\": {{\"gap_seconds\": G}}, \"data\": [counts]}}")
    meta, data = doc["metadata"], doc["data"]
    gap_at = text.find('"gap_seconds"')
    gap_where = f"{path}:{_line_of(text, gap_at)}" if gap_at >= 0 else str(path)
    gap = meta.get("gap_seconds")
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not np.isfinite(gap) or gap <= 0:
        raise UserInputError(f"{gap_where}: metadata.gap_seconds must be a positive number of seconds, got {gap!r:.40}")
    if not data:
        raise UserInputError(f"{path}: capacity trace has no data")
    if gap * len(data) > MAX_DURATION_S:
        raise UserInputError(f"{gap_where}: {len(data)} counts every {gap:g} s span more than ten years")
    # each count's line: the numbers after "data": [ in order (the array holds nothing else valid)
    start = text.find("[", text.find('"data"'))
    offsets = [m.start() + start for m in re.finditer(r"[^\s,\[\]]+", text[start:text.find("]", start) + 1])]
    counts = []
    for i, n in enumerate(data):
        where = f"{path}:{_line_of(text, offsets[i]) if i < len(offsets) else '?'}"
        if isinstance(n, bool) or not isinstance(n, int):
            raise UserInputError(f"{where}: data[{i}] must be a whole count of instances, got {n!r:.40}")
        counts.append(_count(str(n), where))
    zone, zone_where = meta.get("zone"), ""
    if zone is not None:
        zone_where = f"{path}:{_line_of(text, text.find(ZONE_KEY))}"
        if not isinstance(zone, str):
            raise UserInputError(f"{zone_where}: metadata.zone must be a zone name, got {zone!r:.40}")
        zone = _zone(zone, zone_where)
    return [i * float(gap) for i in range(len(data))], counts, len(data) * float(gap), zone, zone_where, False


def load_capacity(path: str | Path) -> CapacityTrace:
    """Parse one capacity record (CSV or JSON, by its first character)."""
    path = Path(path)
    text = read_text(path, "capacity trace")
    times, counts, end_s, zone, zone_where, from_live = (
        _from_json if text.lstrip().startswith("{") else _from_csv)(path, text)
    if zone is None and (m := _ZONE_IN_NAME.search(path.stem)):
        zone, zone_where = m.group(1), f"{path} (its name)"
    live = [i for i, n in enumerate(counts) if n > 0]
    first = times[live[0]] if live and from_live else times[0]
    keep = [i for i, t in enumerate(times) if t >= first]
    rel = np.array([times[i] - first for i in keep])
    duration_s = end_s - first
    if duration_s <= 0:
        raise UserInputError(f"{path}: the capacity trace spans no time (its rows all stand at {first:g} s)")
    # rows at one instant: the last one holds (Bamboo writes a step as two rows at one time)
    last = np.r_[rel[1:] != rel[:-1], True]
    rel, avail = rel[last], np.array([counts[i] for i in keep])[last]
    if rel[-1] >= duration_s:  # the end marker
        rel, avail = rel[:-1], avail[:-1]
    try:
        family = family_of(path.stem)
    except UserInputError:
        family = None
    return CapacityTrace(path.stem, str(path), family, zone, zone_where, rel, avail, float(duration_s))
