"""The pipeline's stages as plain functions (the flow decorates nothing here): the given profile,
revocation replay, progress listeners, the alternatives' table, a stopped run's report and the
run's report. The run's setup is tasks/pipeline/setup.py; profiling is tasks/profiling/workflow.py."""
from __future__ import annotations

import contextlib
import fcntl
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tasks.core.atomic import atomic_write_json, atomic_write_text
from tasks.core.capacity import load_capacity
from tasks.core.errors import UserInputError
from tasks.core.profile import Profile, load_profile, profile_from_dict
from tasks.core.traces import trace_path
from tasks.pipeline import journal
from tasks.pipeline.params import TrainRequest, profiled_curve
from tasks.pipeline.report import finite_or_none, stopped_report_markdown, write_run_report
from tasks.pipeline.session import Observation, TrainingSession
from tasks.providers.capacity_replay import drought
from tasks.providers.cleanup import cleanup_run, running_instances

REPLAN_REQUEST = "replan-request.json"
REPLAN_REQUEST_LOCK = "replan-request.lock"  # serialises the re-plan deployment's writers of one run
PROGRESS = "progress.json"  # the latest poll's time, loss and spend: what a stopped run's report reads
STOP_REPORTED = "stop-reported"  # made by the first hook to report a stop, so a run has one stopped report

# Callables told of every observation (the CLI's progress bar listens here).
PROGRESS_LISTENERS: list[Callable[[TrainingSession, Observation], None]] = []


