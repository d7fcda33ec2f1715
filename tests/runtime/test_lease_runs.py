"""A leased run outlives its orchestrator, and not its lease: real PS and worker processes on
the local provider, the orchestrator a separate process killed with SIGKILL. Every wait is on a
file or a process, bounded."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tasks.providers.local import LocalProvider
from tasks.runtime import checkpoint
from tasks.runtime.telemetry import read_records
from tests.helpers import process_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LEASE_S = 20.0  # long enough that a loaded machine renews it in time while the run starts
# The orchestrator: start a leased run of a workload (argv: artifacts, lease, workload, options) with one worker, watch it until it trains (which renews
# the lease), say so in a file, then hang, watching no more, until it is killed.
ORCHESTRATOR = """
import json, sys, threading
from pathlib import Path
from tasks.providers.local import LocalProvider
from tasks.runtime import driver
artifacts, lease_s, workload, options = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
provider = LocalProvider(artifacts)
run = driver.start_run(provider, "leased", workload, workload_options=options, ps_type="p3.2xlarge",
                       checkpoint_every_s=60.0, lease_s=lease_s)
driver.add_workers(run, "g4dn.4xlarge", 1, batch_size=8)
driver.wait_for(run, lambda p: p.updates_total >= 3, timeout_s=120)
(artifacts / "training").write_text("yes")
threading.Event().wait()
"""


def _wait(condition, timeout_s: float, what: str) -> float:
    """Poll `condition` until it holds; returns when (monotonic s). Fails after timeout_s."""
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline_s, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.1)
    return time.monotonic()


def test_a_killed_orchestrator_leaves_the_run_to_its_lease(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    orchestrator = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR, str(tmp_path), repr(LEASE_S), "resnet20",
                                     json.dumps({"width": 4})], env=env)
    provider = LocalProvider(tmp_path)
    try:
        _wait(lambda: (tmp_path / "training").exists() or orchestrator.poll() is not None, 180, "training")
        assert orchestrator.poll() is None, "the orchestrator failed before training"
        run_dir = tmp_path / "leased"
        rows = provider._load("leased")["instances"]
        assert [r["role"] for r in rows] == ["ps", "worker"]
        orchestrator.send_signal(signal.SIGKILL)
        orchestrator.wait()
        killed_at = time.time()
        killed_s = time.monotonic()
        # the training goes on without it ...
        _wait(lambda: any(r["kind"] == "update" and r["t"] > killed_at for r in read_records(run_dir)), LEASE_S,
              "an update after the kill")
        # ... until the lease lapses: then every process of the run ends by itself
        ended_s = _wait(lambda: not any(process_alive(r["pid"]) for r in rows), LEASE_S + 60, "the run's end")
        assert ended_s - killed_s <= LEASE_S + 30
        records = read_records(run_dir)
        stop = next(r for r in records if r["kind"] == "stop")
        assert stop["reason"] == "lease_lapsed"
        lease = json.loads((run_dir / "lease.json").read_text())  # as the last renewal left it
        assert lease["lease_s"] == LEASE_S and lease["expires_at_s"] <= killed_at + LEASE_S
        assert stop["t"] >= lease["expires_at_s"]  # the run trained to its lease's end, not a moment less
        final = checkpoint.load_checkpoint(checkpoint.list_checkpoints(run_dir / "checkpoints")[-1])
        assert final["version"] == stop["version"]
        assert {r["reason"] for r in records if r["kind"] == "leave"} == {"ps_stop"}
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
        provider.cleanup("leased")


def test_a_lapsed_lease_leaves_no_helper_of_its_ps_or_worker(tmp_path):
    """A plug-in whose build() starts a helper process (and a non-daemon thread) in the PS and the
    worker: when the lease lapses with no orchestrator left, each ends its own helpers on the way
    out. (The killed orchestrator's own check leaves its helpers to the test's clean-up.)"""
    pid_dir = tmp_path / "helpers"
    pid_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "SPOTFILL_TEST_PID_DIR": str(pid_dir)}
    orchestrator = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR, str(tmp_path), repr(LEASE_S),
                                     "tests.plugins.leaves_behind:build", "{}"], env=env)
    provider = LocalProvider(tmp_path)
    try:
        _wait(lambda: (tmp_path / "training").exists() or orchestrator.poll() is not None, 180, "training")
        assert orchestrator.poll() is None, "the orchestrator failed before training"
        rows = provider._load("leased")["instances"]
        orchestrator.send_signal(signal.SIGKILL)
        orchestrator.wait()
        _wait(lambda: not any(process_alive(r["pid"]) for r in rows), LEASE_S + 60, "the run's end")
        assert next(r for r in read_records(tmp_path / "leased") if r["kind"] == "stop")["reason"] == "lease_lapsed"
        built_by = {int(p.name): int(p.read_text()) for p in pid_dir.iterdir()}
        helpers = [pid for pid, builder in built_by.items() if builder in {r["pid"] for r in rows}]
        assert {built_by[pid] for pid in helpers} == {r["pid"] for r in rows}  # the PS's and the worker's
        _wait(lambda: not any(process_alive(pid) for pid in helpers), 30, "the helpers' end")
    finally:
        if orchestrator.poll() is None:
            orchestrator.kill()
        for pid in [int(p.name) for p in pid_dir.iterdir()]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        provider.cleanup("leased")
