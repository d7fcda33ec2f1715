"""The run's setup: the request resolved once, one provider handed down to every stage."""
from __future__ import annotations

import pytest

from tasks.core.errors import UserInputError
from tasks.pipeline.params import TrainRequest
from tasks.pipeline.session import TrainingSession
from tasks.pipeline.setup import open_setup, resolve_setup
from tasks.profiling import workflow
from tasks.providers.aws import AwsConfig
from tests.profiling.synthetic import synthetic_measurements

TYPES = ("p3.2xlarge", "g3.8xlarge")


def request(tmp_path, **patch) -> TrainRequest:
    return TrainRequest.model_validate({
        "workload": "transformer-lm", "workload_options": {"seq_len": 16},
        "slo": {"target_loss": 1.7, "deadline_s": 3000}, "profile_budget_s": 120,
        "candidates": {"types": list(TYPES), "quotas": {"p3.2xlarge": 2, "g3.8xlarge": 2}},
        "artifacts_dir": str(tmp_path)} | patch)


def test_the_request_alone_decides_the_preset_and_the_aws_config(tmp_path):
    setup = resolve_setup(request(tmp_path, candidates={"types": ["g3.8xlarge"]}))
    p = setup.preset
    assert p.workload == "transformer-lm" and p.workload_options == {"seq_len": 16} and p.types == ("g3.8xlarge",)
    assert p.cluster_budget_s == 120 and all(set(c) == {"g3.8xlarge"} for c in p.fit_clusters)
    assert setup.provider is None and setup.aws is None and setup.emulation == {} and setup.offered == {}
    aws = resolve_setup(request(tmp_path, provider={"name": "aws", "region": "us-west-2",
                                                    "aws": {"checkpoint_bucket": "ckpts"}},
                                budget={"max_instances": 5, "max_usd_per_h": 9.0})).aws
    assert isinstance(aws, AwsConfig) and (aws.region, aws.max_instances, aws.max_usd_per_hour) == ("us-west-2", 5, 9.0)


def test_an_aws_run_without_a_checkpoint_bucket_is_refused_before_anything_starts(tmp_path):
    """Its lease would be a file on the orchestrator's machine, which the PS's instance lacks."""
    with pytest.raises(UserInputError, match=r"^an AWS run needs a checkpoint bucket \(--checkpoint-bucket"):
        resolve_setup(request(tmp_path, provider={"name": "aws", "region": "us-west-2"}))


def test_the_profiling_job_carries_the_runs_rules(tmp_path):
    setup = resolve_setup(request(tmp_path, async_rule="momentum", candidates={
        "types": list(TYPES), "quotas": {"p3.2xlarge": 1}}))
    job = setup.profiling
    assert job.preset == setup.preset and job.provider_name == "local" and job.async_rule == "momentum"
    assert job.quotas == {"p3.2xlarge": 1, "g3.8xlarge": 4} and job.target_loss == 1.7
    assert job.provenance_settings == {"preset": "quick"}


@pytest.mark.integration  # saving a profile records the code version (git)
def test_a_run_builds_one_provider_and_every_stage_uses_it(tmp_path, monkeypatch, providers_built):
    """The setup, the flow's profiling tasks (measurements made up), the fit, the session and its
    first plan: one LocalProvider in all, the setup's."""
    from flows.train_with_slo import fit_model, plan, profile_clusters, profile_type

    types, clusters = synthetic_measurements(names=TYPES)
    given = []
    monkeypatch.setattr(workflow, "profile_type", lambda provider, run_id, workload, t, **_: (
        given.append(provider), next(m for m in types if m.type == t))[1])
    monkeypatch.setattr(workflow, "profile_clusters", lambda provider, *_, **__: (given.append(provider), clusters)[1])
    monkeypatch.setattr("flows.train_with_slo.create_table_artifact", lambda *_, **__: None)

    setup = open_setup(request(tmp_path))
    measurements = [profile_type.fn(setup, "run-x-profile", t) for t in TYPES]
    profile = fit_model.fn(setup.profiling, measurements, profile_clusters.fn(setup, "run-x-profile", measurements),
                           tmp_path / "run-x")
    session = TrainingSession(setup, profile, "run-x", tmp_path / "run-x")
    chosen = plan.fn(session)
    assert providers_built == [setup.provider] and given == [setup.provider] * 3 and session.provider is setup.provider
    assert session.plans == [chosen] and chosen.plan and session.alternatives
    assert session.prices == ({t: setup.offered[t].spot_usd_per_h for t in TYPES}  # spot, and each type's
                              | {f"{t}:on-demand": setup.offered[t].on_demand_usd_per_h for t in TYPES})  # on-demand offer
    assert session.ps_megabits_per_s == setup.emulation["ps_megabits_per_s"]


def test_a_provider_that_does_not_offer_a_candidate_is_refused(tmp_path, monkeypatch):
    from tasks.providers.local import LocalProvider

    monkeypatch.setattr(LocalProvider, "list_types", lambda self: [t for t in self.types.values() if t.name != TYPES[1]])
    with pytest.raises(UserInputError, match="the local provider does not offer g3.8xlarge"):
        open_setup(request(tmp_path))
