"""Where each local run lives, so `spotfill cleanup --run-id ID` finds it from any folder.

A run started on the local provider records its artifacts folder in a per-user state folder:
$SPOTFILL_STATE_DIR, else $XDG_STATE_HOME/spotfill (when absolute, as the XDG spec asks), else
~/.local/state/spotfill; one small JSON
file per run, runs/<run-id>.json, written atomically.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tasks.core.atomic import atomic_write_json
from tasks.core.limits import is_identifier


def state_dir() -> Path:
    explicit = os.environ.get("SPOTFILL_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):  # unset, or relative: the XDG spec says to ignore it (else the
        base = Path.home() / ".local" / "state"  # registry would land in whatever folder a run starts from)
    return Path(base) / "spotfill"


def _entry(run_id: str) -> Path:
    if not is_identifier(run_id):
        raise ValueError(f"run id {run_id!r} is not a safe file name")
    return state_dir() / "runs" / f"{run_id}.json"


def remember(run_id: str, artifacts_dir: Path) -> None:
    """Record that run `run_id` keeps its folder under `artifacts_dir` (best effort: a read-only
    home must not stop a run)."""
    record = {"run_id": run_id, "provider": "local", "artifacts_dir": str(Path(artifacts_dir).resolve())}
    try:
        entry = _entry(run_id)
        if entry.exists() and json.loads(entry.read_text()) == record:
            return
        atomic_write_json(entry, record)
    except (OSError, ValueError):
        pass


def artifacts_dir_of(run_id: str) -> Path | None:
    """The artifacts folder run `run_id` was started with, or None if no local run has that id."""
    try:
        record = json.loads(_entry(run_id).read_text())
        return Path(record["artifacts_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
