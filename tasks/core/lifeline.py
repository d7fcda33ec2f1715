"""`python -m tasks.core.lifeline PARENT_PID -- COMMAND ...`, or tied_to_this_process(COMMAND): become
COMMAND (exec, same pid), set to die when PARENT_PID dies, even by SIGKILL, which leaves the parent
no chance to clean up.

On Linux the kernel does it: prctl(PR_SET_PDEATHSIG, SIGKILL) survives the exec. Should the parent
have died before the call, our parent is already someone else, and we stop at once. Elsewhere the
command runs without the watch (the parent's own clean-up on exit and signals still stops it).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel for SIGKILL when this process's parent exits (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def tied_to_this_process(argv: list[str]) -> list[str]:
    """`argv` started through this module, so that it dies with the process that starts it: a
    server a command or a test starts must not outlive it. The module runs by its path (`-P`: its
    folder is not put on sys.path), so the command needs neither this repository on its path nor
    a particular working folder. The kernel watches the thread that starts it: start it from one
    that lives as long as the process (the main thread)."""
    return [sys.executable, "-P", os.path.abspath(__file__), str(os.getpid()), "--", *argv]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.stderr.write("usage: python -m tasks.core.lifeline PARENT_PID -- COMMAND ...\n")
        return 2
    die_with_parent()
    if os.getppid() != int(argv[0]):
        return 0  # the parent is gone already
    os.execvp(argv[2], argv[2:])
    return 1  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
