"""The pipeline's stages as plain functions (the flow decorates nothing here): provider set-up,
profiling and fitting with cache keys, revocation replay, progress listeners, the outcome and
its report."""
from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tasks.core.errors import UserInputError
from tasks.pipeline.params import TrainRequest
from tasks.pipeline.session import Observation, TimelineEntry, TrainingSession
from tasks.core.profile import Profile, load_profile, profile_from_dict
from tasks.providers.base import Provider, ProviderEvent

REPLAN_REQUEST = "replan-request.json"
PROGRESS = "progress.json"  # the latest poll's time, loss and spend: what a stopped run's report reads

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


def profiling_preset(request: TrainRequest):
    """The profiling preset (tasks/profiling/presets.py) narrowed to this request's workload and
    candidate types: how long to profile, and how the local provider emulates the network."""
    from collections import Counter
    from dataclasses import replace

    from tasks.profiling.presets import preset

    p = preset(request.profiling)
    types = tuple(request.candidates.types)
    fit_clusters = p.fit_clusters
    if not all(set(c) <= set(types) for c in fit_clusters):  # the preset's clusters use other types
        # the same shapes, on the request's first and last type (merged when there is one)
        rename = {p.types[0]: types[0], p.types[-1]: types[-1]}
        renamed = [dict(sum((Counter({rename[t]: n}) for t, n in c.items()), Counter())) for c in p.fit_clusters]
        fit_clusters = tuple(c for k, c in enumerate(renamed) if c not in renamed[:k])
    budget = {"cluster_budget_s": request.profile_budget_s} if request.profile_budget_s else {}
    return replace(p, workload=request.workload, workload_options=dict(request.workload_options), types=types,
                   fit_clusters=fit_clusters, **budget)


def aws_config(request: TrainRequest):
    """The run's AwsConfig: its `provider.aws` fields, region and budget caps (one line per bad field)."""
    from tasks.providers.aws import load_aws_config

    settings = request.provider
    return load_aws_config({**settings.aws, "region": settings.region, "max_instances": request.budget.max_instances,
                            "max_usd_per_hour": request.budget.max_usd_per_h})


def make_provider(request: TrainRequest) -> tuple[Provider, dict]:
    """The provider, and the emulation settings of a local one ({} on AWS): the same settings the
    profile is measured under, so that what is predicted is what runs."""
    settings = request.provider
    emulation: dict = {}
    if settings.name == "local":
        from tasks.profiling.presets import local_provider

        provider, emulation = local_provider(profiling_preset(request), Path(request.artifacts_dir))
        provider.capacity.update(settings.capacity)
    else:
        from tasks.providers.aws import AwsProvider

        provider = AwsProvider(aws_config(request))
    offered = {t.name for t in provider.list_types()}
    missing = [t for t in request.candidates.types if t not in offered]
    if missing:
        raise UserInputError(f"the {settings.name} provider does not offer {', '.join(missing)}")
    return provider, emulation


def load_request_profile(request: TrainRequest) -> Profile:
    """The given profile, narrowed to the candidate types (all of which it must describe)."""
    profile = load_profile(request.profile)
    missing = [t for t in request.candidates.types if t not in profile.type_names]
    if missing:
        raise UserInputError(f"profile {request.profile} does not describe {', '.join(missing)}")
    data = profile.model_dump()
    data["instances"] = [i for i in data["instances"] if i["type"] in request.candidates.types]
    for inst in data["instances"]:
        inst["quota"] = request.candidates.quota(inst["type"])
    return profile_from_dict(data, source=str(request.profile))


# ----------------------------------------------------------------------------- profiling
def profile_type(request: TrainRequest, run_id: str, instance_type: str):
    from tasks.profiling.single import profile_type as measure

    p = profiling_preset(request)
    provider, emulation = make_provider(request)
    try:
        return measure(provider, f"{run_id}-profile-{instance_type}", request.workload, instance_type,
                       iterations=p.iterations, workload_options=request.workload_options,
                       batch_per_gpu=p.batch_per_gpu, ps_megabits_per_s=emulation.get("ps_megabits_per_s"))
    finally:
        provider.cleanup(f"{run_id}-profile-{instance_type}")


