"""A spot market short of capacity, during the first launch and during a replacement: the session
lowers the refused type's quota to what runs, re-plans with what runs and launches the
difference; the run ends "SLO met" or "SLO missed" with the shortfall in its report, never a
crash. On the local provider (real processes) and on AWS through moto's server."""
import json
import time
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
           "candidate_types": ["g4dn.2xlarge", "g4dn.12xlarge"], "on_demand_usd_per_h": {"c5.xlarge": 0.17},
           "checkpoint_bucket": "spotfill-checkpoints"}
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


ON_DEMAND_ALLOWED = {"types": ["p3.2xlarge", "g3.8xlarge"], "quotas": {"p3.2xlarge": 2, "g3.8xlarge": 2},
                     "min_workers": 3, "on_demand_quota": {"p3.2xlarge": 2}}


def test_a_drought_moves_a_worker_to_on_demand_and_back_to_spot_once_capacity_returns(tmp_path):
    request = local_request(tmp_path, candidates=ON_DEMAND_ALLOWED)
    setup = open_setup(request)
    provider = setup.provider
    session = TrainingSession(setup, load_request_profile(request), "run-fallback", tmp_path / "run-fallback")
    try:
        first = session.first_plan()
        assert first.plan == {"p3.2xlarge": 1, "g3.8xlarge": 2}  # spot alone is safe
        provider.capacity["p3.2xlarge"] = 0  # a drought: the spot market has no p3.2xlarge now
        session.start_parameter_server()
        fallback = session.launch_plan(first, "p0")
        assert fallback.plan == {"p3.2xlarge:on-demand": 1, "g3.8xlarge": 2}
        assert session.running_workers() == fallback.plan
        assert [i.market for i in provider.describe("run-fallback") if i.type == "p3.2xlarge" and i.role == "worker"] \
            == ["on-demand"]
        del provider.capacity["p3.2xlarge"]  # capacity returns; the next probe finds it
        back = session.replan("probe", session.observe())
        assert back.plan == {"p3.2xlarge": 1, "g3.8xlarge": 2} and session.releasing[0]
        deadline_s = time.monotonic() + 120
        while session.releasing[0]:  # released once every worker alive, the new spot one too, trains
            assert time.monotonic() < deadline_s, "the on-demand worker was never released"
            session.observe()
            time.sleep(0.1)
        assert session.running_workers() == {"p3.2xlarge": 1, "g3.8xlarge": 2}
        moves = [(e.detail["action"], e.detail["why"]) for e in session.timeline if e.kind == "on-demand"]
        assert moves[0][0] == "launch" and "the spot market has 0 free" in moves[0][1]
        assert moves[1] == ("release", "back to spot")
        assert session.on_demand_workers[0]["released_t_s"] is not None
    finally:
        session.stop()
    assert provider.describe("run-fallback") == []


def test_a_run_through_a_drought_shows_its_on_demand_workers_and_their_cost(prefect_harness, tmp_path):
    from flows.train_with_slo import train_with_slo

    request = local_request(tmp_path, candidates=ON_DEMAND_ALLOWED, provider={
        "name": "local", "droughts_s": {"p3.2xlarge": 600.0},
        "revocations": {"inject_at_s": [4.0], "notice_s": 2.0}})
    summary = train_with_slo(request)
    assert summary["verdict"].startswith(("SLO met", "SLO missed")), summary["verdict"]
    revoked = [e for e in summary["timeline"] if e["kind"] == "revocation_notice"]
    workers = summary["on_demand_workers"]
    assert revoked and workers and {w["type"] for w in workers} == {"p3.2xlarge"}
    assert summary["on_demand_spent_usd"] > 0
    assert summary["spot_spent_usd"] + summary["on_demand_spent_usd"] == pytest.approx(summary["spent_usd"])
    report = (Path(summary["report_dir"]) / "report.md").read_text()
    assert "## On-demand workers" in report and "on-demand worker(s) (p3.2xlarge) cost $" in summary["verdict"]
    assert alive_pids(tmp_path) == []


def test_on_demand_twins_launch_on_the_on_demand_market_on_aws(moto_endpoint, moto_amis, tmp_path):
    """moto over HTTP: a plan's TYPE:on-demand workers are on-demand instances (no spot request),
    counted back under their twin names and priced at the on-demand rate."""
    from tasks.runtime.driver import TrainingRun

    types = ["g4dn.2xlarge", "g4dn.12xlarge"]
    aws = {"endpoint_url": moto_endpoint, "ami_ids": moto_amis, "spot_price_archive": str(PRICE_ARCHIVE),
           "candidate_types": types, "on_demand_usd_per_h": {"c5.xlarge": 0.17},
           "checkpoint_bucket": "spotfill-checkpoints"}
    request = TrainRequest.model_validate({
        "workload": "transformer-lm", "slo": {"target_loss": 0.8, "deadline_s": 6000.0},
        "candidates": {"types": types, "quotas": {"g4dn.2xlarge": 4, "g4dn.12xlarge": 1},
                       "on_demand_quota": {"g4dn.2xlarge": 2}},
        "provider": {"name": "aws", "aws": aws}, "overhead_s": 30.0, "artifacts_dir": str(tmp_path)})
    setup = open_setup(request)
    provider = setup.provider
    run_id = f"od-{uuid.uuid4().hex[:8]}"
    session = TrainingSession(setup, t4_profile(setup.offered, {"g4dn.2xlarge": 4, "g4dn.12xlarge": 1}), run_id,
                              tmp_path / run_id)
    ps = provider.launch(run_id, "ps", "c5.xlarge", 1, role="ps", market="on-demand").instances[0]
    session.run = TrainingRun(run_id, tmp_path / run_id, provider, "10.0.0.1:29500", ps, "transformer-lm")
    plan = {"g4dn.2xlarge": 1, "g4dn.2xlarge:on-demand": 2}
    try:
        launched = session.launch(plan, "p0")
        assert sorted((i.type, i.market) for i in launched.instances) == [
            ("g4dn.2xlarge", "on-demand"), ("g4dn.2xlarge", "on-demand"), ("g4dn.2xlarge", "spot")]
        assert session.running_workers() == plan
        offered = setup.offered["g4dn.2xlarge"]
        assert session.workers_usd_per_h(plan) == pytest.approx(offered.spot_usd_per_h + 2 * offered.on_demand_usd_per_h)
        assert [e.detail["action"] for e in session.timeline if e.kind == "on-demand"] == ["launch"]
    finally:
        provider.cleanup(run_id)
