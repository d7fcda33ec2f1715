"""A spot market short of capacity, during the first launch and during a replacement: the session
lowers the refused type's quota to what runs, re-plans with what runs and launches the
difference; the run ends "SLO met" or "SLO missed" with the shortfall in its report, never a
crash. On the local provider (real processes) and on AWS through moto's server."""
import json
import uuid
from pathlib import Path

import pytest

from tasks.pipeline.params import TrainRequest
from tasks.pipeline.session import TrainingSession
from tasks.pipeline.setup import open_setup
from tasks.pipeline.stages import load_request_profile
from tests.helpers import LOCAL_QUICK_PROFILE, PRICE_ARCHIVE, alive_pids, t4_profile

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PROFILE = str(LOCAL_QUICK_PROFILE)


def local_request(tmp_path, **patch) -> TrainRequest:
    return TrainRequest.model_validate({
        "workload": "transformer-lm", "workload_options": {"seq_len": 16},
        "slo": {"target_loss": 1.7, "deadline_s": 120}, "profile": PROFILE,
        "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"]}, "filling": {"enabled": False},
        "overhead_s": 5.0, "artifacts_dir": str(tmp_path)} | patch)


def test_a_first_launch_short_of_capacity_is_replanned_and_the_difference_launched(tmp_path):
    request = local_request(tmp_path)
    setup = open_setup(request)
    provider = setup.provider
    session = TrainingSession(setup, load_request_profile(request), "run-capacity", tmp_path / "run-capacity")
    try:
        first = session.first_plan()
        short = next(iter(first.plan))
        provider.capacity[short] = 0  # the emulated market has none of the planned type now
        session.start_parameter_server()
        final = session.launch_plan(first, "p0")
        assert session.quota[short] == 0 and short not in final.plan and final.plan
        assert session.running_workers() == final.plan
        assert session.started_plan is final and session.replans == 1
        assert [e.kind for e in session.timeline] == ["capacity", "replan"]
        assert session.shortfalls == [{"type": short, "kind": "capacity", "missing": first.plan[short],
                                       "why": session.shortfalls[0]["why"]}]
    finally:
        session.stop()
    assert provider.describe("run-capacity") == []


@pytest.mark.parametrize("capacity, outcome", [
    ({"g3.8xlarge": 1}, "replaced"),  # no second g3.8xlarge while the revoked one is on notice: p3.2xlarge takes over
    ({"g3.8xlarge": 1, "p3.2xlarge": 0}, "none left"),  # nothing to replace it with: a clear miss
])
def test_a_replacement_short_of_capacity_ends_with_a_verdict_not_a_crash(prefect_harness, tmp_path, capacity, outcome):
    from flows.train_with_slo import run_summary, train_with_slo

    request = local_request(tmp_path, provider={
        "name": "local", "capacity": capacity, "revocations": {"inject_at_s": [4.0], "notice_s": 2.0}})
    summary = run_summary(train_with_slo(request, return_state=True))
    assert summary["verdict"].startswith(("SLO met", "SLO missed")), summary["verdict"]
    assert "the market refused" in summary["verdict"] and "g3.8xlarge" in summary["verdict"]
    assert {s["type"] for s in summary["shortfalls"]} >= {"g3.8xlarge"}
    replans = [e for e in summary["timeline"] if e["kind"] == "replan"]
    assert summary["replans"] == len(replans) == len(summary["plans"]) - 1 >= 2
    assert [e["reason"] for e in replans[:2]] == ["revocation", "capacity"]
    if outcome == "replaced":
        assert summary["final_plan"].get("p3.2xlarge", 0) >= 1 and "g3.8xlarge" not in summary["final_plan"]
    else:
        assert summary["final_plan"] == {} and not summary["met"] and summary["ended"] == "no workers"
    report = (Path(summary["report_dir"]) / "report.md").read_text()
    assert "capacity" in report and summary["verdict"] in report
    assert alive_pids(tmp_path) == []


def test_a_type_short_on_aws_is_replanned_around(moto_endpoint, moto_amis, tmp_path):
    """moto over HTTP, with EC2 answering InsufficientInstanceCapacity for one type."""
    from botocore.exceptions import ClientError

    from tasks.providers.aws import TAG_RUN
    from tasks.runtime.driver import TrainingRun

    aws = {"endpoint_url": moto_endpoint, "ami_ids": moto_amis, "spot_price_archive": str(PRICE_ARCHIVE),
           "candidate_types": ["g4dn.2xlarge", "g4dn.12xlarge"], "on_demand_usd_per_h": {"c5.xlarge": 0.17}}
    types = ["g4dn.2xlarge", "g4dn.12xlarge"]
    request = TrainRequest.model_validate({
        "workload": "transformer-lm", "slo": {"target_loss": 0.8, "deadline_s": 6000.0},
        "candidates": {"types": types, "quotas": {"g4dn.2xlarge": 4, "g4dn.12xlarge": 1}},
        "provider": {"name": "aws", "aws": aws}, "overhead_s": 30.0, "artifacts_dir": str(tmp_path)})
    setup = open_setup(request)
    provider = setup.provider
    profile = t4_profile(setup.offered, {"g4dn.2xlarge": 4, "g4dn.12xlarge": 1})
    run_id = f"cap-{uuid.uuid4().hex[:8]}"
    session = TrainingSession(setup, profile, run_id, tmp_path / run_id)
    ps = provider.launch(run_id, "ps", "c5.xlarge", 1, role="ps", market="on-demand").instances[0]
    session.run = TrainingRun(run_id, tmp_path / run_id, provider, "10.0.0.1:29500", ps, "transformer-lm")

    first = session.first_plan()
    short = max(first.plan, key=first.plan.get)

    def no_capacity(params=None, **_):  # what EC2 answers when the type's pool is empty
        if params.get("InstanceType") == short:
            raise ClientError({"Error": {"Code": "InsufficientInstanceCapacity", "Message": "none"}}, "RunInstances")

    provider.ec2.meta.events.register("before-parameter-build.ec2.RunInstances", no_capacity)
    try:
        final = session.launch_plan(first, "p0")
        assert short not in final.plan and final.plan and session.quota[short] == 0
        assert session.running_workers() == final.plan and session.replans == 1
        assert session.shortfalls[0]["type"] == short and "InsufficientInstanceCapacity" in session.shortfalls[0]["why"]
    finally:
        provider.cleanup(run_id)
    left = provider.ec2.describe_instances(Filters=[
        {"Name": f"tag:{TAG_RUN}", "Values": [run_id]}, {"Name": "instance-state-name", "Values": ["pending", "running"]}])
    assert left["Reservations"] == []
    json.dumps(session.shortfalls)  # plain data, for the report
