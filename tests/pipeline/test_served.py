"""Deployments served against a real `prefect server` that this test starts: one triggered through
the API, the drift automation running the re-plan deployment when an event arrives (also for a
real run flooding with drift), runs whose flow process is killed, and a scheduled run."""
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tasks.core.lifeline import tied_to_this_process
from tests.helpers import LOCAL_QUICK_PROFILE, PRICE_ARCHIVE, REPO, SHIPPED_PROFILE, alive_pids, children_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server_env(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-server-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    # No AWS credentials (not even moto's fake ones another fixture may have set): the catalog
    # refresh keeps the shipped catalog; a test that wants moto adds its keys.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AWS_"))} | {
        "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false", "PYTHONPATH": str(REPO), "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"), "AWS_CONFIG_FILE": str(home / "no-aws-config")}
    log = open(home / "server.log", "wb")
    # tied to this process: a test run killed part way does not leave the server running for good
    server = subprocess.Popen(tied_to_this_process([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)]),
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy():
        try:
            return httpx.get(f"{api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, 240, "the Prefect server")
        yield env
    finally:
        stop(server)
        log.close()


def test_served_deployments_run_through_the_api_and_the_drift_automation(server_env, tmp_path):
    api = server_env["PREFECT_API_URL"]
    serve_log = open(tmp_path / "serve.log", "wb")
    served = subprocess.Popen(tied_to_this_process([sys.executable, "-m", "flows.serve"]), cwd=REPO, env=server_env,
                              stdout=serve_log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def names():
            r = httpx.post(f"{api}/deployments/filter", json={}, timeout=10)
            return {d["name"] for d in r.json()} if r.status_code == 200 else set()

        wait_until(lambda: {"train-with-slo", "catalog-refresh", "profile-workload", "replan-on-drift"} <= names(),
                   240, "the served deployments")

        # A deployment run triggered through the API and watched to completion.
        out = tmp_path / "catalog.json"
        r = subprocess.run([PREFECT, "deployment", "run", "catalog-refresh/catalog-refresh", "--param",
                            f"out={json.dumps(str(out))}", "--watch", "--watch-timeout", "240"],
                           cwd=REPO, env=server_env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(json.loads(out.read_text())["types"]) == 84

        # Drift events: the automation runs replan-on-drift for a run whose drift_action is
        # "automation" (never for an inline one), which asks a live run to re-plan and leaves a
        # finished one alone.
        def emit(run: str, action: str) -> None:
            resource = {"prefect.resource.id": f"spotfill.run.{run}", "spotfill.drift-action": action, "spotfill.plan": "0"}
            r = subprocess.run([PREFECT, "event", "emit", "spotfill.run.drift", "--resource", json.dumps(resource),
                                "--payload", json.dumps({"artifacts_dir": str(tmp_path), "speed_ratio": 0.6, "plan": 0})],
                               cwd=REPO, env=server_env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr

        def drift_runs():
            r = httpx.post(f"{api}/flow_runs/filter", json={"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}},
                           timeout=10)
            return [f for f in r.json() if f["parameters"].get("resource_id", "").startswith("spotfill.run.")]

        run_dir, done_dir, inline_dir = tmp_path / "run-served", tmp_path / "run-done", tmp_path / "run-inline"
        for d in (run_dir, done_dir, inline_dir):
            d.mkdir()
        (done_dir / "summary.json").write_text("{}")
        emit("run-inline", "inline")
        emit("run-done", "automation")
        emit("run-served", "automation")
        request = wait_until(lambda: (run_dir / "replan-request.json").exists() and
                             json.loads((run_dir / "replan-request.json").read_text()), 240, "the re-plan request")
        assert request == {"reason": "drift", "plan": 0}
        wait_until(lambda: len(drift_runs()) >= 2, 240, "the automation's runs")
        assert sorted(f["parameters"]["resource_id"] for f in drift_runs()) == ["spotfill.run.run-done",
                                                                               "spotfill.run.run-served"]
        assert not (done_dir / "replan-request.json").exists() and not (inline_dir / "replan-request.json").exists()

        # A run of the main deployment cancelled from the API: its instances are all gone.
        deployment = next(d for d in httpx.post(f"{api}/deployments/filter", json={}, timeout=10).json()
                          if d["name"] == "train-with-slo")
        runs_dir = tmp_path / "runs"
        flow_run = start_served_run(api, deployment["id"], runs_dir, target_loss=1.5)
        wait_until(lambda: len(alive_pids(runs_dir)) >= 2, 900, "the cancelled run's instances")
        r = httpx.post(f"{api}/flow_runs/{flow_run['id']}/set_state",
                       json={"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}, timeout=10)
        assert r.status_code in (200, 201), r.text

        def state():
            return httpx.get(f"{api}/flow_runs/{flow_run['id']}", timeout=10).json()["state"]["type"]

        # The runner tells the flow's process it is a cancel, then stops it with SIGTERM: the run
        # goes Cancelling to Cancelled, never through Crashed (tasks/providers/local.py leaves the
        # engine's SIGTERM handler in place, which the runner's cancel needs).
        final = wait_until(lambda: state() in ("CANCELLED", "FAILED", "COMPLETED") and state(), 120,
                           "the run to be cancelled")
        assert final == "CANCELLED"
        history = [s["name"] for s in httpx.get(f"{api}/flow_run_states/", params={"flow_run_id": flow_run["id"]},
                                                timeout=10).json()]
        assert "Cancelling" in history and "Crashed" not in history, history
        wait_until(lambda: alive_pids(runs_dir) == [], 60, "no process left")
        reports = wait_until(lambda: [a for a in httpx.post(f"{api}/artifacts/filter", timeout=10, json={
            "artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}}).json() if a["key"] == "train-with-slo-report"],
                             60, "the cancelled run's report")
        assert len(reports) == 1 and "Run cancelled after" in reports[0]["data"]
    finally:
        stop(served)
        serve_log.close()


def start_served_run(api: str, deployment_id: str, runs_dir: Path, target_loss: float) -> dict:
    """A run of the served train-with-slo deployment on the shipped quick profile, no filling."""
    params = {"request": {
        "workload": "transformer-lm", "workload_options": {"seq_len": 16},
        "slo": {"target_loss": target_loss, "deadline_s": 600},
        "profile": str(LOCAL_QUICK_PROFILE),
        "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"]}, "filling": {"enabled": False},
        "artifacts_dir": str(runs_dir)}}
    return create_flow_run(api, deployment_id, params)


def create_flow_run(api: str, deployment_id: str, params: dict) -> dict:
    """A run of a deployment, created through the API; a busy server (SQLite under the automation's
    writes) may answer an error once, which a test must see rather than wait on a run never made."""
    for _ in range(5):
        r = httpx.post(f"{api}/deployments/{deployment_id}/create_flow_run", json={"parameters": params}, timeout=30)
        if r.status_code == 201:
            return r.json()
        assert r.status_code >= 500 or r.status_code == 409, f"create_flow_run: {r.status_code} {r.text}"
        time.sleep(2.0)
    raise AssertionError(f"create_flow_run kept failing: {r.status_code} {r.text}")


def flow_process_of(runs_dir: Path) -> int | None:
    """The flow run's process: the parent of the instances it started (each in its own session)."""
    for table in runs_dir.glob("*/instances.json"):
        for row in json.loads(table.read_text())["instances"]:
            try:
                stat = Path(f"/proc/{row['pid']}/stat").read_text()
            except OSError:
                continue
            return int(stat[stat.rindex(")") + 2:].split()[1])
    return None


def test_a_served_run_whose_flow_process_is_killed_is_retried_and_reattaches(server_env, tmp_path):
    """SIGKILL leaves the flow no chance to act; the run trains on under its lease. The runner's
    crash hook rebuilds the run from the flow run (its id and parameters), sees it alive and
    schedules the flow run again; the runner's retry, the same flow run, re-attaches to it and
    meets the SLO: one PS, the same workers, every process ended at the end."""
    api = server_env["PREFECT_API_URL"]
    serve_log = open(tmp_path / "serve.log", "wb")
    served = subprocess.Popen(tied_to_this_process([sys.executable, "-m", "flows.serve"]), cwd=REPO, env=server_env,
                              stdout=serve_log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def deployment():
            r = httpx.post(f"{api}/deployments/filter", json={}, timeout=10)
            found = [d for d in r.json() if d["name"] == "train-with-slo"] if r.status_code == 200 else []
            return found[0] if found else None

        dep = wait_until(deployment, 240, "the served train-with-slo deployment")
        runs_dir = tmp_path / "runs"
        flow_run = start_served_run(api, dep["id"], runs_dir, target_loss=1.6)
        wait_until(lambda: len(alive_pids(runs_dir)) >= 2, 240, "the run's instances")
        flow_pid = flow_process_of(runs_dir)
        assert flow_pid is not None and flow_pid != served.pid
        before = sorted(alive_pids(runs_dir))
        os.kill(flow_pid, signal.SIGKILL)

        def read():
            return httpx.get(f"{api}/flow_runs/{flow_run['id']}", timeout=10).json()

        def ended():  # a Crashed run ends once its crash hook stopped it (summary.json), else it is retried
            run = read()
            kind = run["state"]["type"]
            done = kind in ("FAILED", "CANCELLED", "COMPLETED") or (
                kind == "CRASHED" and any(runs_dir.glob("run-*/summary.json")))
            return done and run

        final = wait_until(ended, 600, "the retried run to end")
        history = [s["name"] for s in httpx.get(f"{api}/flow_run_states/", params={"flow_run_id": flow_run["id"]},
                                                timeout=10).json()]
        assert final["state"]["type"] == "COMPLETED" and final["state"]["message"].startswith("SLO met"), final["state"]
        assert final["run_count"] == 2 and "Crashed" in history and "AwaitingRetry" in history
        run_dir = next(runs_dir.glob("run-*"))
        rows = json.loads((run_dir / "instances.json").read_text())["instances"]
        assert sorted(r["pid"] for r in rows) == before  # the retry started no PS and no worker
        wait_until(lambda: alive_pids(runs_dir) == [], 60, "no process left")
    finally:
        stop(served)
        serve_log.close()


def test_deployed_from_prefect_yaml_to_a_process_pool_a_worker_runs_the_catalog_refresh(server_env, tmp_path):
    """`prefect deploy --all` as shipped, a process worker, and a run of catalog-refresh through
    it (without AWS credentials: the shipped catalog, said so)."""
    env = server_env

    def prefect(*args: str, timeout_s: float = 300) -> str:
        r = subprocess.run([PREFECT, "--no-prompt", *args], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=timeout_s)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    prefect("work-pool", "create", "spotfill", "--type", "process")
    prefect("deploy", "--all")
    worker_log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "spotfill"], cwd=tmp_path, env=env,
                              stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = tmp_path / "catalog.json"
        prefect("deployment", "run", "catalog-refresh/catalog-refresh", "--param", f"out={json.dumps(str(out))}",
                "--watch", "--watch-timeout", "400", timeout_s=450)
        assert len(json.loads(out.read_text())["types"]) == 84
        worker_log.flush()
        assert "no AWS credentials: kept the shipped catalog" in (tmp_path / "worker.log").read_text()
    finally:
        stop(worker)
        worker_log.close()


def test_a_served_aws_run_whose_flow_process_is_killed_leaves_nothing_running(server_env, moto_endpoint, moto_amis,
                                                                             tmp_path):
    """The same on AWS (moto's server): the flow is killed while its parameter server starts; the
    crash hook, in the serving process, terminates the run's instances by their tags."""
    import boto3

    from tasks.providers.aws import TAG_RUN
    from tasks.providers.aws_sandbox import FAKE_CREDENTIALS

    shipped = json.loads(SHIPPED_PROFILE.read_text()) | {"workload": "resnet20"}
    t4 = next(i for i in shipped["instances"] if i["type"] == "g4dn.4xlarge")
    shipped["instances"] = [{**t4, "type": "g4dn.2xlarge", "quota": 4}, {**t4, "type": "g4dn.12xlarge", "gpus": 4, "quota": 1}]
    profile = tmp_path / "t4.json"
    profile.write_text(json.dumps(shipped))
    env = server_env | FAKE_CREDENTIALS | {"AWS_ENDPOINT_URL": moto_endpoint}  # the lease's S3 client finds moto
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket="spotfill-served")
    served = subprocess.Popen(tied_to_this_process([sys.executable, "-m", "flows.serve"]), cwd=REPO, env=env,
                              stdout=open(tmp_path / "serve.log", "wb"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    api = server_env["PREFECT_API_URL"]
    ec2 = boto3.client("ec2", endpoint_url=moto_endpoint, region_name="us-east-1")
    try:
        def deployment():
            r = httpx.post(f"{api}/deployments/filter", json={}, timeout=10)
            found = [d for d in r.json() if d["name"] == "train-with-slo"] if r.status_code == 200 else []
            return found[0] if found else None

        dep = wait_until(deployment, 240, "the served train-with-slo deployment")
        aws = {"endpoint_url": moto_endpoint, "ami_ids": moto_amis, "spot_price_archive": str(PRICE_ARCHIVE),
               "candidate_types": ["g4dn.2xlarge", "g4dn.12xlarge"], "checkpoint_bucket": "spotfill-served"}
        params = {"request": {
            "workload": "resnet20", "slo": {"target_loss": 0.8, "deadline_s": 6000}, "profile": str(profile),
            "candidates": {"types": ["g4dn.2xlarge", "g4dn.12xlarge"]}, "filling": {"enabled": False},
            "provider": {"name": "aws", "aws": aws}, "artifacts_dir": str(tmp_path / "runs")}}
        flow_run = create_flow_run(api, dep["id"], params)
        run_id = f"run-{flow_run['id'].replace('-', '')[:10]}"

        def alive():
            reservations = ec2.describe_instances(Filters=[
                {"Name": f"tag:{TAG_RUN}", "Values": [run_id]},
                {"Name": "instance-state-name", "Values": ["pending", "running"]}])["Reservations"]
            return [i for r in reservations for i in r["Instances"]]

        wait_until(alive, 240, "the run's parameter server on moto")  # the flow now waits for it to listen
        for pid in children_of(served.pid):
            os.kill(pid, signal.SIGKILL)

        def state():
            return httpx.get(f"{api}/flow_runs/{flow_run['id']}", timeout=10).json()["state"]["type"]

        assert wait_until(lambda: state() in ("CRASHED", "FAILED", "CANCELLED", "COMPLETED") and state(), 120,
                          "the run to crash") == "CRASHED"
        wait_until(lambda: alive() == [], 120, "no instance of the run running")
    finally:
        stop(served)


def test_a_scheduled_nightly_retrain_starts_and_ends_with_a_verdict(server_env, tmp_path):
    """The shipped nightly-retrain deployment, served by flows.serve from a copy of prefect.yaml whose
    only change is its schedule (on, every minute) and a quick request: the server's scheduler
    creates a run and the runner starts it, with no one asking for it."""
    import yaml

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    nightly = next(d for d in spec["deployments"] if d["name"] == "nightly-retrain")
    runs_dir = tmp_path / "runs"
    nightly |= {"entrypoint": str(REPO / nightly["entrypoint"]),
                "schedules": [{"cron": "* * * * *", "timezone": "UTC", "active": True}]}
    nightly["parameters"]["request"] |= {"profile": str(LOCAL_QUICK_PROFILE), "filling": {"enabled": False},
                                         "artifacts_dir": str(runs_dir)}
    definitions = tmp_path / "prefect.yaml"
    definitions.write_text(yaml.safe_dump(spec | {"deployments": [nightly]}))
    api = server_env["PREFECT_API_URL"]
    serve_log = open(tmp_path / "serve.log", "wb")
    served = subprocess.Popen([sys.executable, "-m", "flows.serve", str(definitions)], cwd=REPO,
                              env=server_env | {"PREFECT_RUNNER_POLL_FREQUENCY": "2"}, stdout=serve_log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def scheduled_runs():
            r = httpx.post(f"{api}/flow_runs/filter", json={"deployments": {"name": {"any_": ["nightly-retrain"]}}},
                           timeout=10)
            assert r.status_code == 200, r.text
            return [f for f in r.json() if f["auto_scheduled"]]

        def ended():
            # a run due while the last one still runs is cancelled (the shipped CANCEL_NEW limit)
            done = [f for f in scheduled_runs() if f["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED")]
            return done[0] if done else None

        run = wait_until(ended, 420, "a scheduled nightly-retrain run to end")
        states = httpx.get(f"{api}/flow_run_states/", params={"flow_run_id": run["id"]}, timeout=10).json()
        # Scheduled by the server, Pending when the runner takes it (again as its engine starts), Running
        path = [s["type"] for s in sorted(states, key=lambda s: s["timestamp"])]
        path = [t for i, t in enumerate(path) if i == 0 or t != path[i - 1]]
        assert path == ["SCHEDULED", "PENDING", "RUNNING", run["state"]["type"]], path
        assert run["state"]["type"] in ("COMPLETED", "FAILED") and run["state"]["message"].startswith("SLO ")
        assert {"spotfill", "nightly", "slo-met" if run["state"]["type"] == "COMPLETED" else "slo-missed"} <= set(run["tags"])
        wait_until(lambda: alive_pids(runs_dir) == [], 60, "no process left")
    finally:
        stop(served)
        serve_log.close()


def test_a_run_flooding_with_drift_gets_one_replan_per_plan_from_the_automation(server_env, tmp_path):
    """The flood case (drift_action automation, threshold 0.05, window 3 s) through flows.serve,
    on a profile that predicts four times the speed the local provider gives (drift is certain):
    one drift event per plan, one replan-on-drift run per event at most, none crashed, every
    refit to a ratio in (0, 1], the run's predictions finite and its verdict its final state."""
    fast = json.loads(LOCAL_QUICK_PROFILE.read_text())
    for inst in fast["instances"]:
        inst["compute_time_s"] /= 4
    profile = tmp_path / "optimistic.json"
    profile.write_text(json.dumps(fast))
    api = server_env["PREFECT_API_URL"]
    serve_log = open(tmp_path / "serve.log", "wb")
    served = subprocess.Popen([sys.executable, "-m", "flows.serve"], cwd=REPO,
                              env=server_env | {"PREFECT_RUNNER_POLL_FREQUENCY": "2"}, stdout=serve_log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def deployment():
            r = httpx.post(f"{api}/deployments/filter", json={}, timeout=10)
            found = [d for d in r.json() if d["name"] == "train-with-slo"] if r.status_code == 200 else []
            return found[0] if found else None

        dep = wait_until(deployment, 240, "the served train-with-slo deployment")
        runs_dir = tmp_path / "runs"
        flow_run = create_flow_run(api, dep["id"], {"request": {
            "workload": "transformer-lm", "workload_options": {"seq_len": 16},
            "slo": {"target_loss": 1.6, "deadline_s": 120}, "profile": str(profile),
            "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"]}, "filling": {"enabled": False},
            "drift_action": "automation", "drift_threshold": 0.05, "drift_window_s": 3,
            "artifacts_dir": str(runs_dir)}})
        run_id = f"run-{flow_run['id'].replace('-', '')[:10]}"

        def final():
            f = httpx.get(f"{api}/flow_runs/{flow_run['id']}", timeout=10).json()
            return f if f["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

        ended = wait_until(final, 600, "the run's verdict")
        assert ended["state"]["type"] in ("COMPLETED", "FAILED") and ended["state"]["message"].startswith("SLO "), ended["state"]

        def replan_runs():
            r = httpx.post(f"{api}/flow_runs/filter", json={"deployments": {"name": {"any_": ["replan-on-drift"]}}},
                           timeout=10)
            assert r.status_code == 200, r.text
            return [f for f in r.json() if f["parameters"]["resource_id"] == f"spotfill.run.{run_id}"]

        # the automation answers the first announcement whatever happens after it
        replans = wait_until(lambda: (found := replan_runs()) and all(f["state"]["type"] not in (
            "SCHEDULED", "PENDING", "RUNNING") for f in found) and found, 240, "the automation's re-plan runs to end")
        events = httpx.post(f"{api}/events/filter", timeout=10, json={
            "filter": {"event": {"name": ["spotfill.run.drift"]}, "resource": {"id": [f"spotfill.run.{run_id}"]}},
            "limit": 50}).json()
        announced = [e["payload"]["plan"] for e in events["events"]]
        assert announced and len(announced) == len(set(announced)) and events["total"] == len(announced), announced
        assert [f["state"]["type"] for f in replans] == ["COMPLETED"] * len(replans)
        assert len(replans) <= len(announced) and len({f["parameters"]["plan"] for f in replans}) == len(replans)

        run_dir = runs_dir / run_id
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["verdict"] == ended["state"]["message"]
        refits = [e["speed_ratio"] for e in summary["timeline"] if e["kind"] == "drift" and e["reason"] == "requested"]
        assert all(0 < r <= 1 for r in refits) and len(refits) <= len(replans)
        assert all(math.isfinite(p["predicted_time_s"]) for p in summary["plans"])
        assert math.isfinite(summary["predicted_time_s"]) and math.isfinite(summary["predicted_cost_usd"])
        wait_until(lambda: alive_pids(runs_dir) == [], 60, "no process left")
    finally:
        stop(served)
        serve_log.close()
