"""What a run records as it goes, so that another orchestrator can take it over (`spotfill run
--resume RUN_ID`, a Prefect retry of the same flow run): the session's state in <run_dir>/session.json
(rewritten atomically after each launch, re-plan and progress report) and every poll in
<run_dir>/observations.jsonl (appended; a torn last line, from a kill mid-write, is skipped).
`restore` rebuilds the TrainingSession from them and re-attaches it to the live parameter
server: plans, spend, revocations, timeline and observations carry on, so cost, timeline and
report cover the whole run.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.atomic import atomic_write_text
from tasks.core.errors import UserInputError
from tasks.core.profile import Profile
from tasks.pipeline.params import TrainRequest
from tasks.pipeline.session import Observation, TimelineEntry, TrainingSession
from tasks.planner import PlanResult
from tasks.providers.base import ProviderEvent

if TYPE_CHECKING:
    from tasks.pipeline.setup import RunSetup

SESSION_FILE = "session.json"
OBSERVATIONS_FILE = "observations.jsonl"

# plain fields of TrainingSession copied as they are (JSON values)
_PLAIN = ("started_s", "alternatives", "initial_loss", "replans", "revocations", "ps_restarts", "shortfalls",
          "on_demand_workers", "last_probe_s", "replan_reason", "quota", "spot_quota", "ps_type")


def save(session: TrainingSession) -> None:
    """The session's state, atomically (observations go to the append-only file)."""
    run = session.run
    record = {
        "run_id": session.run_id,
        "request": session.request.model_dump(mode="json"),
        "profile": session.profile.model_dump(mode="json"),
        **{name: getattr(session, name) for name in _PLAIN},
        "plans": [asdict(p) for p in session.plans],
        "started_plan": None if session.started_plan is None else asdict(session.started_plan),
        "timeline": [asdict(e) for e in session.timeline],
        "meters": {name: asdict(getattr(session, name)) for name in ("cost", "ps_cost", "on_demand_cost")},
        "leaving": sorted(session.leaving),
        "releasing": list(session.releasing),
        "progress_origin": list(session.progress_origin),
        "run": None if run is None else {
            "ps_address": run.ps_address, "ps_instance_ids": [i.instance_id for i in run.ps_instances or [run.ps_instance]],
            "workload": run.workload, "workload_options": run.workload_options, "ps_settings": run.ps_settings,
            "lease_s": run.lease_s},
    }
    # Infinity allowed: an infeasible plan's predicted time is one (Python's json reads it back)
    atomic_write_text(session.run_dir / SESSION_FILE, json.dumps(record, indent=1))


def append_observation(run_dir: Path, obs: Observation) -> None:
    line = json.dumps({**asdict(obs), "events": []})  # the events are on the timeline already
    with open(run_dir / OBSERVATIONS_FILE, "a") as f:
        f.write(line + "\n")


def load(run_dir: Path) -> dict | None:
    """The recorded session of the run in `run_dir`, or None when it recorded none."""
    try:
        return json.loads((run_dir / SESSION_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise UserInputError(f"{run_dir / SESSION_FILE} cannot be read ({str(err)[:80]}): the run cannot be resumed") from None


def recorded_request(run_dir: Path) -> TrainRequest:
    record = load(run_dir)
    if record is None:
        raise UserInputError(f"{run_dir} holds no recorded session: that run cannot be resumed")
    return TrainRequest.model_validate(record["request"], context={"local_user": True})


def observations(run_dir: Path) -> list[Observation]:
    out = []
    try:
        lines = (run_dir / OBSERVATIONS_FILE).read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            fields = json.loads(line)
        except ValueError:  # torn by a kill mid-write
            continue
        out.append(Observation(**{**fields, "events": [ProviderEvent(**e) for e in fields["events"]]}))
    return out


def restore(setup: RunSetup, run_dir: Path, record: dict) -> TrainingSession:
    """The session `record` describes, attached to its live parameter server (the lease is
    renewed at once). A run whose PS has ended cannot be taken over: UserInputError."""
    from tasks.runtime.driver import attach_run  # deferred: torch (start-up cost)

    run_id = record["run_id"]
    session = TrainingSession(setup, Profile.model_validate(record["profile"]), run_id, run_dir)
    for name in _PLAIN:
        setattr(session, name, record[name])
    session.plans = [PlanResult(**p) for p in record["plans"]]
    session.started_plan = None if record["started_plan"] is None else PlanResult(**record["started_plan"])
    session.timeline = [TimelineEntry(**e) for e in record["timeline"]]
    for name, meter in record["meters"].items():
        getattr(session, name).__dict__.update(meter)
    session.leaving = set(record["leaving"])
    session.releasing = (list(record["releasing"][0]), record["releasing"][1])
    session.progress_origin = tuple(record["progress_origin"])
    session.observations = observations(run_dir)
    attached = record["run"]
    if attached is None:
        raise UserInputError(f"run {run_id} had not started its parameter server: there is nothing to resume")
    session.run = attach_run(setup.provider, run_id, run_dir, attached["ps_address"], attached["ps_instance_ids"],
                             attached["workload"], attached["workload_options"], attached["ps_settings"],
                             attached["lease_s"])
    return session
