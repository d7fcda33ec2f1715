"""The pipeline's parameters: typed pydantic models, so the Prefect UI validates what a user
types and the CLI gets the same checks. Every field, nested ones too, has a default (the SLO's
and the candidates' are the README's demo job), because Prefect merges a run's parameters over a
deployment's one top-level name at a time: `--params '{"request": {"slo": {"deadline_s": 300}}}'`
replaces the whole request, and what it leaves out must still validate. Titles are what the UI's
form shows ("Deadline (s)")."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator

from tasks.core import limits
from tasks.core.capacity import load_capacity
from tasks.core.catalog import known_region
from tasks.core.limits import MAX_DURATION_S
from tasks.core.traces import trace_path
from tasks.pipeline.plugin_policy import check_deployment_workload
from tasks.runtime.evaluation import TargetMetric, parse_target_metric
from tasks.runtime.lease import DEFAULT_LEASE_S
from tasks.planner.problem import RISK_LEVEL
from tasks.planner.solvers import DEFAULT_SOLVER, get_solver, solver_names

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
SolverName = Literal[solver_names()]  # the planner's table (tasks/planner/solvers.py), in its order


class SLO(BaseModel):
    """What the user is promised: reach `target_loss` (or, given, `target_metric`) within
    `deadline_s` of the launch."""

    model_config = _STRICT
    target_loss: float = Field(1.7, gt=0, strict=True, title="Target loss",
                               description="training loss to reach (smoothed over updates)")
    deadline_s: float = Field(60.0, gt=0, le=MAX_DURATION_S, title="Deadline (s)",
                              description="seconds from the launch of training")
    target_metric: str | None = Field(None, title="Target metric", description=(
        "NAME<=X or NAME>=X: reach this metric of the workload's evaluate(model) on held-out data instead of "
        "the training loss (docs/model.md, A target metric)"))

    @field_validator("target_metric")
    @classmethod
    def _metric_parses(cls, text: str | None) -> str | None:
        return None if text is None else str(parse_target_metric(text))

    @property
    def metric(self) -> TargetMetric | None:
        return None if self.target_metric is None else parse_target_metric(self.target_metric)

    @property
    def curve_target(self) -> float:
        """The target on the loss curve's scale, the one profiled, planned and watched:
        `target_loss`, or the target metric's (evaluation.py)."""
        metric = self.metric
        return self.target_loss if metric is None else metric.curve_target

    def as_reported(self, tracked: float) -> float:
        """A value on the curve's scale as the user reads it: the loss, or the metric itself."""
        metric = self.metric
        return tracked if metric is None else metric.on_curve(tracked)

    def state_text(self, tracked: float | None) -> str:
        """Where a run stands against its target: `loss 0.1234 (target 1.7)`, or
        `val_acc 0.9123 (target val_acc>=0.9)`; `tracked` is on the curve's scale."""
        value = "n/a" if tracked is None else f"{self.as_reported(tracked):.4f}"
        if self.target_metric is None:
            return f"loss {value} (target {self.target_loss:g})"
        return f"{self.metric.name} {value} (target {self.target_metric})"


def profiled_curve(slo: SLO) -> dict:
    """What a profile's settings record of the curve it was fitted on: {} for the training loss,
    {"curve": NAME} for a target metric's (a run checks a given profile against it)."""
    return {} if slo.metric is None else {"curve": slo.metric.name}


