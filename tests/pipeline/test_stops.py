"""What the pipeline does at its edges: a stopped run's report on its flow run's page, profiling
on a market short of a type, a profile measured with sharded parameter servers."""
import json

import pytest

from tasks.pipeline.params import TrainRequest
from tests.helpers import LOCAL_QUICK_PROFILE, alive_pids

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def request(tmp_path, **patch) -> TrainRequest:
    return TrainRequest.model_validate({
        "workload": "transformer-lm", "workload_options": {"seq_len": 16},
        "slo": {"target_loss": 1.7, "deadline_s": 120}, "profile": str(LOCAL_QUICK_PROFILE),
        "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"]}, "filling": {"enabled": False},
        "artifacts_dir": str(tmp_path)} | patch)


def test_a_cancel_seen_as_a_crash_ends_cancelled_with_one_report_on_its_flow_run(prefect_harness, tmp_path):
    """A cancel's SIGTERM may reach a flow's process still starting as a crash; that hook and the
    runner's cancellation hook both run, with no run context. One report lands on the flow run,
    under the deployment's (here the flow's) key: cancelled, with the time, spend, plan and
    timeline the run's last progress had reached and the instances running then counted as ended
    (whoever ended them); the run ends Cancelled."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.states import Cancelling, Crashed

    from flows.train_with_slo import _stop_hook, run_id_of, train_with_slo

    r = request(tmp_path)
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run(train_with_slo, parameters={"request": r.model_dump(mode="json")})
        run_dir = tmp_path / run_id_of(flow_run.id)
        run_dir.mkdir()
        (run_dir / "progress.json").write_text(json.dumps({
            "t_s": 12.5, "loss": 1.93, "spent_usd": 0.0012, "ps_spent_usd": 0.0021, "workers": {"g3.8xlarge": 2},
            "plan": {"g3.8xlarge": 2, "p3.2xlarge": 1}, "replans": 1, "revocations": 1, "shortfalls": [],
            "instances": ["i-0", "i-1", "i-2", "i-3"],
            "timeline": [{"t_s": 0.0, "kind": "plan", "plan": {"g3.8xlarge": 2}},
                         {"t_s": 6.2, "kind": "revocation", "instance_id": "i-2", "kind_of": "revocation_notice"}]}))
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
        _stop_hook(train_with_slo, client.read_flow_run(flow_run.id), Crashed(message="aborted by a termination signal"))
        _stop_hook(train_with_slo, client.read_flow_run(flow_run.id), Cancelling())
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
        final = client.read_flow_run(flow_run.id).state
    assert [a.key for a in artifacts] == ["train-with-slo-report"]
    assert (final.type.value, final.name) == ("CANCELLED", "Cancelled")
    report = artifacts[0].data
    assert "Run cancelled after 12.5 s of training: loss 1.9300" in report and "4 instance(s) ended at the stop" in report
    assert "plan in effect: 2 x g3.8xlarge + 1 x p3.2xlarge" in report and "re-plans: 1" in report
    assert "| 6.2 | revocation |" in report
    assert report == (run_dir / "report.md").read_text()
    assert json.loads((run_dir / "summary.json").read_text())["state"] == "Cancelled"


def test_profiling_on_a_market_short_of_a_type_says_so_and_leaves_nothing(tmp_path):
    from tasks.pipeline.setup import open_setup
    from tasks.profiling.measurements import ProfilingError
    from tasks.profiling.workflow import measure_type

    setup = open_setup(request(tmp_path, profile=None, provider={"name": "local", "capacity": {"g3.8xlarge": 0}}))
    with pytest.raises(ProfilingError, match=r"profiling needs 1 x g3.8xlarge and the spot market refused 1 "
                                             r"\(g3.8xlarge: the spot market has 0 free, asked 1\)"):
        measure_type(setup.profiling, setup.provider, "run-short", "g3.8xlarge")
    assert alive_pids(tmp_path) == []


def test_a_refused_profiling_launch_is_not_retried(prefect_harness, tmp_path, providers_built):
    """A retry would be refused the same way: the flow fails at once with the market's answer.
    Its profiling tasks, one per type, used the run's one provider."""
    from flows.train_with_slo import train_with_slo

    r = request(tmp_path, profile=None, provider={"name": "local", "capacity": {"g3.8xlarge": 0}})
    state = train_with_slo(r, return_state=True)
    assert state.is_failed() and "spot market refused" in state.message
    logs = sorted(tmp_path.glob("run-*-profile-g3.8xlarge/logs/*.log"))
    assert len(logs) == 1  # one attempt's parameter server, no retry's
    assert alive_pids(tmp_path) == []
    assert len(providers_built) == 1


def test_a_profile_measured_with_sharded_parameter_servers_runs_that_many(tmp_path):
    from tasks.pipeline.session import TrainingSession
    from tasks.pipeline.setup import open_setup
    from tasks.pipeline.stages import load_request_profile

    sharded = json.loads(LOCAL_QUICK_PROFILE.read_text()) | {"num_ps": 2}
    path = tmp_path / "sharded.json"
    path.write_text(json.dumps(sharded))
    r = request(tmp_path, profile=str(path))
    setup = open_setup(r)
    provider = setup.provider
    session = TrainingSession(setup, load_request_profile(r), "run-k2", tmp_path / "run-k2")
    try:
        session.start_parameter_server()
        assert [i.role for i in provider.describe("run-k2")] == ["ps", "ps"]
        assert session.run.ps_settings["num_ps"] == 2 and len(session.run.ps_address.split(",")) == 2
        assert session.ps_usd_per_h == 2 * next(t.on_demand_usd_per_h for t in provider.list_types()
                                                if t.name == session.ps_type)
    finally:
        session.stop()
    assert provider.describe("run-k2") == []