@dataclass
class StageClock:
    """Wall time per stage, to report the orchestration overhead."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


def load_request_profile(request: TrainRequest) -> Profile:
    """The given profile, narrowed to the candidate types (all of which it must describe)."""
    profile = load_profile(request.profile)
    missing = [t for t in request.candidates.types if t not in profile.type_names]
    if missing:
        raise UserInputError(f"profile {request.profile} does not describe {', '.join(missing)}")
    fitted_on = ((profile.model_extra or {}).get("provenance") or {}).get("settings", {}).get("curve")
    wanted = profiled_curve(request.slo).get("curve")
    if fitted_on != wanted:  # a loss curve is no prediction of a metric's, nor one metric's of another's
        raise UserInputError(f"profile {request.profile} was fitted on {fitted_on or 'the training loss'}, the run targets "
                             f"{wanted or 'the training loss'}: give a profile made for it, or no --profile to profile afresh")
    data = profile.model_dump()
    data["instances"] = [i for i in data["instances"] if i["type"] in request.candidates.types]
    for inst in data["instances"]:
        inst["quota"] = request.candidates.quota(inst["type"])
    return profile_from_dict(data, source=str(request.profile))


# ----------------------------------------------------------------------------- watching
def start_revocation_replay(session: TrainingSession) -> None:
    """Replay the requested revocations, capacity traces and droughts (local provider; AWS has
    its own market), on the run's clock from its launch. A session taken over (journal.restore)
    picks up where its record ends: what the last orchestrator played up to its last observation
    is not played again, what fell due while no one watched is played at once, the rest on time."""
    rev = session.request.provider.revocations
    provider = session.provider
    if session.request.provider.name != "local":
        return
    played_s = session.observations[-1].t_s if session.observations else 0.0
    if rev.trace:
        provider.replay_trace(session.run_id, trace_path(rev.trace), rev.time_scale, rev.notice_s,
                              instance_type=rev.trace_type, started_s=session.started_s, played_s=played_s)
    market = session.request.provider
    for instance_type, path in market.capacity_traces.items():
        provider.replay_capacity(session.run_id, instance_type, load_capacity(path), rev.time_scale, rev.notice_s,
                                 started_s=session.started_s)
    notices = [e.t_s for e in session.timeline if e.kind == "revocation" and e.detail["kind"] == "revocation_notice"]
    for instance_type, duration_s in market.droughts_s.items():  # from the run's first notice
        provider.replay_capacity(session.run_id, instance_type, drought(instance_type, duration_s), 1.0, rev.notice_s,
                                 from_first_notice=not notices,
                                 started_s=session.started_s + notices[0] if notices else None)
    for at_s in (t for t in rev.inject_at_s if t > played_s):
        def inject(at_s=at_s) -> None:
            victims = [i for i in provider.describe(session.run_id)  # on-demand workers are never revoked
                       if i.role == "worker" and i.market == "spot" and i.state == "running"]
            if victims:
                provider.inject_revocation(session.run_id, victims[-1].instance_id, rev.notice_s)

        timer = threading.Timer(max(0.0, at_s - session.elapsed_s()), inject)
        timer.daemon = True
        timer.start()


def event_resource(session: TrainingSession) -> dict:
    """The run as a Prefect event resource (what the drift automation matches)."""
    return {"prefect.resource.id": f"spotfill.run.{session.run_id}",
            "spotfill.drift-action": session.request.drift_action}


def record_progress(session: TrainingSession, obs: Observation) -> None:
    """Where the run stands, on disk, so that a run stopped from outside can still be accounted
    for, with the instances running (what a stop ends) and the timeline so far, and a run left by
    its orchestrator taken over (journal.py)."""
    journal.save(session)
    atomic_write_json(session.run_dir / PROGRESS, finite_or_none({
        "t_s": obs.t_s, "loss": obs.loss, "spent_usd": obs.spent_usd, "ps_spent_usd": obs.ps_spent_usd,
        "workers": obs.workers, "plan": session.plans[-1].plan if session.plans else {},
        "replans": session.replans, "revocations": session.revocations, "shortfalls": session.shortfalls,
        "instances": sorted(i.instance_id for i in session.provider.describe(session.run_id)),
        "timeline": [{"t_s": e.t_s, "kind": e.kind, **e.detail} for e in session.timeline]}))


def stop_and_report(request: TrainRequest, run_id: str, state_name: str) -> dict | None:
    """A run cancelled or crashed: terminate what it started (the stateless cleanup) and write
    its report from the last progress on disk: how long it ran, what it spent, the instances the
    stop ended (those running at the last progress, whoever ended them: this cleanup, or the
    provider's own signal handler first) and the timeline. One stop may call this twice (the
    flow's process and the runner both run a hook): each terminates what is left, the first
    writes the report and returns it, a later one returns None."""
    artifacts = Path(request.artifacts_dir)
    terminated, _ = cleanup_run(request.provider.name, run_id, artifacts_dir=artifacts,
                                aws_config={**request.provider.aws, "region": request.provider.region})
    run_dir = artifacts / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        (run_dir / STOP_REPORTED).open("x").close()  # exclusive: one report whichever hook comes first
    except FileExistsError:
        return None
    try:
        last = json.loads((run_dir / PROGRESS).read_text())
    except (OSError, json.JSONDecodeError):
        last = {"t_s": 0.0, "loss": None, "spent_usd": 0.0, "ps_spent_usd": 0.0}
    ended = max(terminated, len(last.get("instances", [])))
    verdict = (f"Run {state_name.lower()} after {last['t_s']:.1f} s of training: {request.slo.state_text(last['loss'])}; "
               f"spent ${last['spent_usd']:.4f} on workers plus "
               f"${last['ps_spent_usd']:.4f} for the PS; {ended} instance(s) ended at the stop")
    summary = {"run_id": run_id, "state": state_name, "verdict": verdict, "met": False, **last,
               "ended_at_stop": ended}
    atomic_write_json(run_dir / "summary.json", summary)
    atomic_write_text(run_dir / "report.md", stopped_report_markdown(summary))
    return summary


def lives_on_its_lease(request: TrainRequest, run_id: str) -> bool:
    """Whether a run whose orchestrator crashed trains on by itself, so that a retry of its flow
    run can take it over (journal.restore): it recorded a session with a leased parameter server,
    its lease has not lapsed, and that PS still runs. A run ended at once (Ctrl-C, a cancel, a
    failure cleaned up) or never launched does not."""
    from tasks.runtime.driver import lease_place  # deferred: torch (start-up cost)
    from tasks.runtime.lease import expiry_s

    run_dir = Path(request.artifacts_dir) / run_id
    record = journal.load(run_dir)
    attached = None if record is None else record["run"]
    if attached is None or attached["lease_s"] is None:
        return False
    expires_at_s = expiry_s(lease_place(run_dir, attached["ps_settings"].get("durable_url")))
    if expires_at_s is None or expires_at_s <= time.time():
        return False
    running = {i.instance_id for i in running_instances(
        request.provider.name, run_id, artifacts_dir=Path(request.artifacts_dir),
        aws_config={**request.provider.aws, "region": request.provider.region})}
    return set(attached["ps_instance_ids"]) <= running


def notify_progress(session: TrainingSession, obs: Observation) -> None:
    for listener in PROGRESS_LISTENERS:
        listener(session, obs)


def ask_for_replan(run_dir: Path, plan: int) -> tuple[Path, int]:
    """Leave the run's watch loop a request to re-plan `plan` (what the drift automation's
    deployment does), one writer of a run at a time (an flock that waits its turn). A request
    that arrives late never replaces one for a newer plan still waiting: requests for several runs
    may run side by side and in any order, and the newest plan's request is the one kept.
    Returns the request file and the plan it now names."""
    with open(run_dir / REPLAN_REQUEST_LOCK, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        path = run_dir / REPLAN_REQUEST
        try:
            waiting = json.loads(path.read_text()).get("plan")
        except (FileNotFoundError, json.JSONDecodeError, AttributeError):
            waiting = None
        if isinstance(waiting, int) and waiting >= plan:
            return path, waiting
        return atomic_write_json(path, {"reason": "drift", "plan": plan}), plan


def pending_replan_request(session: TrainingSession) -> dict | None:
    """A re-plan asked for from outside (the drift automation's deployment writes this file),
    taken once; it names the plan it answers, and the controller drops it if that plan was
    re-planned since."""
    path = session.run_dir / REPLAN_REQUEST
    try:
        asked = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    path.unlink(missing_ok=True)
    return asked


def alternatives_table(rows: list[dict]) -> list[dict]:
    """The chosen plan and the alternatives (session.compare_alternatives) as a table artifact's rows."""
    return [{"plan": r["name"], "instances": ", ".join(f"{n} x {t}" for t, n in sorted(r["plan"].items())) or "-",
             "predicted time (s)": None if r["predicted_time_s"] is None else round(r["predicted_time_s"], 1),
             "predicted cost ($)": None if r["predicted_cost_usd"] is None else round(r["predicted_cost_usd"], 4),
             "status": r["status"]} for r in rows]


def write_report(session: TrainingSession, result: dict, clock: StageClock) -> dict:
    return write_run_report(session, result, clock.seconds)
