"""Capacity over time on the local provider (sleeping processes as instances): a drought from
the first revocation notice refuses spot launches and not on-demand ones; a trace's drop revokes
the excess spot instances only; the type's capacity is what it was once the trace ends."""
from __future__ import annotations

import json
import time

import pytest

from tasks.core.capacity import load_capacity
from tasks.providers.capacity_replay import drought
from tasks.providers.local import LocalProvider
from tests.helpers import sleeper_startup

pytestmark = pytest.mark.integration


@pytest.fixture()
def provider(tmp_path):
    p = LocalProvider(tmp_path, terminate_grace_s=2.0)
    yield p
    p.kill_all_started()


def _wait(predicate, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_drought_from_the_first_notice_refuses_spot_and_not_on_demand(provider):
    thread = provider.replay_capacity("r", "p3.2xlarge", drought("p3.2xlarge", 3600.0), 1.0, 5.0,
                                      from_first_notice=True)
    first = provider.launch("r", "p0", "p3.2xlarge", 2, startup=sleeper_startup())
    assert len(first.instances) == 2 and not first.refused  # no drought before the first notice
    provider.inject_revocation("r", first.instances[0].instance_id, 60.0)
    _wait(lambda: provider.capacity.get("p3.2xlarge") == 0)
    # the survivor is beyond a capacity of 0: it gets a notice too
    _wait(lambda: all(i.state == "notice" for i in provider.describe("r")))
    spot = provider.launch("r", "p1", "p3.2xlarge", 1, startup=sleeper_startup())
    assert spot.instances == [] and spot.refused["p3.2xlarge"].kind == "capacity"
    on_demand = provider.launch("r", "p1-od", "p3.2xlarge", 1, market="on-demand", startup=sleeper_startup())
    assert [i.market for i in on_demand.instances] == ["on-demand"] and not on_demand.refused
    provider.kill_all_started()
    thread.join(timeout=60)
    assert not thread.is_alive() and "p3.2xlarge" not in provider.capacity  # as before: unlimited


def test_a_drop_revokes_the_excess_spot_instances_and_the_capacity_returns(provider, tmp_path):
    path = tmp_path / "g3.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [3, 1, 0]}))
    provider.capacity["g3.8xlarge"] = 5
    spot = provider.launch("r", "p0", "g3.8xlarge", 3, startup=sleeper_startup()).instances
    on_demand = provider.launch("r", "p0-od", "g3.8xlarge", 2, market="on-demand", startup=sleeper_startup()).instances
    provider.replay_capacity("r", "g3.8xlarge", load_capacity(path), time_scale=6000.0, notice_s=30.0).join(timeout=60)
    notices = [e.instance_id for e in provider.poll_events("r") if e.kind == "revocation_notice"]
    assert sorted(notices) == sorted(i.instance_id for i in spot)  # 3 -> 1 -> 0: two, then the last
    assert {i.instance_id for i in provider.describe("r") if i.state == "running"} == {i.instance_id for i in on_demand}
    assert provider.capacity["g3.8xlarge"] == 5  # the trace ended: the capacity set before holds again


def test_a_capacity_replay_taken_over_plays_the_capacity_of_now_and_nothing_of_an_ended_trace(provider, tmp_path):
    """Begun 150 s ago by another orchestrator: of the steps already due (3, then 0, then 2) only
    the last is the market now, so one of three spot instances gets a notice, not all three.
    A trace that ended while no one played it changes nothing."""
    path = tmp_path / "g3.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [3, 0, 2, 2]}))
    spot = provider.launch("r", "p0", "g3.8xlarge", 3, startup=sleeper_startup()).instances
    provider.replay_capacity("r", "g3.8xlarge", load_capacity(path), time_scale=1.0, notice_s=30.0,
                             started_s=time.time() - 150.0)
    _wait(lambda: provider.capacity.get("g3.8xlarge") == 2 and any(i.state == "notice" for i in provider.describe("r")))
    notices = [e.instance_id for e in provider.poll_events("r") if e.kind == "revocation_notice"]
    assert notices == [spot[-1].instance_id]
    provider.kill_all_started()  # stops the replay, which restores the capacity
    _wait(lambda: "g3.8xlarge" not in provider.capacity)
    ended = LocalProvider(tmp_path / "ended")
    ended.launch("r", "p0", "g3.8xlarge", 3, startup=sleeper_startup())
    ended.replay_capacity("r", "g3.8xlarge", load_capacity(path), time_scale=1.0, notice_s=30.0,
                          started_s=time.time() - 1000.0).join(timeout=60)
    assert ended.poll_events("r") == [] and "g3.8xlarge" not in ended.capacity
    ended.kill_all_started()
