"""Nothing of a run outlives it: a plug-in whose build() starts a non-daemon thread and a helper
process, in the command's own check and in every PS and worker, neither keeps `spotfill train`
from exiting nor leaves a process behind, after a normal finish; killed outright, the command
leaves no helper of its PS or workers either (they end their own on the way out). Real processes;
every wait is on a condition with a generous timeout."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tasks.providers.local import LocalProvider
from tasks.runtime.telemetry import read_records
from tests.helpers import REPO, alive_pids, process_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _train(tmp_path, max_updates: int) -> subprocess.Popen:
    """`spotfill train` of the plug-in, its helpers' pids recorded under tmp_path/helpers, its output
    in files (a pipe would stay open as long as a helper that inherited it runs)."""
    pid_dir = tmp_path / "helpers"
    pid_dir.mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "tasks.cli.main", "train", "--workload", "tests.plugins.leaves_behind:build",
         "--workers", "p3.2xlarge=2", "--batch-size", "8", "--max-updates", str(max_updates), "--timeout-s", "3000",
         "--run-id", "r", "--artifacts", str(tmp_path / "runs")],
        cwd=REPO, stdout=open(tmp_path / "out", "wb"), stderr=open(tmp_path / "err", "wb"), start_new_session=True,
        env={**os.environ, "SPOTFILL_TEST_PID_DIR": str(pid_dir)})


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.2)


def test_a_plugin_that_leaves_threads_and_processes_leaves_nothing(tmp_path):
    pid_dir = tmp_path / "helpers"
    proc = _train(tmp_path, max_updates=20)
    try:
        proc.wait(timeout=300)  # a hang guard only
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (tmp_path / "err").read_text()
    assert "stopped by max_updates" in (tmp_path / "out").read_text()
    helpers = [int(p.name) for p in pid_dir.iterdir()]
    assert len(helpers) >= 4  # the command's check, the PS, two workers
    deadline = time.monotonic() + 60
    while any(process_alive(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in helpers if process_alive(pid)], "a plug-in's helper outlived the run"
    assert not alive_pids(tmp_path / "runs")


def test_a_run_killed_outright_leaves_no_helper_of_its_ps_or_workers(tmp_path):
    """SIGKILL of the command alone, mid-training: its PS and workers see their orchestrator gone
    and stop, and each ends the helper its plug-in started. (What the command's own check started
    was the command's, killed with no chance to clean up: left to the test's clean-up.)"""
    pid_dir, run_dir = tmp_path / "helpers", tmp_path / "runs" / "r"
    proc = _train(tmp_path, max_updates=10**6)
    rows: list[dict] = []
    try:
        _wait(lambda: proc.poll() is not None or (run_dir.is_dir() and any(
            r["kind"] == "update" for r in read_records(run_dir))), 300, "training")
        assert proc.poll() is None, (tmp_path / "err").read_text()
        rows = LocalProvider(tmp_path / "runs")._load("r")["instances"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _wait(lambda: not any(process_alive(r["pid"]) for r in rows), 120, "the end of the run's processes")
        built_by = {int(p.name): int(p.read_text()) for p in pid_dir.iterdir()}
        helpers = [pid for pid, builder in built_by.items() if builder in {r["pid"] for r in rows}]
        assert {built_by[pid] for pid in helpers} == {r["pid"] for r in rows}  # the PS's and both workers'
        _wait(lambda: not any(process_alive(pid) for pid in helpers), 30, "the helpers' end")
    finally:
        for pid in [r["pid"] for r in rows] + [int(p.name) for p in pid_dir.iterdir()]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
