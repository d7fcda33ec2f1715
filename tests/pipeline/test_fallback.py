"""The live run's on-demand fallback, without processes: on-demand workers counted as their
`TYPE:on-demand` offers, what a plan starts on each market and releases, when the replacements
have joined, when spot is tried again, and the session's plans under a floor spot cannot reach."""
from types import SimpleNamespace

import pytest

from tasks.pipeline.controller import Action, decide
from tasks.pipeline.fallback import all_joined, hardware_counts, offer_counts, takeover_by_market, to_release
from tasks.pipeline.params import TrainRequest
from tasks.pipeline.session import TrainingSession
from tasks.pipeline.setup import resolve_setup
from tasks.pipeline.stages import load_request_profile
from tasks.pipeline.watch import DriftHold
from tasks.providers.base import Instance
from tasks.runtime.telemetry import ClusterProgress, WorkerStats
from tests.helpers import LOCAL_QUICK_PROFILE, observation


def worker(n: int, instance_type: str, market: str = "spot") -> Instance:
    return Instance(f"i-{n}", instance_type, "worker", market, "running", "r", "p0", launched_at_s=float(n))


ALIVE = [worker(1, "g3.8xlarge"), worker(2, "g3.8xlarge"), worker(3, "p3.2xlarge", "on-demand"),
         worker(4, "p3.2xlarge", "on-demand"), Instance("i-ps", "p3.2xlarge", "ps", "on-demand", "running", "r", "ps")]


def test_on_demand_workers_are_counted_as_their_twin_offers():
    assert offer_counts(ALIVE) == {"g3.8xlarge": 2, "p3.2xlarge:on-demand": 2}
    assert hardware_counts(offer_counts(ALIVE)) == {"g3.8xlarge": 2, "p3.2xlarge": 2}


def test_a_plan_starts_each_market_apart_and_releases_the_newest_on_demand_workers():
    plan = {"g3.8xlarge": 2, "p3.2xlarge": 1, "p3.2xlarge:on-demand": 1}
    assert takeover_by_market(plan, ALIVE) == {"spot": {"p3.2xlarge": 1}, "on-demand": {}}
    assert [i.instance_id for i in to_release(plan, ALIVE)] == ["i-4"]
    assert [i.instance_id for i in to_release({"g3.8xlarge": 2}, ALIVE)] == ["i-3", "i-4"]
    more = {"g3.8xlarge": 2, "p3.2xlarge:on-demand": 3, "g3.8xlarge:on-demand": 1}
    assert takeover_by_market(more, ALIVE) == {"spot": {}, "on-demand": {"p3.2xlarge": 1, "g3.8xlarge": 1}}
    assert to_release(more, ALIVE) == []


def test_release_waits_until_every_worker_alive_has_pushed_an_update():
    progress = ClusterProgress(workers={0: WorkerStats("g3.8xlarge", updates=5), 1: WorkerStats("p3.2xlarge", updates=0),
                                        2: WorkerStats("p3.2xlarge", updates=9, left="revoked")})
    assert not all_joined(progress, 2)
    progress.workers[1].updates = 1
    assert all_joined(progress, 2)


def test_the_controller_probes_spot_in_the_same_replan_as_a_revocation():
    from tasks.providers.base import ProviderEvent

    args = dict(target_loss=1.5, deadline_s=60.0, drift_action="inline", drift_ratio=None, drift=DriftHold(),
                asked=None, plan_empty=False)
    assert decide(observation(), **args | {"probe_due": True}) == [Action("replan", "probe")]
    notice = ProviderEvent("revocation_notice", "i-1", 0.0, 2.0)
    assert decide(observation(events=[notice]), **args | {"probe_due": True}) == [Action("replan", "revocation+probe", ("i-1",))]
    assert decide(observation(loss=1.4), **args | {"probe_due": True}) == [Action("done", "target")]


def _session(tmp_path, alive: list[Instance], **candidates) -> TrainingSession:
    request = TrainRequest.model_validate({
        "workload": "transformer-lm", "slo": {"target_loss": 1.7, "deadline_s": 60}, "profile": str(LOCAL_QUICK_PROFILE),
        "candidates": {"types": ["p3.2xlarge", "g3.8xlarge"], "quotas": {"p3.2xlarge": 2, "g3.8xlarge": 2},
                       "min_workers": 3} | candidates, "artifacts_dir": str(tmp_path)})
    session = TrainingSession(resolve_setup(request), load_request_profile(request), "r", tmp_path / "r")
    session.provider = SimpleNamespace(describe=lambda run_id: alive)
    return session


def test_a_spot_type_refused_below_the_floor_is_planned_on_demand_and_probed_again(tmp_path):
    session = _session(tmp_path, ALIVE[:2], on_demand_quota={"p3.2xlarge": 2}, spot_probe_s=10.0)
    assert session.quota == {"p3.2xlarge": 2, "g3.8xlarge": 2, "p3.2xlarge:on-demand": 2}
    session.quota["p3.2xlarge"] = 0  # the market refused it (session.launch lowers the quota so)
    replanned = session.decide_replan("capacity", 10.0, 2.5)
    assert replanned.plan == {"g3.8xlarge": 2, "p3.2xlarge:on-demand": 1}
    assert not session.probe_due(9.9) and session.probe_due(10.0)  # a spot quota below the request's
    probed = session.decide_replan("probe", 10.0, 2.5)  # spot quotas back: spot is safe again
    assert probed.plan == {"g3.8xlarge": 2, "p3.2xlarge": 1} and session.quota["p3.2xlarge"] == 2
    assert session.last_probe_s == 10.0 and not session.probe_due(15.0)


def test_without_an_on_demand_quota_plans_are_spot_only_and_spot_is_never_probed(tmp_path):
    session = _session(tmp_path, ALIVE[:2])
    session.quota["p3.2xlarge"] = 0
    replanned = session.decide_replan("capacity", 10.0, 2.5)
    assert replanned.plan == {"g3.8xlarge": 2} and not session.probe_due(1e6)


@pytest.mark.parametrize("spent, on_demand, shown", [(0.02, 0.0, False), (0.02, 0.015, True)])
def test_the_report_shows_on_demand_workers_and_their_cost_apart(spent, on_demand, shown):
    from tasks.pipeline.report import on_demand_markdown

    workers = [{"instance_id": "i-3", "type": "p3.2xlarge", "launched_t_s": 9.5, "released_t_s": None,
                "why": "capacity"}] if shown else []
    lines = "\n".join(on_demand_markdown({"on_demand_workers": workers, "spent_usd": spent,
                                          "spot_spent_usd": spent - on_demand, "on_demand_spent_usd": on_demand}))
    assert ("$0.0050 spot, $0.0150 on-demand" in lines and "| i-3 | p3.2xlarge | 9.5 | at the end | capacity |" in lines
            if shown else lines == "")
