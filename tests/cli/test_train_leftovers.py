"""Nothing of a run outlives it: a plug-in whose build() starts a non-daemon thread and a helper
process, in the command's own check and in every PS and worker, neither keeps `spotfill train`
from exiting nor leaves a process behind, after a normal finish. Real processes; every wait is on
a condition with a generous timeout."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, alive_pids, process_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_plugin_that_leaves_threads_and_processes_leaves_nothing(tmp_path):
    pid_dir = tmp_path / "helpers"
    pid_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.cli.main", "train", "--workload", "tests.plugins.leaves_behind:build",
         "--workers", "p3.2xlarge=2", "--batch-size", "8", "--max-updates", "20", "--timeout-s", "3000",
         "--run-id", "r", "--artifacts", str(tmp_path / "runs")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "SPOTFILL_TEST_PID_DIR": str(pid_dir)})
    try:
        out, err = proc.communicate(timeout=300)  # a hang guard only
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert "stopped by max_updates" in out
    helpers = [int(p.name) for p in pid_dir.iterdir()]
    assert len(helpers) >= 4  # the command's check, the PS, two workers
    deadline = time.monotonic() + 60
    while any(process_alive(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in helpers if process_alive(pid)], "a plug-in's helper outlived the run"
    assert not alive_pids(tmp_path / "runs")
