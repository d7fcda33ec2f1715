"""os._exit() inside code this process runs on a user's behalf (a plug-in's build()), turned into an
exception: os._exit ends the process at once, with no clean-up, no error line and the status the
code chose (0 reads as success), so a command checking that code could not say what happened.

Only the thread inside `hard_exit_raised()` is affected, and only in this process: another
thread's os._exit, or that of a child forked meanwhile (multiprocessing's children end with it),
goes through as ever.
"""
from __future__ import annotations

import contextlib
import os
import threading

_REAL_EXIT = os._exit
_lock = threading.Lock()
_guarded: set[tuple[int, int]] = set()  # (pid, thread id) inside hard_exit_raised()


class HardExit(BaseException):
    """os._exit(status) called where it was guarded against; a BaseException, as SystemExit is,
    so that the code's own `except Exception` does not swallow it."""

    def __init__(self, status: int):
        super().__init__(f"os._exit({status!r})")
        self.status = status


def _exit(status: int) -> None:
    if (os.getpid(), threading.get_ident()) in _guarded:
        raise HardExit(status)
    _REAL_EXIT(status)


@contextlib.contextmanager
def hard_exit_raised():
    """Within the block, this thread's os._exit(n) raises HardExit(n) instead of ending the
    process."""
    me = (os.getpid(), threading.get_ident())
    with _lock:
        nested = me in _guarded
        _guarded.add(me)
        os._exit = _exit
    try:
        yield
    finally:
        if not nested:
            with _lock:
                _guarded.discard(me)
                if not _guarded:
                    os._exit = _REAL_EXIT
