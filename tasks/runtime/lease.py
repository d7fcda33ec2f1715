"""A run's lease: how long the run may train with no orchestrator watching it.

The orchestrator renews the lease while it watches (TrainingRun.progress, every RENEW_EVERY_S);
the parameter server reads it (LeaseWatch). While the lease is valid the PS and its workers train
whether or not the orchestrator lives, so a laptop that sleeps or a CLI killed outright does not
end the training, and `spotfill run --resume` can take the run over. Once it lapses the PS writes
a final checkpoint and stops; its workers hear the stop at their next exchange and exit, so no
process of the run outlives its lease unattended.

Locally the lease is a small JSON file in the run folder, {"lease_s", "expires_at_s", "owner_pid"}
(wall-clock seconds: the PS and the orchestrator share the machine's clock), rewritten
atomically. Its owner is the orchestrator that renewed it last: another one takes the run over
(driver.attach_run) only once that process is gone.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tasks.core.atomic import atomic_write_bytes

LEASE_FILE = "lease.json"
DEFAULT_LEASE_S = 180.0  # long enough for a laptop's short sleep or a Prefect retry to re-attach
RENEW_EVERY_S = 2.0  # how often a watching orchestrator renews it
CHECK_EVERY_S = 0.5  # how often the PS reads it


def renew(path: Path, lease_s: float, now_s: float | None = None) -> float:
    """Extend the lease to `lease_s` seconds from now, held by this process; returns its new
    expiry (wall-clock s)."""
    expires_at_s = (time.time() if now_s is None else now_s) + lease_s
    record = {"lease_s": lease_s, "expires_at_s": expires_at_s, "owner_pid": os.getpid()}
    # fsync=False: a power cut ends the run's processes too; a lease that outlives them is moot
    atomic_write_bytes(path, json.dumps(record).encode(), fsync=False)
    return expires_at_s


def _read(path: Path, key: str) -> float | None:
    try:
        value = json.loads(path.read_text())[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def expiry_s(path: Path) -> float | None:
    """The lease's expiry (wall-clock s), or None when there is no readable lease at `path`."""
    value = _read(path, "expires_at_s")
    return None if value is None else float(value)


def owner_pid(path: Path) -> int | None:
    """The process that renewed the lease last (the run's orchestrator), if known."""
    value = _read(path, "owner_pid")
    return value if isinstance(value, int) else None


class LeaseWatch:
    """The PS's view of the lease: lapsed once the newest expiry it read has passed. A file it
    cannot read keeps the last expiry it could (a missing one counts as lapsed at that expiry)."""

    def __init__(self, path: Path, check_every_s: float = CHECK_EVERY_S):
        self.path = path
        self.check_every_s = check_every_s
        self.expires_at_s = expiry_s(path) or 0.0
        self._next_check_s = 0.0

    def lapsed(self, now_s: float | None = None) -> bool:
        now_s = time.time() if now_s is None else now_s
        if now_s >= self._next_check_s or now_s >= self.expires_at_s:  # a lapse is read twice
            self._next_check_s = now_s + self.check_every_s
            self.expires_at_s = expiry_s(self.path) or self.expires_at_s
        return now_s >= self.expires_at_s