class Candidates(BaseModel):
    """Which instance types the planner may use, and how many of each."""

    model_config = _STRICT
    types: list[str] = Field(default_factory=lambda: ["p3.2xlarge", "g3.8xlarge"], min_length=1,
                             title="Instance types", description="instance types to profile and plan over")
    quotas: dict[str, StrictInt] = Field(default_factory=dict, title="Quotas per type",
                                         description="per-type caps (at most SPOTFILL_MAX_COUNT, 1000); default 4 each")
    min_workers: int | None = Field(None, ge=1, title="Minimum workers", description=(
        "plan and re-plan at least this many workers, so a revocation leaves survivors (default: the smallest "
        "cluster the profile's loss curve was fitted on)"))
    on_demand_quota: dict[str, StrictInt] = Field(default_factory=dict, title="On-demand quota per type", description=(
        "on-demand workers of each candidate type a plan may add when spot alone would miss the deadline "
        "(docs/pipeline.md, On-demand fallback); default none: spot only"))
    spot_probe_s: float = Field(10.0, gt=0, le=MAX_DURATION_S, title="Spot probe every (s)", description=(
        "while on-demand workers run or the market refused a spot type, try spot again this often (seconds)"))

    @model_validator(mode="after")
    def _quotas_name_candidates(self) -> "Candidates":
        for field_name, quotas in (("quotas", self.quotas), ("on_demand_quota", self.on_demand_quota)):
            unknown = sorted(set(quotas) - set(self.types))
            if unknown:
                raise ValueError(f"{field_name.removesuffix('s')} given for a type that is not a candidate: {', '.join(unknown)}")
            if any(not 0 <= q <= limits.max_count() for q in quotas.values()):
                raise ValueError(f"{field_name} must be 0..{limits.max_count()} (SPOTFILL_MAX_COUNT)")
        if len(set(self.types)) != len(self.types):
            raise ValueError("candidate types repeat")
        most = sum(self.quota(t) for t in self.types)
        if not most:  # nothing could ever launch: refused before profiling spends minutes on it
            raise ValueError("every candidate type's quota is 0: no worker could launch")
        if self.min_workers is not None and self.min_workers > most:
            raise ValueError(f"min_workers {self.min_workers} is more than the quotas allow ({most} in all)")
        return self

    def quota(self, name: str) -> int:
        return self.quotas.get(name, 4)


class Revocations(BaseModel):
    """Revocations to replay on the local provider (AWS revokes on its own)."""

    model_config = _STRICT
    trace: str | None = Field(None, title="Trace", description="a preemption trace under profiles/traces/ to replay")
    trace_type: str | None = Field(None, title="Trace type", description="replay the trace against this type's workers only "
                                   "(a trace of one family revokes that family); default: every worker")
    time_scale: float = Field(600.0, gt=0, le=1e6, title="Time scale", description="trace seconds per real second")
    inject_at_s: list[float] = Field(default_factory=list, title="Inject at (s)", description="revoke one worker at these run times")
    notice_s: float = Field(2.0, ge=0, le=MAX_DURATION_S, title="Notice (s)", description="notice before the instance is taken")

    @model_validator(mode="after")
    def _times_are_durations(self) -> "Revocations":
        if any(not 0 <= t <= MAX_DURATION_S for t in self.inject_at_s):
            raise ValueError("inject_at_s: each time must be 0 s to ten years after launch")
        return self


class ProviderSettings(BaseModel):
    model_config = _STRICT
    name: Literal["local", "aws"] = Field("local", title="Provider")
    region: str = Field("us-east-1", title="Region")
    aws: dict[str, Any] = Field(default_factory=dict, title="AWS settings", description="AwsConfig fields (AMIs, subnet, ...); docs/aws.md")
    revocations: Revocations = Field(default_factory=Revocations, title="Revocations")
    capacity: dict[str, int] = Field(default_factory=dict, title="Market capacity", description=(
        "local: spot instances the emulated market has of each type (default: unlimited)"))
    capacity_traces: dict[str, str] = Field(default_factory=dict, title="Capacity traces", description=(
        "local: a capacity trace file per type (docs/market.md), played from the launch at "
        "revocations.time_scale: spot launches above it are refused, drops revoke the excess"))
    droughts_s: dict[str, float] = Field(default_factory=dict, title="Droughts (s)", description=(
        "local: no spot capacity of the type for this many seconds from the run's first revocation notice"))

    @field_validator("region")
    @classmethod
    def _region_in_the_catalog(cls, region: str) -> str:
        """An unknown region would price nothing: the plan would find no offer to buy."""
        return known_region(region)

    @model_validator(mode="after")
    def _capacity_is_counts(self) -> "ProviderSettings":
        if any(not 0 <= n <= limits.max_count() for n in self.capacity.values()):
            raise ValueError(f"market capacity must be 0..{limits.max_count()} (SPOTFILL_MAX_COUNT)")
        if any(not 0 < s <= MAX_DURATION_S for s in self.droughts_s.values()):
            raise ValueError("droughts_s: each drought must last more than 0 s and at most ten years")
        both = sorted(set(self.capacity_traces) & set(self.droughts_s))
        if both:
            raise ValueError(f"{both[0]} has both a capacity trace and a drought: give one")
        return self

    @model_validator(mode="after")
    def _capacity_traces_read(self) -> "ProviderSettings":
        """Each file parses and its zone is in the region (a problem names the file and line)."""
        for path in self.capacity_traces.values():
            load_capacity(path).check_region(self.region)
        return self


class Filling(BaseModel):
    model_config = _STRICT
    enabled: bool = Field(True, title="Enabled")
    online_rate_per_s: float = Field(5.0, ge=0, title="Online rate (requests/s)", description="online inference requests per second per worker")
    online_slo_s: float = Field(0.5, gt=0, title="Online SLO (s)", description="latency SLO of one online request")


