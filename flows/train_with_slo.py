"""The main flow: profile -> fit -> plan -> launch (with filling) -> watch -> re-plan.

Thin on purpose: every step is a plain function in tasks/ (tasks/pipeline/setup.py resolves the
request once, with the run's one provider; tasks/profiling/workflow.py profiles;
tasks/pipeline/session.py holds the job's state; tasks/pipeline/controller.py decides what the
watch loop does); here they become Prefect tasks with caching and retries, progress artifacts and
events on the run's own page, and the verdict as the final state's message (Completed: SLO met,
Failed: SLO missed). Tasks take the setup or the session as an argument and return values; the
crash and cancel hooks rebuild what they need from the flow run (its id and parameters), so they
work from whichever process Prefect runs them in.

A cancel ends the run at once. A crash (an unexpected error, or the flow's process killed) leaves
the run to its lease while the flow run has retries left: the retry, the same flow run and so the
same run id, re-attaches to the live run (reattach) instead of starting over. A verdict and a
refusal of bad input are final: they are never retried.
"""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.events import emit_event
from prefect.states import AwaitingRetry, Cancelled, Completed, Failed, State

from tasks.core.errors import UserInputError
from tasks.core.profile import Profile
from tasks.pipeline import journal, stages
from tasks.pipeline.controller import decide
from tasks.pipeline.params import TrainRequest
from tasks.pipeline.report import artifact_key, artifact_owner, stopped_report_markdown
from tasks.pipeline.session import TrainingSession
from tasks.pipeline.setup import RunSetup, open_setup
from tasks.planner import PlanResult
from tasks.profiling import workflow
from tasks.profiling.measurements import ClusterMeasurement, TypeMeasurement
from tasks.profiling.workflow import ProfilingJob

PROGRESS_REPORT_S = 2.0  # how often the progress artifacts and events are updated
FLOW_RETRIES = 2  # attempts after a crash, each re-attaching to the run its lease keeps alive
RETRY_DELAY_S = 5  # well inside the shortest sensible lease (Prefect keeps whole seconds)


# ----------------------------------------------------------------------------- stages as tasks
def retry_unless_refused(task, task_run, state) -> bool:
    """Retry a measurement that failed by chance; not one refused for a reason a retry keeps
    (bad input, a spot market short of the type): that error goes to the user at once."""
    try:
        state.result()
    except UserInputError:
        return False
    except Exception:  # noqa: BLE001 - any other failure may pass on a second try
        return True
    return True


def type_cache_key(context, parameters: dict) -> str:
    """One type's measurement is cached under the profiling's own key (tasks/profiling/workflow.py)."""
    return "profile-type-" + workflow.cache_key(parameters["setup"].profiling, [parameters["instance_type"]])


def clusters_cache_key(context, parameters: dict) -> str:
    job = parameters["setup"].profiling
    return "profile-clusters-" + workflow.cache_key(job, list(job.preset.types))


@task(name="profile-type", task_run_name="profile-{instance_type}", cache_key_fn=type_cache_key,
      persist_result=True, retries=2, retry_condition_fn=retry_unless_refused)
def profile_type(setup: RunSetup, run_id: str, instance_type: str) -> TypeMeasurement:
    return workflow.measure_type(setup.profiling, setup.provider, run_id, instance_type)


@task(name="profile-clusters", cache_key_fn=clusters_cache_key, persist_result=True)
def profile_clusters(setup: RunSetup, run_id: str, measurements: list) -> list[ClusterMeasurement]:
    return workflow.measure_clusters(setup.profiling, setup.provider, run_id, measurements)


@task(name="fit-model")
def fit_model(job: ProfilingJob, measurements: list, clusters: list, run_dir: Path) -> Profile:
    """Takes the job, not the setup: its inputs are hashed for the cache key, a provider cannot be."""
    _, fitted = workflow.fit_and_save(job, measurements, clusters, run_dir / "profile",
                                      workflow.measured_wall_s(measurements, clusters))
    return fitted.profile


@task(name="plan", cache_policy=NO_CACHE)
def plan(session: TrainingSession) -> PlanResult:
    result = session.first_plan()
    create_table_artifact(stages.alternatives_table(session.compare_alternatives()),
                          key=artifact_key(artifact_owner(), "plans"), description=f"{session.run_id}: chosen plan and the alternatives (predicted)")
    return result


@task(name="launch", cache_policy=NO_CACHE)
def launch(session: TrainingSession, chosen: PlanResult) -> PlanResult:
    """Start the parameter server and the plan's workers; what the market refuses is re-planned
    around (session.launch_plan). Returns the plan in effect. A failure terminates the lot."""
    try:
        session.start_parameter_server()
        launched = session.launch_plan(chosen, "p0")
        journal.save(session)
        return launched
    except BaseException:
        session.provider.cleanup(session.run_id)
        raise


