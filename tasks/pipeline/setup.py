"""A run's setup: its request resolved once, at the start, and handed down to the stages.

The profiling preset narrowed to the request, the AWS config, the local provider's emulation, the
one provider the run uses and the types it offers. Stages take this rather than deriving them
from the request again: a run builds one provider (on AWS, listing types is a catalog refresh),
and what is profiled is emulated the way the run trains.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from tasks.core.errors import UserInputError
from tasks.pipeline.params import TrainRequest, profiled_curve
from tasks.profiling.presets import Preset, local_provider, preset
from tasks.profiling.workflow import ProfilingJob
from tasks.providers.aws import AwsConfig, AwsProvider, load_aws_config
from tasks.providers.base import InstanceType, Provider


@dataclass(frozen=True)
class RunSetup:
    """What a run works with. `resolve_setup` gives the part the request alone decides (what
    `spotfill run` checks before it starts anything); `open_setup` adds the provider."""

    request: TrainRequest
    preset: Preset  # the profiling preset, narrowed to the request's workload and types
    aws: AwsConfig | None = None  # None: the local provider
    emulation: dict = field(default_factory=dict)  # the local provider's network emulation; {} on AWS
    provider: Provider | None = None  # None: a setup that only checks and plans, with no prices
    offered: dict[str, InstanceType] = field(default_factory=dict)  # the provider's types, listed once

    @property
    def profiling(self) -> ProfilingJob:
        """The profiling of a run given no profile: the preset under the run's emulation, async
        rule, quotas and loss target; its profile names the request's preset as its settings."""
        r = self.request
        return ProfilingJob(self.preset, self.emulation, r.provider.name, async_rule=r.async_rule,
                            quotas={t: r.candidates.quota(t) for t in r.candidates.types},
                            target_loss=r.slo.curve_target, target_metric=r.slo.target_metric,
                            provenance_settings={"preset": r.profiling, **profiled_curve(r.slo)})


def profiling_preset(request: TrainRequest) -> Preset:
    """The profiling preset (tasks/profiling/presets.py) narrowed to this request's workload and
    candidate types: how long to profile, and how the local provider emulates the network."""
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


def aws_config(request: TrainRequest) -> AwsConfig:
    """The run's AwsConfig: its `provider.aws` fields, region and budget caps (one line per bad field)."""
    settings = request.provider
    return load_aws_config({**settings.aws, "region": settings.region, "max_instances": request.budget.max_instances,
                            "max_usd_per_hour": request.budget.max_usd_per_h})


def resolve_setup(request: TrainRequest) -> RunSetup:
    """The setup the request alone decides: no provider, no emulation (that builds the model).
    An AWS run needs a checkpoint bucket: its lease lives there (tasks/runtime/lease.py), the one
    place both the orchestrator and the PS's instance reach; a lease in the orchestrator's run
    folder would be missing on the PS's instance, which would read it as lapsed and stop."""
    aws = aws_config(request) if request.provider.name == "aws" else None
    if aws is not None and not aws.checkpoint_bucket:
        raise UserInputError("an AWS run needs a checkpoint bucket (--checkpoint-bucket, or "
                             "provider.aws.checkpoint_bucket): its lease and checkpoints live there, "
                             "where the parameter server's instance reads them")
    return RunSetup(request, profiling_preset(request), aws=aws)


def open_setup(request: TrainRequest) -> RunSetup:
    """The setup a run starts with: resolve_setup, the run's one provider (local: emulating the
    network the profile is measured under, so that what is predicted is what runs) and the types
    it offers, every candidate among them."""
    setup = resolve_setup(request)
    settings = request.provider
    emulation: dict = {}
    if setup.aws is None:
        provider, emulation = local_provider(setup.preset, Path(request.artifacts_dir))
        provider.capacity.update(settings.capacity)
    else:
        provider = AwsProvider(setup.aws)
    offered = {t.name: t for t in provider.list_types()}
    missing = [t for t in request.candidates.types if t not in offered]
    if missing:
        raise UserInputError(f"the {settings.name} provider does not offer {', '.join(missing)}")
    return replace(setup, emulation=emulation, provider=provider, offered=offered)
