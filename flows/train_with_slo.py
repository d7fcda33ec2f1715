"""The main flow: profile -> fit -> plan -> launch (with filling) -> watch -> re-plan.

Thin on purpose: every step is a plain function in tasks/ (tasks/pipeline/session.py holds the
job's state); here they become Prefect tasks and subflows with caching, retries, a transaction
around the launch, progress artifacts and events.
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.context import FlowRunContext
from prefect.events import emit_event
from prefect.transactions import transaction

from tasks.pipeline import stages
from tasks.pipeline.params import TrainRequest
from tasks.pipeline.session import SpotCapacityError, TrainingSession
from tasks.providers.base import CapacityError

# Sessions of the runs this process drives, by run id: flow parameters must be plain data, so
# subflows receive the run id and find the session here.
SESSIONS: dict[str, TrainingSession] = {}


def _retry_on_spot_trouble(task, task_run, state) -> bool:
    """Retry only what a spot market does to us: interruptions and missing capacity."""
    try:
        state.result()
    except (SpotCapacityError, CapacityError):
        return True
    except Exception:
        return False
    return False


# ----------------------------------------------------------------------------- stages as tasks
@task(name="profile-type", cache_key_fn=stages.profile_cache_key, persist_result=True,
      retries=2, retry_condition_fn=_retry_on_spot_trouble)
def profile_type(request: TrainRequest, run_id: str, instance_type: str):
    return stages.profile_type(request, run_id, instance_type)


@task(name="profile-clusters", cache_key_fn=stages.clusters_cache_key, persist_result=True)
def profile_clusters(request: TrainRequest, run_id: str, measurements: list):
    return stages.profile_clusters(request, run_id, measurements)


@task(name="fit-model")
def fit_model(request: TrainRequest, measurements: list, clusters: list, run_dir: Path):
    return stages.fit_and_save(request, measurements, clusters, run_dir)


@task(name="plan")
def plan(run_id: str):
    session = SESSIONS[run_id]
    result = session.solve_or_fastest(session.plan_request(session.request.slo.deadline_s))
    session.plans.append(result)
    rows = stages.alternatives_rows(session)
    create_table_artifact(rows, key=f"{run_id}-plans", description="Chosen plan and the alternatives (predicted)")
    return result


@task(name="start-parameter-server")
def start_parameter_server(run_id: str) -> None:
    SESSIONS[run_id].start_parameter_server()


@task(name="launch-workers", retries=3, retry_delay_seconds=1, retry_condition_fn=_retry_on_spot_trouble)
def launch_workers(run_id: str, plan_id: str) -> dict[str, int]:
    """Launch the latest plan. A short launch lowers that type's quota to what the market gave and
    re-plans before raising, so the retry launches the new plan (under a new plan id: launches are
    idempotent per plan id, and only the difference to what runs is started)."""
    session = SESSIONS[run_id]
    try:
        return session.launch(session.plans[-1].plan, f"{plan_id}-{len(session.plans)}")
    except SpotCapacityError:
        session.plans.append(session.solve_or_fastest(session.plan_request(session.request.slo.deadline_s)))
        raise


@launch_workers.on_rollback
def _terminate_launched(txn) -> None:
    run_id = txn.get("run_id")
    SESSIONS[run_id].provider.cleanup(run_id)


@task(name="solve-replan")
def solve_replan(run_id: str, reason: str, leaving: list[str]):
    session = SESSIONS[run_id]
    return session.replan(reason, session.observations[-1], set(leaving))


# ----------------------------------------------------------------------------- subflows
@flow(name="replan", flow_run_name="replan-{run_id}-{reason}")
def replan_subflow(run_id: str, reason: str, leaving: list[str]) -> dict[str, int]:
    """Re-plan with the survivors, the remaining time and the loss reached; launch the takeover."""
    result = solve_replan(run_id, reason, leaving)
    emit_event(event="spotfill.run.replanned", resource={"prefect.resource.id": f"spotfill.run.{run_id}"},
               payload={"reason": reason, "plan": result.plan, "predicted_time_s": result.predicted_time_s})
    return result.plan


@flow(name="watch", flow_run_name="watch-{run_id}")
def watch(run_id: str, poll_s: float = 0.5) -> dict:
    """Poll telemetry and provider events until the target loss, the deadline, or a stop;
    re-plan on revocation notices and sustained drift."""
    logger = get_run_logger()
    session = SESSIONS[run_id]
    slo = session.request.slo
    loss_art = create_progress_artifact(0.0, key=f"{run_id}-loss", description="% of the way to the target loss")
    time_art = create_progress_artifact(0.0, key=f"{run_id}-deadline", description="% of the deadline spent")
    resource = {"prefect.resource.id": f"spotfill.run.{run_id}"}
    last_report = 0.0
    while True:
        obs = session.observe()
        stages.notify_progress(session, obs)
        notices = [e for e in obs.events if e.kind in ("revocation_notice", "revoked")]
        for event in notices:
            session.revocations += event.kind == "revocation_notice"
            stages.record_revocation(session, event)
            emit_event(event="spotfill.run.revocation", resource=resource,
                       payload={"instance_id": event.instance_id, "kind": event.kind})
            logger.info("revocation %s of %s at %.1f s", event.kind, event.instance_id, obs.t_s)
        if notices and not session.reached_target(obs):
            replan_subflow(run_id, "revocation", [e.instance_id for e in notices])
        ratio = session.check_drift(obs)
        if ratio is not None:
            emit_event(event="spotfill.run.drift", resource=resource,
                       payload={"speed_ratio": ratio, "artifacts_dir": session.request.artifacts_dir})
            logger.warning("drift: observed speed %.0f%% of predicted", 100 * ratio)
            if session.request.drift_action == "inline":
                session.refit_for_drift(ratio)
                replan_subflow(run_id, "drift", [])
        asked = stages.pending_replan_request(session)
        if asked is not None:
            if asked.get("speed_ratio"):
                session.refit_for_drift(float(asked["speed_ratio"]))
            replan_subflow(run_id, "requested", [])
        if time.time() - last_report >= 2.0:
            update_progress_artifact(loss_art, 100 * obs.loss_fraction)
            update_progress_artifact(time_art, 100 * obs.time_fraction)
            emit_event(event="spotfill.run.progress", resource=resource,
                       payload={"loss": obs.loss, "t_s": obs.t_s, "spent_usd": obs.spent_usd})
            last_report = time.time()
        if session.reached_target(obs) or obs.t_s >= slo.deadline_s or obs.stopped:
            update_progress_artifact(loss_art, 100 * obs.loss_fraction)
            update_progress_artifact(time_art, 100 * obs.time_fraction)
            return stages.outcome(session, obs)
        time.sleep(poll_s)


# ----------------------------------------------------------------------------- the main flow
def _cleanup_hook(flow, flow_run, state) -> None:
    """On cancellation or a crash, terminate everything the run started."""
    for session in list(SESSIONS.values()):
        session.provider.cleanup(session.run_id)


@flow(name="train-with-slo", on_cancellation=[_cleanup_hook], on_crashed=[_cleanup_hook])
def train_with_slo(request: TrainRequest) -> dict:
    """Reach request.slo.target_loss before request.slo.deadline_s at the lowest cost."""
    logger = get_run_logger()
    ctx = FlowRunContext.get()
    run_id = f"run-{(ctx.flow_run.id if ctx and ctx.flow_run else uuid.uuid4()).hex[:10]}"
    run_dir = Path(request.artifacts_dir) / run_id
    clock = stages.StageClock()
    provider, emulation = stages.make_provider(request)
    try:
        with clock("profile"):
            if request.profile:
                profile = stages.load_request_profile(request)
            else:
                measurements = profile_type.map(unmapped(request), unmapped(run_id), request.candidates.types).result()
                clusters = profile_clusters(request, run_id, measurements)
                profile = fit_model(request, measurements, clusters, run_dir)
        session = TrainingSession(request, profile, provider, run_id, run_dir,
                                  ps_megabits_per_s=emulation.get("ps_megabits_per_s"))
        SESSIONS[run_id] = session
        with clock("plan"):
            chosen = plan(run_id)
        logger.info("plan %s: predicted %.1f s, $%.4f", chosen.plan, chosen.predicted_time_s, chosen.predicted_cost_usd)
        with clock("launch"):
            with transaction() as txn:
                txn.set("run_id", run_id)
                start_parameter_server(run_id)
                launch_workers(run_id, "p0")
            stages.start_revocation_replay(session)
        with clock("train"):
            outcome = watch(run_id)
        with clock("stop"):
            session.stop()
        with clock("report"):
            summary = stages.write_report(session, outcome, clock)
        logger.info(summary["verdict"])
        return summary
    finally:
        provider.cleanup(run_id)
        SESSIONS.pop(run_id, None)