@task(name="replan", cache_policy=NO_CACHE)
def replan(session: TrainingSession, reason: str, leaving: tuple[str, ...]) -> PlanResult:
    """Re-plan with the survivors, the remaining time and the loss reached; launch the takeover."""
    result = session.replan(reason, session.observations[-1], set(leaving))
    journal.save(session)
    emit_event(event="spotfill.run.replanned", resource=stages.event_resource(session),
               payload={"reason": reason, "plan": result.plan, "predicted_time_s": result.predicted_time_s})
    return result


# ----------------------------------------------------------------------------- watching
def watch(session: TrainingSession, poll_s: float = 0.5) -> dict:
    """Poll telemetry and provider events until the controller says the run is done, carrying
    out its re-plans and refits; progress artifacts and events go on the calling flow run."""
    logger = get_run_logger()
    run_id = session.run_id
    resource = stages.event_resource(session)
    owner = artifact_owner()
    loss_art = create_progress_artifact(0.0, key=artifact_key(owner, "loss"),
                                        description=f"{run_id}: % of the way to the target loss")
    time_art = create_progress_artifact(0.0, key=artifact_key(owner, "deadline"), description=f"{run_id}: % of the deadline spent")
    last_report = 0.0
    while True:
        if session.restart_dead_ps():
            journal.save(session)
            logger.warning("the parameter server died; restarted from its newest checkpoint (%d restart(s))",
                           session.ps_restarts)
        obs = session.observe()
        journal.append_observation(session.run_dir, obs)
        stages.notify_progress(session, obs)
        for event in obs.events:
            if event.kind in ("revocation_notice", "revoked"):
                session.record_revocation(event)
                emit_event(event="spotfill.run.revocation", resource=resource,
                           payload={"instance_id": event.instance_id, "kind": event.kind})
                logger.info("revocation %s of %s at %.1f s", event.kind, event.instance_id, obs.t_s)
        asked = stages.pending_replan_request(session)
        if asked is not None and not session.drift_hold.answers(asked):
            logger.info("re-plan request for plan %s dropped: plan %s is in effect", asked.get("plan"), session.drift_hold.plan)
        actions = decide(obs, target_loss=session.request.slo.curve_target, deadline_s=session.request.slo.deadline_s,
                         drift_action=session.request.drift_action, drift_ratio=session.check_drift(obs),
                         drift=session.drift_hold, asked=asked, plan_empty=not session.plans[-1].plan,
                         known_leaving=frozenset(session.leaving), probe_due=session.probe_due(obs.t_s))
        for action in actions:
            if action.kind == "done":
                update_progress_artifact(loss_art, 100 * obs.loss_fraction)
                update_progress_artifact(time_art, 100 * obs.time_fraction)
                return session.conclude(obs, action.reason)
            if action.kind == "announce-drift":
                session.record_drift("announced", action.speed_ratio)
                plan = session.drift_hold.announce()
                # the plan is a resource label too: the automation's trigger acts once per run and plan
                emit_event(event="spotfill.run.drift",
                           resource=resource | {"spotfill.drift-action": "automation", "spotfill.plan": str(plan)},
                           payload={"speed_ratio": action.speed_ratio, "plan": plan,
                                    "artifacts_dir": session.request.artifacts_dir})
                logger.warning("drift: progress at %.0f%% of the prediction; left to the automation (once for this plan)",
                               100 * action.speed_ratio)
            elif action.kind == "refit":
                session.record_drift(action.reason, action.speed_ratio)
                session.refit_for_drift(action.speed_ratio)
                logger.warning("drift (%s): refit at %.0f%% of the predicted speed", action.reason, 100 * action.speed_ratio)
            elif action.kind == "replan":
                replan(session, action.reason, action.leaving)
        if time.time() - last_report >= PROGRESS_REPORT_S:
            update_progress_artifact(loss_art, 100 * obs.loss_fraction)
            update_progress_artifact(time_art, 100 * obs.time_fraction)
            emit_event(event="spotfill.run.progress", resource=resource,
                       payload={"loss": obs.loss, "t_s": obs.t_s, "spent_usd": obs.spent_usd})
            stages.record_progress(session, obs)
            last_report = time.time()
        time.sleep(poll_s)


# ----------------------------------------------------------------------------- the main flow
def run_id_of(flow_run_id: uuid.UUID) -> str:
    """The run id (instance tags, artifacts folder) of a flow run: derived, so a hook in another
    process finds the same run."""
    return f"run-{flow_run_id.hex[:10]}"


