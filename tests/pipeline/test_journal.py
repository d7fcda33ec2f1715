"""What a run records for a take-over (tasks/pipeline/journal.py): the session comes back whole
and re-attached to its live PS, or not at all, with the reason in one line."""
from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from tasks.core.errors import UserInputError
from tasks.core.profile import load_profile
from tasks.pipeline import journal
from tasks.pipeline.params import TrainRequest
from tasks.pipeline.session import Observation, TimelineEntry, TrainingSession
from tasks.pipeline.setup import resolve_setup
from tasks.providers.base import Instance, ProviderEvent
from tasks.runtime import lease
from tasks.runtime.driver import TrainingRun
from tests.helpers import SHIPPED_PROFILE

PS = Instance("local-r-0000", "p3.2xlarge", "ps", "on-demand", "running", "r", "ps", "127.0.0.1", 1.0)


class StubProvider:
    """What a take-over asks of a provider: the run's live instances (none is started)."""

    def __init__(self, alive: list[Instance]):
        self.alive = alive

    def describe(self, run_id: str) -> list[Instance]:
        return self.alive


def recorded_session(tmp_path) -> TrainingSession:
    profile = load_profile(SHIPPED_PROFILE)
    request = TrainRequest.model_validate({"slo": {"target_loss": 1.2, "deadline_s": 600},
                                           "candidates": {"types": profile.type_names}, "lease_s": 30})
    session = TrainingSession(resolve_setup(request), profile, "r", tmp_path)
    session.first_plan()
    session.plans.append(replace(session.plans[0], status="infeasible", predicted_time_s=float("inf")))
    session.started_s = 1000.0
    session.timeline.append(TimelineEntry(3.0, "revocation", {"instance_id": "w1", "kind": "revocation_notice"}))
    session.revocations, session.leaving = 1, {"w1"}
    session.cost.advance(1000.0, 0.0)
    session.cost.advance(1360.0, 2.0)  # $0.20 so far
    session.run = TrainingRun("r", tmp_path, None, "127.0.0.1:5000", PS, "resnet20", {"width": 4},
                              {"max_updates": None}, ps_instances=[PS], lease_s=30.0)
    return session


def observation(t_s: float) -> Observation:
    return Observation(t_s, 2.0, 10, 640, {"p3.2xlarge": 2}, 0.2, 0.05, 0.3, 0.1,
                       events=[ProviderEvent("revoked", "w1", 5.0)])


def test_a_recorded_session_comes_back_whole_and_attached(tmp_path):
    before = recorded_session(tmp_path)
    journal.save(before)
    for t_s in (1.0, 2.0):
        journal.append_observation(tmp_path, observation(t_s))
    with open(tmp_path / journal.OBSERVATIONS_FILE, "a") as f:
        f.write('{"t_s": 3.0, "lo')  # torn by a kill mid-write
    lease.renew(tmp_path / lease.LEASE_FILE, 30.0)
    setup = replace(resolve_setup(before.request), provider=StubProvider([PS]))
    after = journal.restore(setup, tmp_path, journal.load(tmp_path))
    assert after.plans == before.plans and after.timeline == before.timeline
    assert after.cost == before.cost and after.cost.spent_usd == pytest.approx(0.2)
    assert (after.revocations, after.leaving, after.started_s) == (1, {"w1"}, 1000.0)
    assert [o.t_s for o in after.observations] == [1.0, 2.0] and after.observations[0].events == []
    assert after.run.ps_address == "127.0.0.1:5000" and after.run.ps_instances == [PS]
    assert lease.owner_pid(tmp_path / lease.LEASE_FILE) == os.getpid()
    assert journal.recorded_request(tmp_path) == before.request


def test_a_run_that_has_ended_or_is_still_watched_is_not_taken_over(tmp_path):
    session = recorded_session(tmp_path)
    journal.save(session)
    setup = replace(resolve_setup(session.request), provider=StubProvider([PS]))
    path = tmp_path / lease.LEASE_FILE
    lease.renew(path, 30.0, now_s=0.0)  # lapsed long ago: the PS has stopped
    with pytest.raises(UserInputError, match="no longer running"):
        journal.restore(setup, tmp_path, journal.load(tmp_path))
    lease.renew(path, 30.0)
    with pytest.raises(UserInputError, match="no longer running"):  # the PS is gone
        journal.restore(replace(setup, provider=StubProvider([])), tmp_path, journal.load(tmp_path))
    path.write_text(path.read_text().replace(f'"owner_pid": {os.getpid()}', f'"owner_pid": {os.getppid()}'))
    with pytest.raises(UserInputError, match=f"still watched by process {os.getppid()}"):
        journal.restore(setup, tmp_path, journal.load(tmp_path))


def test_no_record_no_resume(tmp_path):
    assert journal.load(tmp_path) is None
    with pytest.raises(UserInputError, match="holds no recorded session"):
        journal.recorded_request(tmp_path)


class ReplayRecorder:
    """A local provider's replay entry points, recorded (nothing is played)."""

    def __init__(self):
        self.calls = []

    def replay_trace(self, run_id, path, time_scale, notice_s, **kw):
        self.calls.append(("trace", kw))

    def replay_capacity(self, run_id, instance_type, trace, time_scale, notice_s, **kw):
        self.calls.append(("capacity", kw))


def test_a_taken_over_runs_revocation_replays_pick_up_where_its_record_ends(tmp_path, monkeypatch):
    """Launched 100 s ago, last observed at 50 s, first notice at 20 s: the trace skips its first
    50 s, the drought runs from that notice, a revocation due at 30 s is not injected again, the
    one at 60 s (missed) is injected at once, the one at 500 s on time."""
    from tasks.pipeline import stages

    profile = load_profile(SHIPPED_PROFILE)
    request = TrainRequest.model_validate({
        "slo": {"target_loss": 1.2, "deadline_s": 600}, "candidates": {"types": profile.type_names},
        "provider": {"name": "local", "droughts_s": {"p3.2xlarge": 40.0}, "revocations": {
            "trace": "bamboo_aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23.csv", "inject_at_s": [30, 60, 500]}}})
    recorder = ReplayRecorder()
    session = TrainingSession(replace(resolve_setup(request), provider=recorder), profile, "r", tmp_path)
    session.started_s = time.time() - 100.0
    session.observations = [observation(10.0), observation(50.0)]
    session.timeline.append(TimelineEntry(20.0, "revocation", {"instance_id": "w1", "kind": "revocation_notice"}))
    timers = []

    class RecordedTimer:  # the injections' timers: their delays, nothing started
        def __init__(self, delay_s, action):
            timers.append(delay_s)

        def start(self):
            pass

    monkeypatch.setattr(stages.threading, "Timer", RecordedTimer)
    stages.start_revocation_replay(session)
    assert recorder.calls == [("trace", {"instance_type": None, "started_s": session.started_s, "played_s": 50.0}),
                              ("capacity", {"from_first_notice": False, "started_s": session.started_s + 20.0})]
    assert timers[0] == 0.0 and timers[1] == pytest.approx(400.0, abs=5.0) and len(timers) == 2