def profile_clusters(request: TrainRequest, run_id: str, measurements: list):
    from tasks.profiling.clusters import profile_clusters as measure

    p = profiling_preset(request)
    provider, emulation = make_provider(request)
    try:
        return measure(provider, f"{run_id}-clusters", request.workload, measurements, list(p.fit_clusters),
                       duration_s=p.cluster_duration_s, workload_options=request.workload_options,
                       ps_megabits_per_s=emulation.get("ps_megabits_per_s"), side_by_side=p.clusters_side_by_side,
                       budget_s=p.cluster_budget_s, async_rule=request.async_rule)
    finally:
        provider.cleanup(f"{run_id}-clusters")


def profile_cache_key(context, parameters: dict) -> str:
    """Single-type profiles are cached by workload (and options), type, provider, profiling
    settings and code version (tasks.profiling.store.cache_key)."""
    from tasks.profiling.store import cache_key

    r: TrainRequest = parameters["request"]
    return "profile-type-" + cache_key(r.workload, [parameters["instance_type"]], r.workload_options,
                                       {"provider": r.provider.name, "preset": r.profiling})


def clusters_cache_key(context, parameters: dict) -> str:
    from tasks.profiling.store import cache_key

    r: TrainRequest = parameters["request"]
    return "profile-clusters-" + cache_key(r.workload, r.candidates.types, r.workload_options,
                                           {"provider": r.provider.name, "preset": r.profiling,
                                            "budget_s": r.profile_budget_s, "async_rule": r.async_rule})


def fit_and_save(request: TrainRequest, measurements: list, clusters: list, run_dir: Path) -> Profile:
    from tasks.profiling.fit import fit_profile
    from tasks.profiling.store import RawMeasurements, provenance, save_profile

    from tasks.profiling.clusters import check_target_profiled

    check_target_profiled(clusters, request.slo.target_loss)  # before planning on the curve
    quotas = {t: request.candidates.quota(t) for t in request.candidates.types}
    fitted = fit_profile(request.workload, measurements, clusters, quotas=quotas)
    wall = {f"type:{m.type}": m.wall_s for m in measurements} | {"clusters_total": max(c.wall_s for c in clusters)}
    info = provenance(request.provider.name, list(request.candidates.types), request.workload_options,
                      {"preset": request.profiling}, wall)
    save_profile(fitted, RawMeasurements(measurements, clusters), directory=run_dir / "profile", provenance_info=info)
    return fitted.profile


# ----------------------------------------------------------------------------- watching
def start_revocation_replay(session: TrainingSession) -> None:
    """Replay the requested revocations (local provider; AWS revokes by itself)."""
    rev = session.request.provider.revocations
    provider = session.provider
    if session.request.provider.name != "local":
        return
    if rev.trace:
        from tasks.core.traces import trace_path

        provider.replay_trace(session.run_id, trace_path(rev.trace), rev.time_scale, rev.notice_s,
                              instance_type=rev.trace_type)
    for at_s in rev.inject_at_s:
        def inject(at_s=at_s) -> None:
            victims = [i for i in provider.describe(session.run_id)
                       if i.role == "worker" and i.state == "running"]
            if victims:
                provider.inject_revocation(session.run_id, victims[-1].instance_id, rev.notice_s)

        timer = threading.Timer(at_s, inject)
        timer.daemon = True
        timer.start()


def event_resource(session: TrainingSession) -> dict:
    """The run as a Prefect event resource (what the drift automation matches)."""
    return {"prefect.resource.id": f"spotfill.run.{session.run_id}",
            "spotfill.drift-action": session.request.drift_action}


def record_drift(session: TrainingSession, action) -> None:
    session.timeline.append(TimelineEntry(session.elapsed_s(), "drift",
                                          {"reason": action.reason, "speed_ratio": action.speed_ratio}))


