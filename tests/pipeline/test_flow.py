"""The main flow through the Prefect engine, on the local provider (real processes)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import LOCAL_QUICK_PROFILE, REPO, SHIPPED_PROFILE, alive_pids

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROFILE = str(LOCAL_QUICK_PROFILE)
TYPES = ["p3.2xlarge", "g3.8xlarge"]


def request(tmp_path, **patch):
    from tasks.pipeline.params import TrainRequest

    base = {
        "workload": "transformer-lm", "workload_options": {"seq_len": 16},
        "slo": {"target_loss": 1.7, "deadline_s": 240}, "profile": PROFILE,
        "candidates": {"types": TYPES, "quotas": {"p3.2xlarge": 2, "g3.8xlarge": 2}},
        "provider": {"name": "local", "revocations": {"inject_at_s": [6.0], "notice_s": 1.0}},
        "overhead_s": 5.0, "artifacts_dir": str(tmp_path),
    }
    return TrainRequest.model_validate(base | patch)


def test_flow_survives_a_revocation_and_meets_its_slo(prefect_harness, tmp_path, providers_built):
    from prefect.client.orchestration import get_client

    from flows.train_with_slo import run_summary, train_with_slo

    state = train_with_slo(request(tmp_path), return_state=True)
    summary = run_summary(state)
    assert len(providers_built) == 1  # the run's setup's, used by every stage
    assert summary["met"], summary["verdict"]
    assert summary["verdict"].startswith("SLO met")
    # a standard final state (every Prefect view lists it), the verdict its message, a tag to filter by
    assert (state.type.value, state.name, state.message) == ("COMPLETED", "Completed", summary["verdict"])
    with get_client(sync_client=True) as client:
        assert "slo-met" in client.read_flow_run(state.state_details.flow_run_id).tags
    assert summary["revocations"] >= 1 and summary["replans"] >= 1
    replan = next(e for e in summary["timeline"] if e["kind"] == "replan")
    assert replan["reason"] == "revocation"
    run_dir = Path(summary["report_dir"])
    for name in ("summary.json", "report.md", "timeline.png"):
        assert (run_dir / name).stat().st_size > 0
    assert summary["stage_seconds"]["train"] > 0 and summary["orchestration_overhead_s"] >= 0
    assert summary["inference"]["workers"] >= 1 and summary["inference"]["offline_samples"] > 0
    assert alive_pids(tmp_path) == []


def test_bad_parameters_are_a_validation_error_and_launch_nothing(prefect_harness, tmp_path):
    from prefect.exceptions import ParameterTypeError

    from flows.train_with_slo import train_with_slo

    bad = request(tmp_path).model_dump()
    bad["slo"]["deadline_s"] = -5
    with pytest.raises(ParameterTypeError, match="deadline_s"):
        train_with_slo(request=bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, env, message", [
    (["--types", "p3.2xlarge,p3.2xlarge"], {}, "candidate types repeat"),
    (["--types", "p3.2xlarge,g4dn.4xlarge"], {}, "have different NICs"),
    ([], {"SPOTFILL_FILL_CONFIG": "{bad"}, "SPOTFILL_FILL_CONFIG: not valid JSON"),
    ([], {"SPOTFILL_FILL_CONFIG": '{"max_batch": "x"}'}, "fill config from SPOTFILL_FILL_CONFIG: max_batch"),
    ([], {"SPOTFILL_FILL_CONFIG": '{"slo_s": 0.5, "slo_s": 0.1}'}, "key 'slo_s' is given twice"),
    ([], {"SPOTFILL_FILL_CONFIG": '{"seed": -1}'}, "fill config from SPOTFILL_FILL_CONFIG: seed"),
    ([], {"PREFECT_API_URL": "http://[::1"}, "PREFECT_API_URL='http://[::1': malformed endpoint URL"),
    ([], {"SPOTFILL_PS_BIND": "nowhere"}, "SPOTFILL_PS_BIND='nowhere' is not an IP address"),
    ([], {"PREFECT_API_URL": "127.0.0.1:4200/api"}, "PREFECT_API_URL='127.0.0.1:4200/api': endpoint URL must be"),
    (["--profile", str(SHIPPED_PROFILE)], {}, "was measured for workload 'resnet110-cifar100'"),
    (["--provider", "aws", "--profile", PROFILE, "--trace", ""], {}, "an AWS run needs a checkpoint bucket"),
    (["--provider", "aws", "--profile", PROFILE, "--trace", "", "--checkpoint-bucket", "ckpts"],
     {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_CONFIG_FILE": "/nonexistent",
      "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true"}, "no AWS credentials found"),
])
def test_cli_bad_parameters_exit_2_before_a_server_or_a_process_starts(tmp_path, argv, env, message):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | env
    r = subprocess.run([sys.executable, "-m", "tasks.cli.main", "run", *argv, "--artifacts", str(tmp_path)], cwd=REPO,
                       env=environment, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert list(tmp_path.iterdir()) == []  # no Prefect server's log, no run folder


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_run_leaves_no_process(tmp_path, sig, status):
    """Ctrl-C or SIGTERM mid-training ends the whole run at once (the lease is for a run left
    unwatched); under Prefect's SIGTERM handler, the flow's own cleanup ends the instances."""
    env = os.environ | {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.cli.main", "run", "--profile", PROFILE, "--types", ",".join(TYPES),
         "--loss", "1.5", "--deadline", "600", "--trace", "", "--no-filling", "--artifacts", str(tmp_path)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900  # a hang guard: a loaded machine starts Prefect and the run slowly
        while time.monotonic() < deadline and proc.poll() is None and len(alive_pids(tmp_path)) < 2:
            time.sleep(0.5)  # until the PS and a worker run
        assert len(alive_pids(tmp_path)) >= 2, f"the run never started its instances (exit {proc.poll()})"
        proc.send_signal(sig)
        assert proc.wait(timeout=300) == status  # a hang guard: on a loaded machine the shutdown's Prefect calls are slow too
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1.0)
    assert alive_pids(tmp_path) == []
