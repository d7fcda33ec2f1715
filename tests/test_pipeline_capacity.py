"""A spot market without capacity for the planned type: the session lowers that type's quota to
what the market gave and the next plan avoids it (real processes on the local provider)."""
import pytest

from tasks.pipeline.params import TrainRequest
from tasks.pipeline.session import SpotCapacityError, TrainingSession
from tasks.pipeline.stages import load_request_profile, make_provider
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_short_launch_lowers_the_quota_and_the_next_plan_avoids_the_type(tmp_path):
    request = TrainRequest.model_validate({
        "workload": "transformer-lm", "workload_options": {"seq_len": 16},
        "slo": {"target_loss": 1.7, "deadline_s": 120},
        "profile": str(REPO / "profiles" / "transformer-lm-local-quick.json"),
        "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"]}, "filling": {"enabled": False},
        "artifacts_dir": str(tmp_path)})
    provider, emulation = make_provider(request)
    session = TrainingSession(request, load_request_profile(request), provider, "run-capacity", tmp_path / "run-capacity",
                              ps_megabits_per_s=emulation["ps_megabits_per_s"])
    try:
        first = session.solve_or_fastest(session.plan_request(request.slo.deadline_s))
        short = next(iter(first.plan))
        provider.capacity[short] = 0  # the emulated market has none of the planned type now
        session.start_parameter_server()
        with pytest.raises(SpotCapacityError):
            session.launch(first.plan, "p0-1")
        assert session.quota[short] == 0
        second = session.solve_or_fastest(session.plan_request(request.slo.deadline_s))
        assert short not in second.plan and second.plan
        assert session.launch(second.plan, "p0-2") == second.plan
        assert session.running_workers() == second.plan
        assert any(e.kind == "capacity" for e in session.timeline)
    finally:
        session.stop()
    assert provider.describe("run-capacity") == []
