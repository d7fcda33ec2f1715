"""The main flow's run as Prefect shows it (harness): bad input ends it Failed with one clear line."""
import pytest

from tests.helpers import LOCAL_QUICK_PROFILE

pytestmark = pytest.mark.integration


def test_an_unreachable_target_fails_the_run_with_one_line_naming_the_lowest_plannable(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    from flows.train_with_slo import run_summary, train_with_slo
    from tasks.core.errors import UserInputError
    from tasks.core.profile import load_profile
    from tasks.pipeline.params import TrainRequest

    gamma5 = load_profile(LOCAL_QUICK_PROFILE).loss.gamma5
    request = TrainRequest.model_validate({
        "workload": "transformer-lm", "workload_options": {"seq_len": 16},
        "slo": {"target_loss": 0.1, "deadline_s": 240}, "profile": str(LOCAL_QUICK_PROFILE),
        "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"], "quotas": {"p3.2xlarge": 2, "g3.8xlarge": 2}},
        "provider": {"name": "local"}, "artifacts_dir": str(tmp_path)})
    state = train_with_slo(request, return_state=True)
    expected = (f"loss target 0.1 is unreachable: the fitted loss curve never goes below gamma5 = {gamma5:.4g}; "
                f"the lowest target that can be planned is just above {gamma5:.4g}")
    assert (state.name, state.message) == ("Failed", expected)
    with pytest.raises(UserInputError, match="loss target 0.1 is unreachable"):
        run_summary(state)  # `spotfill run` exits 2 on it
    APILogWorker.drain_all(timeout=30)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    errors = [log.message for log in logs if log.level >= 40]
    assert errors == [expected]
    assert not any("Traceback" in log.message for log in logs)
    assert not list(tmp_path.glob("*/instances.json"))  # nothing was launched
