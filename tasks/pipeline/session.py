"""One training job under an SLO, as the pipeline drives it: launch a plan, watch telemetry and
provider events, re-plan on revocations and drift, stop, and account for what happened.

Plain Python over the provider interface and the runtime's driver, so it runs the same on the
local provider and on AWS; flows/train_with_slo.py calls these methods as Prefect tasks.

With on-demand workers allowed (`candidates.on_demand_quota`), plans may hold `TYPE:on-demand`
offers and every (re-)plan runs `deadline_safe`: spot while the deadline is safe, the missing
throughput on on-demand workers when not; spot is tried again every `spot_probe_s` while
on-demand workers run or the market refused a spot type, and on-demand workers a plan no longer
holds are released once their replacements train (fallback.py).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.errors import UserInputError
from tasks.core.model import Model
from tasks.core.profile import Profile
from tasks.core.traces import load_traces
from tasks.market.hazards import catalog_bands, type_hazards
from tasks.market.replan import cheapest_or_fastest, deadline_safe
from tasks.pipeline.alternatives import plan_alternatives
from tasks.pipeline.fallback import all_joined, hardware_counts, offer_counts, takeover_by_market, to_release
from tasks.pipeline.watch import (CostMeter, DriftDetector, DriftHold, LossCurve, loss_progress, progress_ratio,
                                  refit_ratio)
from tasks.planner import PlanRequest, PlanResult
from tasks.planner.on_demand import base_type, is_on_demand, on_demand_name
from tasks.planner.solvers import get_solver
from tasks.providers.base import Instance, LaunchResult, ProviderEvent
from tasks.providers.plan_step import launch_step
from tasks.runtime.evaluation import metric_evaluation, tracked_value

if TYPE_CHECKING:  # an annotation only: importing the setup costs 0.4 s (boto3, the profiling fits)
    from tasks.pipeline.setup import RunSetup

log = logging.getLogger("spotfill.session")


@dataclass
class Observation:
    """One poll of a running job."""

    t_s: float  # seconds since training started
    loss: float | None
    updates: int
    samples: int
    workers: dict[str, int]  # by offer: TYPE (spot) or TYPE:on-demand
    spent_usd: float  # the workers' time at their offers' prices, what the planner's cost predicts
    ps_spent_usd: float  # the parameter server's on-demand time, on top
    loss_fraction: float
    time_fraction: float
    events: list[ProviderEvent] = field(default_factory=list)
    stopped: str | None = None
    on_demand_spent_usd: float = 0.0  # the part of spent_usd that paid on-demand workers


@dataclass
class TimelineEntry:
    t_s: float
    kind: str  # "plan", "revocation", "replan", "drift", "capacity", "on-demand", "ps_restart", "done"
    detail: dict


def capped_quotas(quota: dict[str, int], max_instances: int) -> dict[str, int]:
    """Quotas lowered (largest first) until together they fit the instance cap, so that no plan
    can break the cap whatever the planner picks."""
    quota = dict(quota)
    while sum(quota.values()) > max_instances:
        largest = max(sorted(quota), key=lambda t: quota[t])
        quota[largest] -= 1
    return quota


class TrainingSession:
    """The job's state, written by its own methods only: the flow and the stages call them."""

    def __init__(self, setup: RunSetup, profile: Profile, run_id: str, run_dir: Path):
        request = setup.request
        self.request = request
        self.profile = profile
        self.provider = setup.provider  # None: a session that only plans (`spotfill run`'s check)
        self.run_id = run_id
        self.run_dir = run_dir
        wanted = {t: request.candidates.quota(t) for t in profile.type_names}
        wanted |= {on_demand_name(t): n for t, n in request.candidates.on_demand_quota.items() if n}
        self.quota = capped_quotas(wanted, request.budget.max_instances)  # spot types and TYPE:on-demand twins
        self.spot_quota = {t: n for t, n in self.quota.items() if not is_on_demand(t)}  # before refusals: a probe's
        self.run = None  # tasks.runtime.driver.TrainingRun once launched
        self.ps_megabits_per_s = setup.emulation.get("ps_megabits_per_s")  # the local PS's emulated NIC (as profiled)
        bucket = setup.aws.checkpoint_bucket if setup.aws else None  # locally the run folder is durable
        self.durable_url = f"s3://{bucket}/{run_id}" if bucket else None
        self.started_s: float | None = None
        self.plans: list[PlanResult] = []
        self.alternatives: list[dict] = []  # the chosen plan beside the alternatives (alternatives.py)
        self.timeline: list[TimelineEntry] = []
        self.observations: list[Observation] = []
        self.cost = CostMeter()
        self.ps_cost = CostMeter()
        self.drift = DriftDetector(request.drift_threshold, request.drift_window_s)
        self.drift_hold = DriftHold()  # drift acts once per plan (watch.py)
        self.initial_loss: float | None = None
        self.replans = 0
        self.revocations = 0
        self.ps_restarts = 0
        self.shortfalls: list[dict] = []  # what the market refused, launch by launch
        self.leaving: set[str] = set()  # workers with a revocation notice: running, but not counted on
        self.started_plan: PlanResult | None = None  # the plan training started with (after refusals)
        self.on_demand_cost = CostMeter()
        self.on_demand_workers: list[dict] = []  # each on-demand worker: type, when and why launched, released
        self.releasing: tuple[list[str], str] = ([], "")  # on-demand workers to release once all have joined, why
        self.last_probe_s = 0.0
        self.replan_reason = "first plan"
        self.progress_origin: tuple[float, float | None] = (0.0, None)  # (t_s, loss) where the plan in effect began
        self._hazards: dict[str, float] | None = None
        # a setup with no provider has no prices to hold against the budget cap
        types = setup.offered
        self.prices = {t: types[t].spot_usd_per_h for t in profile.type_names if t in types}
        self.prices |= {on_demand_name(t): types[t].on_demand_usd_per_h for t in profile.type_names if t in types}
        self.ps_type = profile.type_names[0]
        # the PS runs as the profile's num_ps shards (docs/runtime.md), each an on-demand instance
        self.ps_usd_per_h = profile.num_ps * (types[self.ps_type].on_demand_usd_per_h if self.ps_type in types else 0.0)

    # ------------------------------------------------------------------ planning
    def plan_request(self, deadline_s: float, existing: dict[str, int] | None = None,
                     current_loss: float | None = None) -> PlanRequest:
        spot = {t: n for t, n in self.quota.items() if not is_on_demand(t)}
        on_demand = {base_type(t): n for t, n in self.quota.items() if is_on_demand(t)}
        return PlanRequest(
            profile=self.profile, loss_target=self.request.slo.curve_target, deadline_s=deadline_s,
            existing=existing or {}, quota=spot, on_demand_quota=on_demand, overhead_s=self.request.overhead_s,
            current_loss=current_loss, solver=self.request.solver, confidence=self.request.confidence,
            min_workers=self.min_workers(), **self.risk_options(),
        )

    @property
    def allows_on_demand(self) -> bool:
        return any(self.request.candidates.on_demand_quota.values())

    def first_plan(self) -> PlanResult:
        """The plan to launch: the whole deadline ahead, nothing running yet."""
        result = self.solve_or_fastest(self.plan_request(self.request.slo.deadline_s))
        self.plans.append(result)
        return result

    def compare_alternatives(self) -> list[dict]:
        """The chosen plan beside the plans people would otherwise pick (alternatives.py), kept for the report."""
        # over spot offers: the baselines (the paper's heuristic, one type alone, all on-demand) know no twins
        spot_only = replace(self.plan_request(self.request.slo.deadline_s), on_demand_quota={})
        self.alternatives = plan_alternatives(spot_only)
        return self.alternatives

    def min_workers(self) -> int | None:
        """The request's floor, as far as the quotas still allow: after the market refused a type
        (launch), a re-plan runs what it can rather than stop."""
        floor = self.request.candidates.min_workers
        return None if floor is None else max(1, min(floor, sum(self.quota.values())))

    def risk_options(self) -> dict:
        """For the risk-aware solver: per-type revocation hazards from the shipped traces and the
        catalog's interruption bands (tasks/market/hazards.py), and the level to reach."""
        if not get_solver(self.request.solver).uses_hazards:
            return {}
        if self._hazards is None:
            table, _ = type_hazards(self.profile, load_traces(), catalog_bands(self.request.provider.region))
            self._hazards = {t: h.hazard_per_h for t, h in table.items()}
        return {"target_probability": self.request.risk_level, "hazards_per_h": self._hazards,
                "recovery_s": self.request.overhead_s}

    def solve_or_fastest(self, request: PlanRequest) -> PlanResult:
        """The cheapest plan meeting the deadline; if none can, the fastest plan (the SLO is at
        risk, and the run still does its best); if the market left nothing, an empty plan."""
        if sum(request.quota.values()) == 0 and not any(request.existing.values()):
            message = "the market has no capacity left for any candidate type"
            self.timeline.append(TimelineEntry(self.elapsed_s(), "slo_at_risk", {"message": message}))
            return PlanResult("infeasible", {}, float("inf"), 0.0, 0.0, 0.0, 0.0, 0.0, "none", 0.0, message=message)
        # the same policies the market replay runs: with on-demand workers allowed, the deadline-safe
        # fallback (its reserve: one more re-plan's start-up), else the cheapest plan or the fastest
        replanned = (deadline_safe(request, self.request.overhead_s) if self.allows_on_demand
                     else cheapest_or_fastest(request))
        result = replanned.result
        if replanned.at_risk:
            self.timeline.append(TimelineEntry(self.elapsed_s(), "slo_at_risk", {"message": replanned.at_risk}))
        self.check_budget(result)
        return result

    def check_budget(self, result: PlanResult) -> None:
        caps = self.request.budget
        usd_per_h = self.workers_usd_per_h(result.plan) + self.ps_usd_per_h
        if usd_per_h > caps.max_usd_per_h:
            raise UserInputError(f"the plan costs ${usd_per_h:.2f}/h, over the budget cap of "
                                 f"${caps.max_usd_per_h:.2f}/h; nothing was launched")

    # ------------------------------------------------------------------ launching
    def start_parameter_server(self) -> None:
        from tasks.runtime.driver import start_run  # deferred: torch (start-up cost)

        self.run = start_run(self.provider, self.run_id, self.request.workload,
                             workload_options=self.request.workload_options, run_dir=self.run_dir,
                             ps_type=self.ps_type, ps_mbps=self.ps_megabits_per_s, async_rule=self.request.async_rule,
                             num_ps=self.profile.num_ps, lease_s=self.request.lease_s, durable_url=self.durable_url,
                             **metric_evaluation(self.request.slo.metric))

    def launch(self, plan: dict[str, int], plan_id: str) -> LaunchResult:
        """Start what `plan` has beyond the running workers, as one plan step (idempotent per
        plan id). A type the market refuses gets its quota lowered to what runs of it now, and a
        `capacity` entry on the timeline; the caller re-plans (launch_plan)."""
        from tasks.runtime.driver import worker_startup  # deferred: torch (start-up cost)

        alive = self.alive_workers()
        result = LaunchResult([])
        for market, counts in takeover_by_market(plan, alive).items():
            if not counts:
                continue
            startups = {}
            for t in counts:
                inst = self.profile.instance(t)
                startups[t] = worker_startup(self.run, inst.gpus * inst.batch_per_gpu, self.worker_args())
            step_id = plan_id if market == "spot" else f"{plan_id}-on-demand"  # a step is one market
            step = launch_step(self.provider, self.run_id, step_id, counts, startup=startups, market=market)
            result.instances += step.instances
            result.refused |= {(t if market == "spot" else on_demand_name(t)): r for t, r in step.refused.items()}
        if self.started_s is None:
            self.started_s = time.time()
        running = offer_counts(alive + result.instances)
        if any(not is_on_demand(t) for t in result.refused):
            self.last_probe_s = self.elapsed_s()  # spot was just tried: the next probe is spot_probe_s on
        for t, refusal in sorted(result.refused.items()):
            self.quota[t] = running.get(t, 0)
            shortfall = {"type": t, "kind": refusal.kind, "missing": refusal.missing, "why": refusal.message}
            self.shortfalls.append(shortfall)
            self.timeline.append(TimelineEntry(self.elapsed_s(), "capacity", shortfall))
        self.record_on_demand_launch([i for i in result.instances if i.market == "on-demand"])
        return result

    def record_on_demand_launch(self, started: list[Instance]) -> None:
        """On-demand workers started, on the timeline and in the report, with the re-plan's reason."""
        if not started:
            return
        t_s = self.elapsed_s()
        for i in started:
            self.on_demand_workers.append({"instance_id": i.instance_id, "type": i.type, "launched_t_s": t_s,
                                           "why": self.replan_reason, "released_t_s": None})
        self.timeline.append(TimelineEntry(t_s, "on-demand", {
            "action": "launch", "instances": [i.instance_id for i in started],
            "types": dict(sorted(offer_counts(started).items())), "why": self.replan_reason}))

    def schedule_release(self, plan: dict[str, int], replacements: list[Instance]) -> None:
        """On-demand workers the plan no longer holds: released now if nothing replaces them, else
        once every worker has joined (observe)."""
        excess = [i.instance_id for i in to_release(plan, self.alive_workers())]
        why = "back to spot" if replacements else "no longer needed"
        self.releasing = (excess, why)
        if excess and not replacements:
            self.release_on_demand()

    def release_on_demand(self) -> None:
        ids, why = self.releasing
        self.releasing = ([], "")
        if not ids:
            return
        self.provider.terminate(ids)
        t_s = self.elapsed_s()
        for worker in self.on_demand_workers:
            if worker["instance_id"] in ids:
                worker["released_t_s"] = t_s
        self.timeline.append(TimelineEntry(t_s, "on-demand", {"action": "release", "instances": ids, "why": why}))

    def launch_plan(self, result: PlanResult, plan_id: str, current_loss: float | None = None) -> PlanResult:
        """Launch a plan; while the market refuses part of it, re-plan with what runs (the refused
        types capped at what they have) and launch the difference. Returns the plan in effect.
        Each refusal caps a type at what runs, so this ends after at most one round per type."""
        spot_started: list[Instance] = []
        for attempt in range(len(self.quota) + 1):
            launched = self.launch(result.plan, f"{plan_id}-{attempt}")
            spot_started += [i for i in launched.instances if i.market == "spot"]
            if not launched.refused or attempt == len(self.quota):
                break
            result = self.decide_replan("capacity", self.elapsed_s(), current_loss)
        if self.started_plan is None:
            self.started_plan = result
        if self.allows_on_demand:
            self.schedule_release(result.plan, spot_started)
        return result

    def alive_workers(self, leaving: set[str] = frozenset()) -> list[Instance]:
        """Workers that will still run: a worker on notice is not one, neither as a survivor nor
        as a place the next plan's instances are already taken (its replacement is launched now)."""
        gone = self.leaving | set(leaving)
        return [i for i in self.provider.describe(self.run_id)
                if i.role == "worker" and i.state in ("pending", "running") and i.instance_id not in gone]

    def worker_args(self) -> tuple[str, ...]:
        f = self.request.filling
        if not f.enabled:
            return ()
        return ("--fill", "--fill-online-rate", repr(f.online_rate_per_s), "--fill-online-slo-s", repr(f.online_slo_s),
                "--fill-metrics-dir", str(self.run_dir / "filling"))

    def running_workers(self) -> dict[str, int]:
        """Workers alive by offer (TYPE, or TYPE:on-demand)."""
        return offer_counts(self.alive_workers())

    def restart_dead_ps(self) -> bool:
        """A parameter server that died (its instance is gone and it recorded no stop) is started
        again on a new on-demand instance from the newest checkpoint in the run folder, on the same
        ports: the workers rejoin by themselves. True when it was restarted."""
        from tasks.runtime.driver import restart_ps  # deferred: torch (start-up cost)

        shards = self.run.ps_instances or [self.run.ps_instance]
        alive = {i.instance_id for i in self.provider.describe(self.run_id)}
        if all(i.instance_id in alive for i in shards) or self.run.progress().stopped is not None:
            return False
        self.ps_restarts += 1
        self.run = restart_ps(self.run, plan_id=f"ps-restart-{self.ps_restarts}")
        self.timeline.append(TimelineEntry(self.elapsed_s(), "ps_restart", {
            "lost": [i.instance_id for i in shards], "instances": [i.instance_id for i in self.run.ps_instances]}))
        return True

    # ------------------------------------------------------------------ watching
    def elapsed_s(self) -> float:
        return 0.0 if self.started_s is None else time.time() - self.started_s

    def workers_usd_per_h(self, workers: dict[str, int]) -> float:
        return sum(self.prices.get(t, 0.0) * n for t, n in workers.items())

    def observe(self) -> Observation:
        progress = self.run.progress()
        events = self.provider.poll_events(self.run_id)
        now = time.time()
        workers = self.running_workers()
        spent = self.cost.advance(now, self.workers_usd_per_h(workers))
        on_demand_spent = self.on_demand_cost.advance(
            now, self.workers_usd_per_h({t: n for t, n in workers.items() if is_on_demand(t)}))
        if self.releasing[0] and all_joined(progress, sum(workers.values())):
            self.release_on_demand()
        ps_spent = self.ps_cost.advance(now, self.ps_usd_per_h)
        slo = self.request.slo
        tracked = tracked_value(progress, slo.metric)  # the smoothed loss, or the target metric on its scale
        if self.initial_loss is None and tracked is not None:
            self.initial_loss = tracked
        obs = Observation(
            t_s=self.elapsed_s(), loss=tracked, updates=progress.updates_total,
            samples=progress.samples_total, workers=workers, spent_usd=spent, ps_spent_usd=ps_spent,
            loss_fraction=loss_progress(self.initial_loss, tracked, slo.curve_target),
            time_fraction=min(1.0, self.elapsed_s() / slo.deadline_s), events=events, stopped=progress.stopped,
            on_demand_spent_usd=on_demand_spent,
        )
        self.observations.append(obs)
        return obs

    def record_revocation(self, event: ProviderEvent) -> None:
        """A revocation notice (counted) or an instance taken, on the timeline."""
        self.revocations += event.kind == "revocation_notice"
        self.timeline.append(TimelineEntry(self.elapsed_s(), "revocation",
                                           {"instance_id": event.instance_id, "kind": event.kind}))

    def record_drift(self, reason: str, speed_ratio: float) -> None:
        self.timeline.append(TimelineEntry(self.elapsed_s(), "drift", {"reason": reason, "speed_ratio": speed_ratio}))

    def conclude(self, obs: Observation, why: str = "target") -> dict:
        """How the run ended, on the timeline and as the report's outcome; `why` is the
        controller's reason (target, deadline, stopped, no workers)."""
        met = self.reached_target(obs) and obs.t_s <= self.request.slo.deadline_s
        self.timeline.append(TimelineEntry(obs.t_s, "done", {"met": met, "loss": obs.loss, "why": why}))
        return {"met": met, "ended": why, "observed_time_s": obs.t_s, "final_loss": obs.loss, "spent_usd": obs.spent_usd,
                "ps_spent_usd": obs.ps_spent_usd, "on_demand_spent_usd": obs.on_demand_spent_usd,
                "updates": obs.updates, "samples": obs.samples, "stopped": obs.stopped}

    def reached_target(self, obs: Observation) -> bool:
        return obs.loss is not None and obs.loss <= self.request.slo.curve_target

    def predicted_updates_per_s(self, workers: dict[str, int]) -> float:
        """The model's iteration rate 1/Texp = sum n_m / T_m(n) for a cluster."""
        if not workers:
            return 0.0
        model = Model.from_profile(self.profile)
        counts = model.counts_vector(hardware_counts(workers))
        return float(counts @ (1.0 / model.cluster_iteration_times_s(counts)[0]))

    def loss_curve(self, plan: dict[str, int]) -> tuple[LossCurve, float]:
        """The model's loss curve for a cluster, and its iteration time Texp (seconds per update)."""
        model = Model.from_profile(self.profile)
        r = model.evaluate(model.counts_vector(hardware_counts(plan)), self.request.slo.curve_target)
        g = self.profile.loss
        a = float(model.curve_numerator(r["wa_batch"][0], r["cc"][0], r["workers"][0]))  # Eq. 3, as the planner's
        return LossCurve(a, g.gamma1, g.gamma5), float(r["iteration_time_s"][0])

    def check_drift(self, obs: Observation) -> float | None:
        """Drift against the cluster this poll saw (no second read of the instance table): in
        update rate, and in progress to the target loss since the plan in effect began."""
        progress = None
        if self.plans and self.plans[-1].plan:
            curve, texp_s = self.loss_curve(self.plans[-1].plan)
            t0, loss0 = self.progress_origin
            progress = progress_ratio(curve, texp_s, obs.t_s - t0 - self.request.overhead_s, loss0, obs.loss)
        ratio = self.drift.observe(time.time(), obs.updates, self.predicted_updates_per_s(obs.workers), progress)
        self.drift_hold.saw(ratio)
        return ratio

    # ------------------------------------------------------------------ re-planning
    def decide_replan(self, reason: str, t_s: float, current_loss: float | None,
                      leaving: set[str] = frozenset()) -> PlanResult:
        """The re-plan decision, in one place: solve again with the survivors as existing
        instances, the time left and the loss reached, under the current quotas (lowered by what
        the market refused). Recorded as a plan, a re-plan and a timeline entry."""
        self.replans += 1
        refused = self.shortfalls[-1] if reason == "capacity" and self.shortfalls else None
        self.replan_reason = f"{reason}: {refused['why']}" if refused else reason  # what on-demand workers are for
        if "probe" in reason.split("+"):  # try spot again: the market may have capacity back
            self.quota |= self.spot_quota
            self.last_probe_s = t_s
        survivors = offer_counts(self.alive_workers(leaving))
        remaining_s = max(self.request.slo.deadline_s - t_s, 1e-3)
        result = self.solve_or_fastest(self.plan_request(remaining_s, existing=survivors, current_loss=current_loss))
        self.plans.append(result)
        self.timeline.append(TimelineEntry(t_s, "replan", {
            "reason": reason, "survivors": survivors, "plan": result.plan,
            "predicted_remaining_s": result.predicted_time_s, "solver": result.solver}))
        return result

    def replan(self, reason: str, obs: Observation, leaving: set[str] = frozenset()) -> PlanResult:
        """Re-plan (decide_replan) and launch the takeover; training carries on meanwhile."""
        current = obs.loss if obs.loss is not None and obs.loss > self.request.slo.curve_target else None
        self.leaving |= set(leaving)
        result = self.decide_replan(reason, obs.t_s, current)
        result = self.launch_plan(result, f"replan-{self.replans}", current)
        self.drift.reset()
        self.drift_hold = DriftHold(plan=self.replans)
        self.progress_origin = (obs.t_s, obs.loss)
        return result

    def probe_due(self, t_s: float) -> bool:
        """Time to try spot again: on-demand workers run, or the market refused a spot type, and
        `spot_probe_s` has passed since the last try."""
        if not self.allows_on_demand or t_s - self.last_probe_s < self.request.candidates.spot_probe_s:
            return False
        return (any(is_on_demand(t) for t in self.running_workers())
                or any(self.quota[t] < n for t, n in self.spot_quota.items()))

    def refit_for_drift(self, ratio: float) -> None:
        """Observed speed fell short of the prediction for a sustained window: scale the
        profile's compute times so the model matches what is observed, then re-plan. Once per
        plan, with the ratio measured against this plan's model (DriftHold), so no observation is
        applied twice. A ratio outside (0, 1] (watch.refit_ratio) is refused."""
        if refit_ratio(ratio) is None:
            raise ValueError(f"a drift refit needs a speed ratio in (0, 1], not {ratio!r}")
        data = self.profile.model_dump()
        for inst in data["instances"]:
            inst["compute_time_s"] = inst["compute_time_s"] / ratio
        self.profile = Profile.model_validate(data)

    # ------------------------------------------------------------------ stopping
    def stop(self) -> None:
        from tasks.runtime.driver import stop_run  # deferred: torch (start-up cost)

        if self.run is not None:
            stop_run(self.run, timeout_s=30.0)
        self.provider.cleanup(self.run_id)
