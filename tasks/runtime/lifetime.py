"""How runtime processes notice their local orchestrator is gone (it was killed outright and could
not clean up): the local provider passes its pid in SPOTFILL_WATCH_PID."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True
