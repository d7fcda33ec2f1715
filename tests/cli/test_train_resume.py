"""`spotfill train --run-id X` again: however the first command ended (killed outright, Ctrl-C, a
clean finish), the second resumes from the newest checkpoint or says in one line that the run is
finished; and while one command owns a run, a second is refused in one line. Real processes;
every wait is on a condition with a generous timeout."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tasks.core.folder_lock import FolderLock
from tests.helpers import REPO, alive_pids

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _argv(tmp_path, run_id: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tasks.cli.main", "train", "--workload", "resnet20", "--workload-opt", "width=2",
            "--workers", "p3.2xlarge=1", "--batch-size", "8", "--checkpoint-every-s", "1",
            "--run-id", run_id, "--artifacts", str(tmp_path), *extra]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


def _wait_for(condition, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _records(telemetry) -> list[dict]:
    """The telemetry's records so far (a half-written last line is not read)."""
    lines = telemetry.read_text().splitlines(keepends=True) if telemetry.exists() else []
    return [json.loads(line) for line in lines if line.endswith("\n")]


def _totals(telemetry, kind: str) -> list[int]:
    """updates_total of each `kind` record so far."""
    return [r["updates_total"] for r in _records(telemetry) if r.get("kind") == kind]


@pytest.mark.parametrize("end", ["sigkill", "ctrl-c"])
def test_a_run_ended_part_way_resumes_by_its_id(tmp_path, end):
    run_dir = tmp_path / "r"
    first = subprocess.Popen(_argv(tmp_path, "r", "--timeout-s", "3000"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: any(_totals(run_dir / "telemetry.jsonl", "checkpoint")) or first.poll() is not None,
                  "no checkpoint of any update was written")
        assert first.poll() is None, first.stderr.read()
        if end == "sigkill":
            first.kill()  # the command alone: its PS and workers see it gone and stop by themselves
        else:
            os.killpg(first.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
        first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    again = _run(_argv(tmp_path, "r", "--max-updates", "100000", "--timeout-s", "5"))
    assert again.returncode == 0, again.stderr
    assert "stopped by timeout" in again.stdout
    (resumed,) = _totals(run_dir / "telemetry.jsonl", "resume")
    assert resumed > 0
    # the first PS stopped (Ctrl-C: told by the command; SIGKILL: its watch saw the command gone),
    # not killed: its final checkpoint holds every update it applied, and the resume starts there
    (stop,) = [r for r in _records(run_dir / "telemetry.jsonl") if r["kind"] == "stop"][:1]
    assert stop["reason"] == {"sigkill": "orchestrator_gone", "ctrl-c": "signal"}[end]
    assert resumed == stop["updates_total"]
    assert not alive_pids(tmp_path)


def test_a_finished_run_says_so_and_trains_on_when_asked(tmp_path):
    first = _run(_argv(tmp_path, "r", "--max-updates", "30", "--timeout-s", "3000"))
    assert first.returncode == 0 and "stopped by max_updates" in first.stdout, first.stderr
    same = _run(_argv(tmp_path, "r", "--max-updates", "30", "--timeout-s", "3000"))
    assert same.returncode == 2
    assert same.stderr.strip().splitlines() == [
        "spotfill: error: run r is finished: its newest checkpoint has 30 updates, --max-updates is 30; "
        "raise it to train on, or give another --run-id"]
    more = _run(_argv(tmp_path, "r", "--max-updates", "60", "--timeout-s", "3000"))
    assert more.returncode == 0 and "60 updates" in more.stdout and "stopped by max_updates" in more.stdout, more.stderr
    assert _totals(tmp_path / "r" / "telemetry.jsonl", "resume") == [30]
    assert not alive_pids(tmp_path)


def test_a_second_command_on_an_owned_run_is_refused(tmp_path):
    with FolderLock(tmp_path / "r", "run r"):  # as a first command holds it
        second = _run(_argv(tmp_path, "r"))
    assert second.returncode == 2
    assert second.stderr.strip().splitlines() == [
        f"spotfill: error: run r is in use by another command (pid {os.getpid()}); wait for it to end, or stop it first"]
    assert not (tmp_path / "r" / "instances.json").exists()  # it started nothing
