"""The workload profile (docs/formats.md): load, validate, and look up instance types.

Validation names the offending field in one line, because the planner's answers are only as good
as the numbers it reads.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.core.errors import UserInputError
from tasks.core.inputs import loads_json, read_text
from tasks.core.limits import max_count


# strict: a profile's `"param_mb": true` or `"gpus": "8"` is a mistake to name, not a 1 or an 8 to guess
_CONFIG = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
# an instance type as the CLI names it in TYPE=N lists: no spaces, commas, '=' or '@' (the
# separator of TYPE@REGION offers), no look-alike characters
TYPE_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"


# The further terms' allowed ranges (docs/formats.md): the fit searches within them and the
# exact solver's bounds are argued for every value in them (docs/planner.md).
OVERLAP_MAX = 1.0
BATCH_N_EXPONENT_BOUNDS = (-1.5, 1.0)
BATCH_STALENESS_MAX = 100.0
BATCH_NOISE_MAX = 1e7
DEFAULT_OVERLAP_WIDTH = 0.2


class Contention(BaseModel):
    model_config = _CONFIG
    alpha1: float
    beta1: float
    # What loads the PS in Eq. 8-9: the worker count (the paper; null means it) or "load", the
    # effective count sum_i T_fast / T_i_alone (docs/model.md, Extensions).
    by: Literal["workers", "load"] | None = None
    # How much longer a worker's PS transfers take when they coincide with same-period peers'
    # (docs/model.md, Further terms): omega >= 0; null means none (the paper).
    overlap: float | None = Field(default=None, ge=0, le=OVERLAP_MAX)
    # The period mismatch (a share, 1 - T_short / T_long) at which two workers stop overlapping.
    overlap_width: float | None = Field(default=None, gt=0, le=1)
    # Whether the cluster's update rate is capped by the PS link, k * Bps / (2 S) (docs/model.md,
    # Further terms); null or false means no cap (the paper).
    link_cap: bool | None = None


class LossCurve(BaseModel):
    model_config = _CONFIG
    gamma1: float
    gamma2: float
    gamma3: float
    gamma4: float | None = Field(gt=0)  # null selects the prototype's form without R
    gamma5: float
    kappa: float | None = Field(default=None, ge=0.25, le=1.0)  # exponent of (R + gamma4) * n; null: 0.5
    # The batch term's n-dependence: gamma2 * bw * n ** eta (docs/model.md, Further terms); null: 0
    batch_n_exponent: float | None = Field(default=None, ge=BATCH_N_EXPONENT_BOUNDS[0], le=BATCH_N_EXPONENT_BOUNDS[1])
    # The staleness cost of the batch: psi * bw * (n - 1) in the batch term (docs/model.md,
    # Further terms); null: 0
    batch_staleness: float | None = Field(default=None, ge=0, le=BATCH_STALENESS_MAX)
    # The gradient noise of small batches: beta / bw in Eq. 3's numerator, updates falling as
    # 1 / bw towards a floor (docs/model.md, Further terms); null: 0
    batch_noise: float | None = Field(default=None, ge=0, le=BATCH_NOISE_MAX)

    def require_reachable(self, loss_target: float) -> None:
        """Eq. 3 never goes below gamma5; such a target is the user's to fix, not a plan (docs/model.md):
        the message names the lowest target that can be planned (any above gamma5)."""
        if loss_target <= self.gamma5:
            raise UserInputError(
                f"loss target {loss_target:g} is unreachable: the fitted loss curve never goes below gamma5 = "
                f"{self.gamma5:.4g}; the lowest target that can be planned is just above {self.gamma5:.4g}")


class Uncertainty(BaseModel):
    """The spread of the model's relative time error, measured on clusters the fit did not see:
    the standard deviation of log(observed / predicted) time."""

    model_config = _CONFIG
    time_log_sd: float = Field(ge=0)
    method: str = "leave-one-cluster-out"


class InstanceProfile(BaseModel):
    model_config = _CONFIG
    type: str
    gpus: int = Field(gt=0)
    batch_per_gpu: int = Field(gt=0)
    compute_time_s: float = Field(gt=0)
    spot_price: float = Field(gt=0)
    on_demand_price: float = Field(gt=0)
    quota: int = Field(ge=0)
    # on-demand workers of this type a plan may use (docs/planner.md, on-demand offers)
    on_demand_quota: int = Field(default=0, ge=0)
    # Eq. 10, the memory fit: the largest batch one GPU of this type holds (null: not measured)
    max_batch_per_gpu: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _batch_fits_one_gpu(self) -> "InstanceProfile":
        """Each GPU trains its own replica at batch_per_gpu (a multi-GPU worker's replicas do not
        share memory): a batch above the memory fit would run out of memory on the instance."""
        if self.max_batch_per_gpu is not None and self.batch_per_gpu > self.max_batch_per_gpu:
            raise ValueError(f"{self.type}: batch_per_gpu {self.batch_per_gpu} does not fit one GPU's memory; "
                             f"the memory fit (max_batch_per_gpu) admits at most {self.max_batch_per_gpu}")
        return self

    @field_validator("type")
    @classmethod
    def _type_name_the_cli_can_name(cls, name: str) -> str:
        if not re.fullmatch(TYPE_NAME, name):
            raise ValueError(f"instance type {name[:60]!r} must be 1-100 ASCII letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit (as TYPE=N lists name it)")
        return name

    @field_validator("quota", "on_demand_quota")
    @classmethod
    def _quota_within_the_count_limit(cls, quota: int) -> int:
        """The planner enumerates counts up to each quota: a typo of 10**9 would take the memory."""
        if quota > max_count():
            raise ValueError(f"quota {quota} is more than {max_count()} (SPOTFILL_MAX_COUNT raises the limit)")
        return quota


class Profile(BaseModel):
    """One workload's measured parameters; units are MB, MB/s, seconds and USD per hour."""

    model_config = _CONFIG
    workload: str = Field(min_length=1)
    param_mb: float = Field(gt=0)
    required_bandwidth_mbps: float = Field(gt=0)
    ps_bandwidth_mbps: float = Field(gt=0)
    pcie_bandwidth_mbps: float = Field(gt=0)
    num_ps: int = Field(default=1, gt=0)
    contention: Contention
    loss: LossCurve
    instances: list[InstanceProfile] = Field(min_length=1)
    uncertainty: Uncertainty | None = None

    @field_validator("instances")
    @classmethod
    def _unique_types(cls, instances: list[InstanceProfile]) -> list[InstanceProfile]:
        seen: set[str] = set()
        for inst in instances:
            if inst.type.lower() in seen:  # P3.2XLARGE beside p3.2xlarge: one type twice, or a typo
                raise ValueError(f"duplicate instance type {inst.type!r}")
            seen.add(inst.type.lower())
        return instances

    @property
    def type_names(self) -> list[str]:
        return [i.type for i in self.instances]

    @property
    def fitted_workers(self) -> tuple[int, int] | None:
        """The smallest and largest cluster the loss curve was fitted on (the fit report's
        `fit_quality.loss-curve.workers`): outside that range a prediction extrapolates the curve's
        n-shape, so the planner plans no smaller cluster (docs/model.md). None: not recorded (a
        profile built from published numbers, as the shipped resnet110 one)."""
        quality = (self.model_extra or {}).get("fit_quality") or {}
        curve = quality.get("loss-curve") or {} if isinstance(quality, dict) else None
        if not isinstance(curve, dict):
            raise UserInputError(f"fit_quality must be an object whose loss-curve is an object, got {quality!r:.80}")
        span = curve.get("workers")
        if span is None:
            return None
        if (not isinstance(span, list) or len(span) != 2 or not all(type(n) is int and n > 0 for n in span)
                or span[0] > span[1]):
            raise UserInputError(f"fit_quality.loss-curve.workers must be [smallest, largest] cluster sizes, got {span!r}")
        return span[0], span[1]

    def instance(self, type_name: str) -> InstanceProfile:
        for inst in self.instances:
            if inst.type == type_name:
                return inst
        raise UserInputError(
            f"unknown instance type {type_name!r} (profile {self.workload!r} has: {', '.join(self.type_names)})"
        )


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line naming the first bad field, e.g. `instances.2.compute_time_s: must be > 0`."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"]
    if first["type"] == "missing":
        msg = "missing field"
    more = len(err.errors()) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{source}: {loc}: {msg}{suffix}"


def profile_from_dict(data: Any, source: str = "profile") -> Profile:
    if not isinstance(data, dict):
        raise UserInputError(f"{source}: expected a JSON object at the top level")
    try:
        profile = Profile.model_validate(data)
    except ValidationError as err:
        raise UserInputError(format_validation_error(err, source)) from None
    try:
        profile.fitted_workers  # noqa: B018 (checks the fit report's range once, at load)
    except UserInputError as err:
        raise UserInputError(f"{source}: {err}") from None
    return profile


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    data = loads_json(read_text(path, "profile"), str(path))
    return profile_from_dict(data, source=str(path))
