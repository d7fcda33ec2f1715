"""A run's lease: how long the run may train with no orchestrator watching it.

The orchestrator renews the lease while it watches (TrainingRun.progress, every RENEW_EVERY_S);
the parameter server reads it (LeaseWatch). While the lease is valid the PS and its workers train
whether or not the orchestrator lives, so a laptop that sleeps or a CLI killed outright does not
end the training, and `spotfill run --resume` can take the run over. Once it lapses the PS writes
a final checkpoint and stops; its workers hear the stop at their next exchange and exit, so no
process of the run outlives its lease unattended.

Locally the lease is a small JSON file in the run folder, {"lease_s", "expires_at_s", "owner_pid"}
(wall-clock seconds: the PS and the orchestrator share the machine's clock), rewritten
atomically; on AWS, with a checkpoint bucket, the same JSON is the object
s3://BUCKET/<run-id>/lease.json (durable.py), and the clocks are NTP's. Its owner is the orchestrator that renewed it last: another one takes the run over
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


def _is_s3(place) -> bool:
    return isinstance(place, str) and place.startswith("s3://")


def renew(place: Path | str, lease_s: float, now_s: float | None = None) -> float:
    """Extend the lease to `lease_s` seconds from now, held by this process; returns its new
    expiry (wall-clock s)."""
    expires_at_s = (time.time() if now_s is None else now_s) + lease_s
    record = json.dumps({"lease_s": lease_s, "expires_at_s": expires_at_s, "owner_pid": os.getpid()}).encode()
    if _is_s3(place):
        from tasks.runtime.durable import write_object  # deferred: boto3, torch (start-up cost)

        write_object(place, record)
    else:  # fsync=False: a power cut ends the run's processes too; a lease that outlives them is moot
        atomic_write_bytes(Path(place), record, fsync=False)
    return expires_at_s


def _read(place: Path | str, key: str) -> float | None:
    try:
        if _is_s3(place):
            from tasks.runtime.durable import read_object  # deferred: boto3, torch (start-up cost)

            text = read_object(place)
        else:
            text = Path(place).read_text()
        value = json.loads(text)[key]
    except Exception:  # noqa: BLE001 - unreadable, whatever the store says: the last expiry read holds
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def expiry_s(place: Path | str) -> float | None:
    """The lease's expiry (wall-clock s), or None when there is no readable lease at `place`."""
    value = _read(place, "expires_at_s")
    return None if value is None else float(value)


def owner_pid(place: Path | str) -> int | None:
    """The process that renewed the lease last (the run's orchestrator), if known."""
    value = _read(place, "owner_pid")
    return value if isinstance(value, int) else None


class LeaseWatch:
    """The PS's view of the lease: lapsed once the newest expiry it read has passed. A file it
    cannot read keeps the last expiry it could (a missing one counts as lapsed at that expiry)."""

    def __init__(self, place: Path | str, check_every_s: float = CHECK_EVERY_S):
        self.place = place
        self.check_every_s = check_every_s
        self.expires_at_s = expiry_s(place) or 0.0
        self._next_check_s = 0.0

    def lapsed(self, now_s: float | None = None) -> bool:
        now_s = time.time() if now_s is None else now_s
        if now_s >= self._next_check_s or now_s >= self.expires_at_s:  # a lapse is read twice
            self._next_check_s = now_s + self.check_every_s
            self.expires_at_s = expiry_s(self.place) or self.expires_at_s
        return now_s >= self.expires_at_s
