"""A runtime process ends what it leaves running, however it ends (tasks/core/processes.py): a
process leading its own session, whose "plug-in" started helper processes (one in its own process
group, one that forked again) and a non-daemon thread, leaves through run_then_exit with main's
status, and none of its helpers outlives it. Real processes; every wait is on a process's exit
(its pidfd), bounded."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from tasks.core.processes import process_stats
from tests.helpers import REPO, process_alive

pytestmark = pytest.mark.integration

# Starts its helpers, says their pids, then ends main the way argv[1] says.
PROCESS = """
import subprocess, sys, threading
from tasks.core.processes import run_then_exit
def main():
    threading.Thread(target=threading.Event().wait, name="never-ends").start()
    helpers = [subprocess.Popen(["sleep", "1000"]), subprocess.Popen(["sleep", "1000"], process_group=0)]
    forker = subprocess.Popen(["sh", "-c", "sleep 1000 & echo $!; sleep 1000 & echo $!; wait"], stdout=subprocess.PIPE)
    print(*[h.pid for h in helpers], forker.pid, *[int(forker.stdout.readline()) for _ in range(2)], flush=True)
    sys.stdin.readline()  # until the test has found the helpers
    how = sys.argv[1]
    if how == "return":
        return 3
    if how == "exit":
        raise SystemExit("worker: gave up")
    raise RuntimeError("a bug")
run_then_exit(main)
"""
STATUS = {"return": 3, "exit": 1, "raise": 1}


def _session_of(pid: int) -> list[int]:
    return [p.pid for p in process_stats() if p.session == pid and p.pid != pid and p.running]


def _ended(pid: int, timeout_s: float) -> bool:
    try:
        exit_ = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        select.select([exit_], [], [], timeout_s)
    finally:
        os.close(exit_)
    return not process_alive(pid)


@pytest.mark.parametrize("how", sorted(STATUS))
def test_a_session_leader_leaves_no_helper_behind_however_main_ends(how):
    process = subprocess.Popen([sys.executable, "-c", PROCESS, how], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    helpers: list[int] = []
    try:
        helpers = [int(pid) for pid in process.stdout.readline().split()]  # three children, the shell's two
        assert len(helpers) == 5 and set(helpers) <= set(_session_of(process.pid))
        process.stdin.write("go\n")
        process.stdin.flush()
        err = process.communicate(timeout=60)[1]  # a hang guard: the non-daemon thread never ends
        assert process.returncode == STATUS[how], err
        assert {"exit": "worker: gave up", "raise": "RuntimeError: a bug"}.get(how, "") in err
        assert all(_ended(pid, 30) for pid in helpers), [pid for pid in helpers if process_alive(pid)]
    finally:
        for pid in [process.pid, *helpers]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_process_that_leads_no_session_leaves_the_session_alone():
    """Started by hand from a shell, a PS's session is the terminal's: its exit ends nothing else."""
    code = "import subprocess; from tasks.core.processes import exit_now; print(subprocess.Popen(['sleep', '1000'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid); exit_now(0)"
    shell = subprocess.run(["sh", "-c", f"sleep 1000 >/dev/null 2>&1 & echo $!; {sys.executable} -c \"{code}\"; true"], cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60,
                           start_new_session=True)
    # the shell leads the session (`; true`: it does not exec the process); left: its sleep and the process's helper
    left = [int(pid) for pid in shell.stdout.split()]
    try:
        assert shell.returncode == 0 and len(left) == 2, shell.stderr
        assert all(process_alive(pid) for pid in left)
    finally:
        for pid in left:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
