"""`spotfill train` when the run itself fails: the parameter server's state is part of every stop
decision, so a PS that fails (its writes refused, killed outright) ends the command at once,
non-zero, with the PS's error in one line, instead of a run that waits out its deadline and
reports success. Real processes; every wait is on a condition with a generous timeout."""
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, alive_pids

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _train(tmp_path, run_id: str, *extra: str, preexec_fn=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tasks.cli.main", "train", "--workload", "resnet20", "--workload-opt", "width=2",
         "--workers", "p3.2xlarge=1", "--batch-size", "8", "--timeout-s", "3000", "--run-id", run_id,
         "--artifacts", str(tmp_path), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=preexec_fn)


def _finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=300)  # a hang guard only: the run's own timeout is 3000 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _small_files_only(limit_bytes: int):
    """Every file the run writes may hold `limit_bytes` at most (EFBIG past it, as ENOSPC on a
    full disk: the write fails, the process goes on)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def test_ps_whose_writes_fail_ends_train_with_its_error(tmp_path):
    # a checkpoint (46 KB) never fits; the telemetry fills up after about a hundred updates
    proc = _train(tmp_path, "writes-fail", "--checkpoint-every-s", "1", preexec_fn=_small_files_only(30_000))
    out, err = _finish(proc)
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("spotfill: the parameter server failed after ") and "File too large" in last, err
    assert "Traceback" not in err and "stopped by ps_failed" in out
    assert (tmp_path / "writes-fail" / "ps-error.txt").read_text().startswith("OSError: [Errno 27]")
    assert not alive_pids(tmp_path)


def test_ps_killed_outright_ends_train_at_once(tmp_path):
    proc = _train(tmp_path, "ps-killed")
    telemetry = tmp_path / "ps-killed" / "telemetry.jsonl"
    deadline = time.monotonic() + 300
    while not (telemetry.exists() and '"update"' in telemetry.read_text()) and proc.poll() is None:
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()
    os.kill(json.loads((tmp_path / "ps-killed" / "ps.json").read_text())["pid"], signal.SIGKILL)
    out, err = _finish(proc)
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("spotfill: the parameter server failed after ") and "the parameter server exited" in last
    assert "Traceback" not in err and "stopped by ps_failed" in out
    assert not alive_pids(tmp_path)
