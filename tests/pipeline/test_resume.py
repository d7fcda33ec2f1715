"""A run outlives its orchestrator and its PS: `spotfill run` killed with SIGKILL during training,
the training goes on under its lease, and `spotfill run --resume RUN_ID` takes it over to the end
with a report of the whole run (one PS, no duplicate worker); a PS killed with SIGKILL is started
again and the run goes on. Real processes; every wait is on a file or a process, bounded by a
hang guard."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import LOCAL_QUICK_PROFILE, REPO, alive_pids

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s  # a hang guard: a loaded machine starts Prefect slowly
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(0.2)
    return value


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def kill_once_training(first: subprocess.Popen, artifacts) -> Path:
    """SIGKILL the CLI `first` once its run (under `artifacts`) has applied an update; its run folder."""
    def training():
        runs = [p.parent for p in artifacts.glob("run-*/session.json")]
        return runs and any(o["updates"] > 0 for o in records(runs[0] / "observations.jsonl")) and runs[0]

    run_dir = wait_until(lambda: first.poll() is not None or training(), 900, "training")
    assert first.poll() is None, f"the run ended before training (exit {first.returncode})"
    first.send_signal(signal.SIGKILL)
    first.wait()
    return run_dir


def test_a_killed_cli_is_resumed_to_the_slo_with_the_whole_run_reported(tmp_path):
    env = os.environ | {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    cli = [sys.executable, "-m", "tasks.cli.main", "run"]
    first = subprocess.Popen(
        [*cli, "--profile", str(LOCAL_QUICK_PROFILE), "--types", "p3.2xlarge,g3.8xlarge", "--loss", "1.6",
         "--deadline", "900", "--trace", "", "--no-filling", "--artifacts", str(tmp_path), "--lease-s", "120"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run_dir = kill_once_training(first, tmp_path)
        killed_at = time.time()
        before = [r for r in records(run_dir / "telemetry.jsonl") if r["kind"] == "update"]
        wait_until(lambda: any(r["kind"] == "update" and r["t"] > killed_at
                               for r in records(run_dir / "telemetry.jsonl")), 60, "training after the kill")
        resumed = subprocess.run([*cli, "--resume", run_dir.name, "--json"], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout)
    assert summary["verdict"].startswith("SLO met")
    assert summary["updates"] >= len(before) > 0  # the updates before the kill are counted
    observed = records(run_dir / "observations.jsonl")
    assert observed[0]["t_s"] < summary["observed_time_s"] and len(observed) > 1  # the report covers the whole run
    rows = json.loads((run_dir / "instances.json").read_text())["instances"]
    assert [r["role"] for r in rows].count("ps") == 1 and not any(r["plan_id"].startswith("replan") for r in rows)
    joins = [r for r in records(run_dir / "telemetry.jsonl") if r["kind"] == "join"]
    assert len(joins) == len([r for r in rows if r["role"] == "worker"])  # no worker joined twice
    assert alive_pids(tmp_path) == []


def test_a_revocation_due_after_the_kill_is_played_once_by_the_resumed_run(tmp_path):
    """`--revoke-at 8` and the CLI killed at its first update: the revocation falls to whichever
    `run` watches at 8 s of the run, the killed one or the resuming one (at once if it fell due
    unwatched), never to both and never to neither."""
    env = os.environ | {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    cli = [sys.executable, "-m", "tasks.cli.main", "run"]
    first = subprocess.Popen(
        [*cli, "--profile", str(LOCAL_QUICK_PROFILE), "--types", "p3.2xlarge,g3.8xlarge", "--loss", "1.5",
         "--deadline", "900", "--trace", "", "--revoke-at", "8", "--no-filling", "--artifacts", str(tmp_path),
         "--lease-s", "120"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run_dir = kill_once_training(first, tmp_path)
        resumed = subprocess.run([*cli, "--resume", run_dir.name, "--json"], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout)
    notices = [e for e in summary["timeline"] if e["kind"] == "revocation_notice"]
    assert summary["revocations"] == len(notices) == 1 and notices[0]["t_s"] >= 8.0, summary["timeline"]
    assert alive_pids(tmp_path) == []


def test_a_dead_parameter_server_is_restarted_and_the_run_meets_its_slo(prefect_harness, tmp_path):
    from flows.train_with_slo import train_with_slo
    from tasks.pipeline.params import TrainRequest

    request = TrainRequest.model_validate({
        "workload": "transformer-lm", "workload_options": {"seq_len": 16}, "profile": str(LOCAL_QUICK_PROFILE),
        "slo": {"target_loss": 1.6, "deadline_s": 600}, "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"]},
        "filling": {"enabled": False}, "artifacts_dir": str(tmp_path)})
    killed = []

    def kill_the_ps_once_it_trains():
        def ps_training():
            tables = list(tmp_path.glob("run-*/instances.json"))
            updates = [r for r in records(tables[0].parent / "telemetry.jsonl") if r["kind"] == "update"] if tables else []
            return len(updates) >= 5 and json.loads(tables[0].read_text())["instances"][0]
        ps = wait_until(ps_training, 600, "training")
        assert ps["role"] == "ps"
        os.kill(ps["pid"], signal.SIGKILL)
        killed.append(ps["instance_id"])

    killer = threading.Thread(target=kill_the_ps_once_it_trains, daemon=True)
    killer.start()
    summary = train_with_slo(request)
    killer.join(timeout=5)
    assert killed and summary["met"], summary["verdict"]
    restart = next(e for e in summary["timeline"] if e["kind"] == "ps_restart")
    assert restart["lost"] == killed and summary["ps_restarts"] == 1
    run_dir = tmp_path / summary["run_id"]
    rows = json.loads((run_dir / "instances.json").read_text())["instances"]
    assert [r["plan_id"] for r in rows if r["role"] == "ps"] == ["ps", "ps-restart-1"]
    assert not any(r["plan_id"].startswith("replan") for r in rows)  # the same workers rejoined
    assert alive_pids(tmp_path) == []


def test_a_crashed_attempt_is_retried_and_its_retry_reattaches_to_the_live_run(prefect_harness, tmp_path):
    """The flow's first attempt raises mid-training (a progress listener, which the watch loop
    calls at every poll, fails once: an orchestrator bug). Prefect retries the flow run; the run
    was left to its lease, so the retry, the same flow run, re-attaches to it: same run id, the
    same PS and workers trained on, no second PS, no duplicate worker, and it meets its SLO."""
    from prefect import get_client

    from flows.train_with_slo import train_with_slo
    from tasks.pipeline import stages
    from tasks.pipeline.params import TrainRequest

    request = TrainRequest.model_validate({
        "workload": "transformer-lm", "workload_options": {"seq_len": 16}, "profile": str(LOCAL_QUICK_PROFILE),
        "slo": {"target_loss": 1.6, "deadline_s": 600}, "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"]},
        "filling": {"enabled": False},
        "artifacts_dir": str(tmp_path), "lease_s": 120})
    crashed = []

    def crash_once_training(session, obs) -> None:
        if not crashed and obs.updates > 0:
            crashed.append({"run_id": session.run_id, "pids": sorted(alive_pids(tmp_path))})
            raise RuntimeError("the orchestrator failed mid-training")

    stages.PROGRESS_LISTENERS.append(crash_once_training)
    try:
        state = train_with_slo(request, return_state=True)
    finally:
        stages.PROGRESS_LISTENERS.remove(crash_once_training)
    summary = state.result()
    assert crashed and summary["met"], summary["verdict"]
    assert summary["run_id"] == crashed[0]["run_id"] and len(crashed[0]["pids"]) >= 2
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
        history = [s.name for s in client.read_flow_run_states(flow_run.id)]
    assert flow_run.run_count == 2 and "AwaitingRetry" in history
    run_dir = tmp_path / summary["run_id"]
    rows = json.loads((run_dir / "instances.json").read_text())["instances"]
    assert sorted(r["pid"] for r in rows) == crashed[0]["pids"]  # the processes the crash left, none started since
    assert [r["role"] for r in rows].count("ps") == 1 and not any(r["plan_id"].startswith("replan") for r in rows)
    joins = [r for r in records(run_dir / "telemetry.jsonl") if r["kind"] == "join"]
    assert len(joins) == len([r for r in rows if r["role"] == "worker"])  # no worker joined twice
    assert alive_pids(tmp_path) == []