def record_progress(session: TrainingSession, obs: Observation) -> None:
    """Where the run stands, on disk, so that a run stopped from outside can still be accounted for."""
    from tasks.core.atomic import atomic_write_json

    atomic_write_json(session.run_dir / PROGRESS, {
        "t_s": obs.t_s, "loss": obs.loss, "spent_usd": obs.spent_usd, "ps_spent_usd": obs.ps_spent_usd,
        "workers": obs.workers, "plan": session.plans[-1].plan if session.plans else {},
        "replans": session.replans, "revocations": session.revocations, "shortfalls": session.shortfalls})


def stop_and_report(request: TrainRequest, run_id: str, state_name: str) -> dict:
    """A run cancelled or crashed: terminate what it started (the stateless cleanup) and write
    its report from the last progress on disk: how long it ran and what it spent."""
    from tasks.core.atomic import atomic_write_json, atomic_write_text
    from tasks.providers.cleanup import cleanup_run
    from tasks.pipeline.report import stopped_report_markdown

    artifacts = Path(request.artifacts_dir)
    terminated, _ = cleanup_run(request.provider.name, run_id, artifacts_dir=artifacts,
                                aws_config={**request.provider.aws, "region": request.provider.region})
    run_dir = artifacts / run_id
    try:
        last = json.loads((run_dir / PROGRESS).read_text())
    except (OSError, json.JSONDecodeError):
        last = {"t_s": 0.0, "loss": None, "spent_usd": 0.0, "ps_spent_usd": 0.0}
    loss = "n/a" if last["loss"] is None else f"{last['loss']:.4f}"
    verdict = (f"Run {state_name.lower()} after {last['t_s']:.1f} s of training: loss {loss} (target "
               f"{request.slo.target_loss:g}); spent ${last['spent_usd']:.4f} on workers plus "
               f"${last['ps_spent_usd']:.4f} for the PS; {terminated} instance(s) terminated at the stop")
    summary = {"run_id": run_id, "state": state_name, "verdict": verdict, "met": False, **last,
               "terminated_at_stop": terminated}
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "summary.json", summary)
    atomic_write_text(run_dir / "report.md", stopped_report_markdown(summary))
    return summary



def record_revocation(session: TrainingSession, event: ProviderEvent) -> None:
    session.timeline.append(TimelineEntry(session.elapsed_s(), "revocation",
                                          {"instance_id": event.instance_id, "kind": event.kind}))


def notify_progress(session: TrainingSession, obs: Observation) -> None:
    for listener in PROGRESS_LISTENERS:
        listener(session, obs)


def pending_replan_request(session: TrainingSession) -> dict | None:
    """A re-plan asked for from outside (the drift automation's deployment writes this file),
    taken once."""
    path = session.run_dir / REPLAN_REQUEST
    try:
        asked = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    path.unlink(missing_ok=True)
    return asked


def alternatives_rows(session: TrainingSession) -> list[dict]:
    from tasks.pipeline.alternatives import plan_alternatives

    rows = plan_alternatives(session.plan_request(session.request.slo.deadline_s))
    session.alternatives = rows
    return [{"plan": r["name"], "instances": ", ".join(f"{n} x {t}" for t, n in sorted(r["plan"].items())) or "-",
             "predicted time (s)": None if r["predicted_time_s"] is None else round(r["predicted_time_s"], 1),
             "predicted cost ($)": None if r["predicted_cost_usd"] is None else round(r["predicted_cost_usd"], 4),
             "status": r["status"]} for r in rows]


def outcome(session: TrainingSession, obs: Observation, why: str = "target") -> dict:
    """How the run ended; `why` is the controller's reason (target, deadline, stopped, no workers)."""
    met = session.reached_target(obs) and obs.t_s <= session.request.slo.deadline_s
    session.timeline.append(TimelineEntry(obs.t_s, "done", {"met": met, "loss": obs.loss, "why": why}))
    return {"met": met, "ended": why, "observed_time_s": obs.t_s, "final_loss": obs.loss, "spent_usd": obs.spent_usd,
            "ps_spent_usd": obs.ps_spent_usd,
            "updates": obs.updates, "samples": obs.samples, "stopped": obs.stopped}


def write_report(session: TrainingSession, result: dict, clock: StageClock) -> dict:
    from tasks.pipeline.report import write_run_report

    return write_run_report(session, result, clock.seconds)