class BudgetCaps(BaseModel):
    """Guards that hold whatever the planner says."""

    model_config = _STRICT
    max_instances: int = Field(12, gt=0, strict=True, title="Max instances")  # strict: `true` is no count,
    max_usd_per_h: float = Field(100.0, gt=0, strict=True, title="Max $/h")  # nor a price of $1.00

    @model_validator(mode="after")
    def _within_the_count_limit(self) -> "BudgetCaps":
        if self.max_instances > limits.max_count():
            raise ValueError(f"max_instances must be at most {limits.max_count()} (SPOTFILL_MAX_COUNT)")
        return self


class TrainRequest(BaseModel):
    """One training job with its SLO: the main flow's single parameter."""

    model_config = _STRICT
    workload: str = Field("transformer-lm", title="Workload", description="a built-in workload name or module:function")
    workload_options: dict[str, int | float | str] = Field(default_factory=dict, title="Workload options")
    slo: SLO = Field(default_factory=SLO, title="SLO")
    candidates: Candidates = Field(default_factory=Candidates, title="Candidates")
    profile: str | None = Field(None, title="Profile", description="use this profile JSON instead of profiling")
    profiling: Literal["quick", "full"] = Field("quick", title="Profiling", description="profiling preset (tasks/profiling/presets.py)")
    profile_budget_s: float | None = Field(
        None, gt=0, le=MAX_DURATION_S, title="Profiling budget (s)", description="seconds the profiling clusters may train in all until they share a loss band and come near the target "
                                "(default: the preset's, 300)")
    async_rule: Literal["guarded", "momentum", "sqrt", "inverse"] = Field(
        "guarded", title="Async rule", description="how the parameter server applies a stale gradient (docs/runtime.md)")
    solver: SolverName = Field(DEFAULT_SOLVER, title="Solver")
    regions: list[str] = Field(default_factory=list, title="Regions", description="must stay empty: the pipeline launches the "
                               "profile's types in provider.region; `spotfill plan --regions` plans across regions")
    risk_level: float = Field(RISK_LEVEL, gt=0, lt=1, title="Risk level", description="solver risk: P(meeting the deadline) to reach")
    confidence: float | None = Field(None, gt=0, lt=1, title="Confidence", description="plan and re-plan to meet the deadline at the "
                                     "upper end of the model's interval at this level (needs a fitted profile)")
    overhead_s: float = Field(3.0, ge=0, le=MAX_DURATION_S, title="Start-up overhead (s)", description="T_ohd: time for new instances to start and join")
    lease_s: float = Field(DEFAULT_LEASE_S, gt=0, le=MAX_DURATION_S, title="Lease (s)",
                           description="how long the run trains on once no orchestrator renews its lease; then "
                                       "the PS checkpoints and every process of the run ends (docs/runtime.md)")
    provider: ProviderSettings = Field(default_factory=ProviderSettings, title="Provider")
    filling: Filling = Field(default_factory=Filling, title="Filling")
    budget: BudgetCaps = Field(default_factory=BudgetCaps, title="Budget caps")
    drift_threshold: float = Field(0.25, gt=0, title="Drift threshold", description="relative speed shortfall that counts as drift")
    drift_window_s: float = Field(10.0, gt=0, le=MAX_DURATION_S, title="Drift window (s)", description="how long drift must last before re-planning")
    drift_action: Literal["inline", "automation"] = Field(
        "inline", title="Drift action", description="re-plan in the run itself, or leave it to the replan-on-drift automation")
    artifacts_dir: str = Field("artifacts", title="Artifacts folder", description="where run reports go (one folder per run)")

    @field_validator("artifacts_dir")
    @classmethod
    def _artifacts_dir_writable(cls, folder: str) -> str:
        """The run's reports go here: a file, a device or a read-only folder in the way would fail
        the run at its end, after the training was paid for."""
        limits.output_dir(folder)
        return folder

    @model_validator(mode="after")
    def _workload_allowed(self, info: ValidationInfo) -> "TrainRequest":
        """Deployments run only allow-listed plug-ins; the CLI validates with context local_user."""
        if not (info.context or {}).get("local_user"):
            check_deployment_workload(self.workload)
        return self

    @model_validator(mode="after")
    def _one_region(self) -> "TrainRequest":
        """A plan over offers TYPE@REGION may name regions and estimated types no provider of this
        run can start; refused here, before anything is profiled or launched."""
        if self.regions:
            raise ValueError(f"regions {', '.join(self.regions)}: the pipeline launches the profile's types in "
                             f"provider.region ({self.provider.region}) only; plan across regions with "
                             "`spotfill plan PROFILE --regions ...`, and run in the region it picks")
        return self

    @model_validator(mode="after")
    def _min_workers_within_budget(self) -> "TrainRequest":
        floor, cap = self.candidates.min_workers, self.budget.max_instances
        if floor is not None and floor > cap:
            raise ValueError(f"candidates.min_workers {floor} is more than budget.max_instances ({cap})")
        return self

    @model_validator(mode="after")
    def _trace_type_is_a_candidate(self) -> "TrainRequest":
        trace_type = self.provider.revocations.trace_type
        if trace_type is not None and trace_type not in self.candidates.types:
            raise ValueError(f"revocations.trace_type {trace_type!r} is not a candidate type")
        return self

    @model_validator(mode="after")
    def _revocations_that_happen(self) -> "TrainRequest":
        """Settings that would silently do nothing are refused: they say the user expects something."""
        r, settings = self.provider.revocations, self.provider
        if r.trace_type is not None and not r.trace:
            raise ValueError("revocations.trace_type names the type a trace revokes, but no trace is given")
        if settings.name != "local" and (r.trace or r.inject_at_s):
            raise ValueError(f"revocations are replayed on the local provider only; {settings.name} revokes on its own")
        late = [t for t in r.inject_at_s if t >= self.slo.deadline_s]
        if late:
            raise ValueError(f"revocations.inject_at_s {late[0]:g} s is not before slo.deadline_s ({self.slo.deadline_s:g} s)")
        for name in ("capacity", "capacity_traces", "droughts_s"):
            given = getattr(settings, name)
            unknown = sorted(set(given) - set(self.candidates.types))
            if unknown:
                raise ValueError(f"provider.{name} given for a type that is not a candidate: {', '.join(unknown)}")
            if given and settings.name != "local":
                raise ValueError(f"provider.{name} is emulated on the local provider only; {settings.name} has its own market")
        return self

    @model_validator(mode="after")
    def _profiling_settings_need_profiling(self) -> "TrainRequest":
        """A given profile replaces profiling: a profiling setting beside it would be ignored."""
        if self.profile is not None:
            if self.profiling != "quick":
                raise ValueError(f"profiling {self.profiling!r} does nothing with a profile given (profile is used as is)")
            if self.profile_budget_s is not None:
                raise ValueError("profile_budget_s does nothing with a profile given (profile is used as is)")
        return self

    @model_validator(mode="after")
    def _risk_level_needs_the_risk_solver(self) -> "TrainRequest":
        if not get_solver(self.solver).uses_hazards and self.risk_level != RISK_LEVEL:
            users = " or ".join(map(repr, solver_names(uses_hazards=True)))
            raise ValueError(f"risk_level {self.risk_level:g} is used by solver {users} only (solver is {self.solver!r})")
        return self

    @model_validator(mode="after")
    def _profile_exists(self) -> "TrainRequest":
        if self.profile is not None and not Path(self.profile).is_file():
            raise ValueError(f"profile not found: {self.profile}")
        return self

    @model_validator(mode="after")
    def _profile_of_this_workload(self) -> "TrainRequest":
        """A profile measured for another workload would plan this one with another's speeds and
        loss curve: refused (what else is wrong with the file, load_profile says later)."""
        if self.profile is not None:
            import json

            try:
                measured = json.loads(Path(self.profile).read_text(encoding="utf-8")).get("workload")
            except (OSError, ValueError, AttributeError):
                return self
            if isinstance(measured, str) and measured != self.workload:
                raise ValueError(f"profile {self.profile} was measured for workload {measured!r}, not {self.workload!r}")
        return self

    @model_validator(mode="after")
    def _deadline_past_the_start(self) -> "TrainRequest":
        if self.slo.deadline_s <= self.overhead_s:
            raise ValueError(f"slo.deadline_s ({self.slo.deadline_s:g} s) leaves no time to train after "
                             f"overhead_s ({self.overhead_s:g} s), the time instances take to start")
        return self

    @model_validator(mode="after")
    def _trace_exists(self) -> "TrainRequest":
        trace = self.provider.revocations.trace
        if trace:
            if not trace_path(trace).is_file():  # a name reaching outside profiles/traces/ raises there
                raise ValueError(f"provider.revocations.trace not found: {trace} (a file, or a name under profiles/traces/)")
        return self
