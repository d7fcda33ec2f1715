"""Interrupts leave no process behind: Ctrl-C (SIGINT to the whole process group) and SIGTERM of
`spotfill train` mid-training, and a child started through tasks.core.lifeline when its parent is
killed outright. Real processes; every wait is on a condition with a generous timeout."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, process_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_lifeline_child_dies_with_a_killed_parent(tmp_path):
    parent_code = ("import subprocess, sys, time, os\n"
                   "p = subprocess.Popen([sys.executable, '-m', 'tasks.core.lifeline', str(os.getpid()), '--',"
                   " 'sleep', '1000'], process_group=0)\n"
                   "print(p.pid, flush=True)\n"
                   "time.sleep(1000)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _wait_for(lambda: "sleep" in Path(f"/proc/{child}/cmdline").read_text(), 60)  # exec'd
    parent.kill()
    parent.wait()
    assert _wait_for(lambda: not process_alive(child), 60), "the child outlived its SIGKILLed parent"


@pytest.mark.parametrize("sig, status, line", [(signal.SIGINT, 130, "spotfill: interrupted"),
                                               (signal.SIGTERM, 143, "spotfill: terminated")])
def test_train_interrupted_mid_training_leaves_nothing(tmp_path, sig, status, line):
    run_id = f"interrupt-{sig.name.lower()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.cli.main", "train", "--workload", "resnet20", "--workload-opt", "width=2",
         "--workers", "p3.2xlarge=2", "--batch-size", "8", "--timeout-s", "600", "--run-id", run_id,
         "--artifacts", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    table = tmp_path / run_id / "instances.json"
    telemetry = tmp_path / run_id / "telemetry.jsonl"

    def training() -> bool:
        return telemetry.exists() and '"update"' in telemetry.read_text()

    try:
        assert _wait_for(lambda: training() or proc.poll() is not None, 300), "training never started"
        assert proc.poll() is None, proc.stderr.read()
        pids = [row["pid"] for row in json.loads(table.read_text())["instances"]]
        assert len(pids) == 3  # the PS and two workers
        os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C does: the whole group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, err
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err
    assert _wait_for(lambda: not any(process_alive(pid) for pid in pids), 60), "a PS or worker outlived the run"
