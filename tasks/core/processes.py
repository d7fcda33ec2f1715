"""This machine's processes as /proc lists them, and the end of what a process leaves running.

A PS or a worker runs a user's plug-in, whose build() may start a helper process. The orchestrator
kills an instance's whole process group when the instance ends, but a run whose orchestrator is
gone (killed outright, or a detached run whose lease lapsed) ends with no one left to do that: so
each runtime process, leading its own session (the provider starts it with start_new_session),
ends the rest of its session itself on the way out (run_then_exit, exit_now). A plug-in's
non-daemon thread would keep the interpreter from exiting at all: the way out is os._exit.
"""
from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

SCANS = 50  # a helper that forks while it is being killed is caught by a later scan


@dataclass(frozen=True)
class ProcessStat:
    pid: int
    state: str  # R, S, D, ...; Z: a zombie, X: being reaped
    parent: int
    group: int
    session: int

    @property
    def running(self) -> bool:
        return self.state not in ("Z", "X")


def process_stats() -> list[ProcessStat]:
    """Every process /proc lists now (one gone meanwhile is left out)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        state, parent, group, session = text[text.rindex(")") + 2:].split()[:4]
        found.append(ProcessStat(int(stat.parent.name), state, int(parent), int(group), int(session)))
    return found


def end_rest_of_session() -> None:
    """SIGKILL every other running process of the session this process leads (a plug-in's helper,
    and what that started), until a scan finds none. Nothing when this process leads no session:
    started by hand from a shell, its session is the terminal's, which is not its to end."""
    me = os.getpid()
    if os.getsid(0) != me:
        return
    for _ in range(SCANS):
        strays = [p.pid for p in process_stats() if p.session == me and p.pid != me and p.running]
        if not strays:
            return
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def exit_now(status: int) -> NoReturn:
    """Flush the output, end the rest of this process's session, and end the process at once
    (os._exit: no interpreter teardown, which can wait on threads or peers that already went)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    end_rest_of_session()
    os._exit(status)


def run_then_exit(main: Callable[[], int | None]) -> NoReturn:
    """A runtime process's `__main__`: run `main`, then exit_now with its status, whichever way it
    ended (a return, SystemExit, or an exception, printed as the interpreter would, status 1)."""
    try:
        status = main()
    except SystemExit as stop:
        status = stop.code
    except BaseException:  # noqa: BLE001 - said on stderr, as an uncaught one would be
        traceback.print_exc()
        status = 1
    if status is None:
        status = 0
    elif not isinstance(status, int):  # SystemExit("message"): the message, status 1
        sys.stderr.write(f"{status}\n")
        status = 1
    exit_now(status)