def _stop_hook(flow, flow_run, state) -> None:
    """On cancellation, or a crash that leaves nothing to re-attach to, from the flow run alone:
    terminate everything the run started (the stateless cleanup) and report the time and money
    spent, as files and on the run's page. A crash while a cancel was under way (the runner's
    SIGTERM reached the flow's process before it could acknowledge the cancel, still starting,
    and Prefect recorded Crashed) is that cancel: reported as Cancelled, and the run set
    Cancelled at once. The flow's process and the runner
    may both run this hook for one stop: one report is written and published, by whichever comes
    first (stages.stop_and_report)."""
    request = TrainRequest.model_validate(flow_run.parameters["request"])
    with get_client(sync_client=True) as client:
        cancelled = cancel_under_way(client, flow_run, state)
        summary = stages.stop_and_report(request, run_id_of(flow_run.id), "Cancelled" if cancelled else state.name)
        if cancelled and state.is_crashed():
            client.set_flow_run_state(flow_run.id, Cancelled(message="Cancelled: the run's instances are terminated"),
                                      force=True)
        if summary is not None:
            publish_stopped_report(client, flow_run, summary)


def _crash_hook(flow, flow_run, state) -> None:
    """A crash (the flow's process killed, or ended by an error Prefect counts as a crash) with
    retries left, of a run that trains on under its lease: the run is left to its lease and the
    flow run scheduled again, so its retry (a worker or `serve` picks it up) re-attaches. Prefect
    retries only a Failed flow run by itself; a Crashed one is rescheduled here. Anything else
    (a cancel, no retry left, a run already ended) stops and reports as _stop_hook does."""
    request = TrainRequest.model_validate(flow_run.parameters["request"])
    with get_client(sync_client=True) as client:
        if (not cancel_under_way(client, flow_run, state) and retries_left(client.read_flow_run(flow_run.id))
                and stages.lives_on_its_lease(request, run_id_of(flow_run.id))):
            client.set_flow_run_state(flow_run.id, AwaitingRetry(
                scheduled_time=datetime.now(timezone.utc) + timedelta(seconds=RETRY_DELAY_S),
                message=f"{state.name}: the run trains on under its lease; the retry re-attaches"), force=True)
            return
    _stop_hook(flow, flow_run, state)


def cancel_under_way(client, flow_run, state) -> bool:
    return state.is_cancelling() or state.is_cancelled() or any(
        s.is_cancelling() for s in client.read_flow_run_states(flow_run.id))


def retries_left(flow_run) -> bool:
    """Whether Prefect would run this flow run again after this attempt (run_count counts attempts).
    Read the flow run from the API first: the copy a runner or a run context holds may predate
    the engine's setting of the flow's retries and the attempt's count."""
    retries = flow_run.empirical_policy.retries
    return retries is not None and flow_run.run_count <= retries


def refuse_retries(flow_run_id: uuid.UUID) -> None:
    """Make this attempt the flow run's last: a verdict (SLO missed is a Failed state) or a
    refusal of bad input would be the same on a retry, which Prefect makes of any Failed run."""
    with get_client(sync_client=True) as client:
        policy = client.read_flow_run(flow_run_id).empirical_policy
        client.update_flow_run(flow_run_id, empirical_policy=policy.model_copy(update={"retries": 0}))


def publish_stopped_report(client, flow_run, summary: dict) -> None:
    """The stopped run's report as a markdown artifact of its flow run, under its deployment's
    report key. Prefect runs the hooks in whichever process notices the stop (the runner or
    worker after a SIGKILL), where no run context names the flow run, so the artifact names it
    explicitly."""
    from prefect.client.schemas.actions import ArtifactCreate

    owner = client.read_deployment(flow_run.deployment_id).name if flow_run.deployment_id else train_with_slo.name
    client.create_artifact(ArtifactCreate(
        type="markdown", key=artifact_key(owner, "report"), description=summary["verdict"],
        data=stopped_report_markdown(summary), flow_run_id=flow_run.id))


def verdict_state(summary: dict) -> State:
    """The final state every Prefect view lists (the deployment's Runs tab filters by the standard
    state names): Completed when the SLO was met, Failed when missed; the verdict is its message,
    the summary its result, and the run gets the tag `slo-met` or `slo-missed` to filter by."""
    tag = "slo-met" if summary["met"] else "slo-missed"
    ctx = FlowRunContext.get()
    if ctx and ctx.flow_run:
        with get_client(sync_client=True) as client:
            client.update_flow_run(ctx.flow_run.id, tags=sorted({*ctx.flow_run.tags, tag}))
        if not summary["met"]:
            refuse_retries(ctx.flow_run.id)
    return (Completed if summary["met"] else Failed)(message=summary["verdict"], data=summary)


