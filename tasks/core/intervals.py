"""Prediction intervals from a profile's measured error spread (docs/model.md, Uncertainty).

A fitted profile carries `uncertainty.time_log_sd`: the spread of log(observed / predicted) time
on clusters the fit did not see (tasks/profiling/fit.py, choose_form). Taking that error as normal
in log space and centred, a two-sided interval at level L around a predicted time T is
[T / f, T * f] with f = exp(z * sd), z the (1 + L) / 2 quantile of the standard normal: the
interval is a fixed factor of the prediction, so a plan that must finish by the deadline at the
interval's upper end is a plan for the deadline divided by f.
"""
from __future__ import annotations

import math
from statistics import NormalDist

from tasks.core.errors import UserInputError
from tasks.core.profile import Profile

DEFAULT_LEVEL = 0.9


def check_level(level: float, what: str = "level") -> float:
    """A two-sided level in (0, 1) whose upper quantile (1 + level) / 2 is still below 1 in floats."""
    if not (math.isfinite(level) and 0.0 < level < 1.0):
        raise UserInputError(f"{what} must be in (0, 1), got {level}")
    if not (1.0 + level) / 2.0 < 1.0:
        raise UserInputError(f"{what} {level!r} is too close to 1 for an interval (the normal quantile is infinite)")
    return level


def time_factor(profile: Profile, level: float, what: str = "level") -> float:
    """f: the interval at `level` is [T / f, T * f]. A profile without a measured spread has no
    interval (UserInputError naming the missing field)."""
    check_level(level, what)
    if profile.uncertainty is None:
        raise UserInputError(f"profile {profile.workload!r} has no uncertainty.time_log_sd (the error spread "
                             f"`spotfill profile` measures), so it gives no interval for {what} {level}")
    try:
        return math.exp(NormalDist().inv_cdf(0.5 + level / 2.0) * profile.uncertainty.time_log_sd)
    except OverflowError:
        raise UserInputError(f"profile {profile.workload!r}: uncertainty.time_log_sd = "
                             f"{profile.uncertainty.time_log_sd:g} gives an interval beyond any number") from None


def time_interval_s(profile: Profile, level: float, predicted_s: float) -> tuple[float, float]:
    f = time_factor(profile, level)
    return predicted_s / f, predicted_s * f