def run_summary(state: State) -> dict:
    """What a run of the flow reached: its summary if it has a verdict (met or missed); any
    other end raises what ended it (bad input, a crash)."""
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise result
    return result


def reattach(setup: RunSetup, run_dir: Path, explicit: bool) -> TrainingSession | None:
    """The session a run recorded, re-attached to its live PS (journal.py): what `--resume` asks
    for (`explicit`: a run that cannot be taken over is the user's error), and what a retry of
    the same flow run finds (a run that has ended is started anew)."""
    record = journal.load(run_dir)
    if record is None and not explicit:
        return None
    if record is None:
        raise UserInputError(f"{run_dir} holds no recorded session: that run cannot be resumed")
    try:
        return journal.restore(setup, run_dir, record)
    except UserInputError:
        if explicit:
            raise
        return None


@flow(name="train-with-slo", retries=FLOW_RETRIES, retry_delay_seconds=RETRY_DELAY_S,
      on_cancellation=[_stop_hook], on_crashed=[_crash_hook])
def train_with_slo(request: TrainRequest, resume_run_id: str | None = None):
    """Reach request.slo.target_loss (or its target_metric) before request.slo.deadline_s at the lowest cost. With
    `resume_run_id`, take over that live run instead of starting one (`spotfill run --resume`)."""
    logger = get_run_logger()
    ctx = FlowRunContext.get()
    run_id = resume_run_id or run_id_of(ctx.flow_run.id if ctx and ctx.flow_run else uuid.uuid4())
    run_dir = Path(request.artifacts_dir) / run_id
    clock = stages.StageClock()
    try:
        setup = open_setup(request)
    except UserInputError as exc:
        return refused(exc)
    left_to_lease = False
    try:
        resumed = reattach(setup, run_dir, explicit=resume_run_id is not None)
        if resumed is not None:
            logger.info("re-attached to run %s at %.1f s of training", run_id, resumed.elapsed_s())
            stages.start_revocation_replay(resumed)
            with clock("train"):
                outcome = watch(resumed)
            return finish(resumed, outcome, clock)
        with clock("profile"):
            if request.profile:
                profile = stages.load_request_profile(request)
            else:
                profiling_run_id = f"{run_id}-profile"
                measurements = profile_type.map(unmapped(setup), unmapped(profiling_run_id),
                                                request.candidates.types).result()
                clusters = profile_clusters(setup, profiling_run_id, measurements)
                profile = fit_model(setup.profiling, measurements, clusters, run_dir)
        profile.loss.require_reachable(request.slo.target_loss)
        session = TrainingSession(setup, profile, run_id, run_dir)
        with clock("plan"):
            chosen = plan(session)
        logger.info("plan %s: predicted %.1f s, $%.4f", chosen.plan, chosen.predicted_time_s, chosen.predicted_cost_usd)
        with clock("launch"):
            launched = launch(session, chosen)
            stages.start_revocation_replay(session)
        if launched.plan != chosen.plan:
            logger.warning("the market refused part of the plan; running %s instead", launched.plan)
        with clock("train"):
            outcome = watch(session)
        return finish(session, outcome, clock)
    except UserInputError as exc:
        return refused(exc)
    except Exception:  # noqa: BLE001 - a crash: Prefect retries it, and the retry re-attaches
        if ctx and ctx.flow_run:
            with get_client(sync_client=True) as client:
                left_to_lease = retries_left(client.read_flow_run(ctx.flow_run.id))
            left_to_lease = left_to_lease and stages.lives_on_its_lease(request, run_id)
        raise
    finally:
        if not left_to_lease:  # a cancel, Ctrl-C, the last attempt: everything ends at once
            setup.provider.cleanup(run_id)


def refused(exc: UserInputError) -> State:
    """Bad input (an unreachable target, a run that cannot be resumed, a setting no provider can
    start) ends the run Failed with one clear line, in its log and as its message, where Prefect
    would log a traceback, and is never retried (a retry would be refused the same); the error
    stays the result, so run_summary raises it (`spotfill run` exits 2 on it)."""
    ctx = FlowRunContext.get()
    if ctx and ctx.flow_run:
        refuse_retries(ctx.flow_run.id)
    get_run_logger().error("%s", exc)
    return Failed(message=str(exc), data=exc)


def finish(session: TrainingSession, outcome: dict, clock: stages.StageClock) -> State:
    """Stop the run and report it; its final state (verdict_state) carries the verdict."""
    with clock("stop"):
        session.stop()
    with clock("report"):
        summary = stages.write_report(session, outcome, clock)
    get_run_logger().info(summary["verdict"])
    return verdict_state(summary)
