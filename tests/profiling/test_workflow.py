"""The profiling orchestration `spotfill profile` and the pipeline share: the steps, their order,
the cache key and a run's rules, on made-up measurements (no process starts)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tasks.profiling import workflow
from tasks.profiling.measurements import ProfilingError
from tasks.profiling.presets import QUICK
from tasks.profiling.store import profile_dir
from tasks.profiling.workflow import (
    ProfilingJob, cache_key, fit_and_save, measure_clusters, measure_type, measured_wall_s, profile_workload,
)
from tests.profiling.synthetic import synthetic_measurements

TYPES = ["fast", "slow"]
PRESET = dataclasses.replace(QUICK, workload="synthetic", workload_options={"seq_len": 8}, types=tuple(TYPES),
                             fit_clusters=({"fast": 1, "slow": 1}, {"fast": 1, "slow": 3}, {"fast": 6, "slow": 1}))
EMULATION = {"bandwidth_scale": 0.5, "ps_megabits_per_s": 160.0, "reference_compute_s": 0.1}


class Provider:
    """What the steps ask of a provider besides what the (faked) measurements do."""

    name = "local"

    def __init__(self):
        self.cleaned: list[str] = []

    def cleanup(self, run_id: str) -> int:
        self.cleaned.append(run_id)
        return 0


@pytest.fixture()
def measured(monkeypatch) -> dict:
    """The single-type and cluster measurements made up; what each was asked, recorded."""
    types, clusters = synthetic_measurements()
    asked = {"types": [], "clusters": []}

    def profile_type(provider, run_id, workload, instance_type, **options):
        asked["types"].append((run_id, workload, instance_type, options))
        return next(m for m in types if m.type == instance_type)

    def profile_clusters(provider, run_id, workload, measurements, fit_clusters, **options):
        asked["clusters"].append((run_id, workload, fit_clusters, options))
        return clusters

    monkeypatch.setattr(workflow, "profile_type", profile_type)
    monkeypatch.setattr(workflow, "profile_clusters", profile_clusters)
    return asked


@pytest.mark.integration  # saving a profile records the code version (git)
def test_spotfill_profile_runs_the_steps_in_order_and_then_reuses_the_profile(measured, tmp_path):
    provider, job = Provider(), ProfilingJob(PRESET, EMULATION, "local")
    stages = []
    path, summary = profile_workload(provider, job, directory=tmp_path, run_id="profile-x", on_stage=stages.append)
    assert stages == list(workflow.PROFILING_STAGES) and not summary["cached"]
    assert sorted(t for _, _, t, _ in measured["types"]) == TYPES
    assert all(o == {"iterations": 30, "workload_options": {"seq_len": 8}, "batch_per_gpu": 16, "ps_megabits_per_s": 160.0}
               for *_, o in measured["types"])
    (clusters,) = measured["clusters"]
    assert clusters[:3] == ("profile-x-clusters", "synthetic", list(PRESET.fit_clusters))
    assert clusters[3]["async_rule"] is None and clusters[3]["budget_s"] == PRESET.cluster_budget_s
    assert sorted(provider.cleaned) == ["profile-x-clusters", "profile-x-fast", "profile-x-slow"]
    assert path == profile_dir(tmp_path, "synthetic", cache_key(job, TYPES)) / "profile.json"
    data = json.loads(path.read_text())
    assert data["provenance"]["settings"] == job.settings() and data["provenance"]["provider"] == "local"
    assert list(data["provenance"]["wall_s"]) == ["types_total", "type:fast", "type:slow", "clusters_total", "total"]
    assert [i["quota"] for i in data["instances"]] == [8, 8]  # fit_profile's default
    assert profile_workload(provider, job, directory=tmp_path) == (path, {"cached": True})
    assert len(measured["clusters"]) == 1  # nothing measured again


@pytest.mark.integration  # saving a profile records the code version (git)
def test_a_runs_job_trains_under_its_rule_writes_its_quotas_and_checks_its_target(measured, tmp_path):
    provider = Provider()
    job = ProfilingJob(PRESET, EMULATION, "local", async_rule="momentum", quotas={"fast": 3, "slow": 1},
                       target_loss=1.7, provenance_settings={"preset": "quick"})
    measurements = [measure_type(job, provider, "run-x-profile", t) for t in TYPES]
    clusters = measure_clusters(job, provider, "run-x-profile", measurements)
    assert measured["clusters"][0][3]["async_rule"] == "momentum"
    path, _ = fit_and_save(job, measurements, clusters, tmp_path, measured_wall_s(measurements, clusters))
    data = json.loads(path.read_text())
    assert {i["type"]: i["quota"] for i in data["instances"]} == {"fast": 3, "slow": 1}
    assert data["provenance"]["settings"] == {"preset": "quick"}
    assert list(data["provenance"]["wall_s"]) == ["type:fast", "type:slow", "clusters_total"]
    assert path.parent == profile_dir(tmp_path, "synthetic", cache_key(job, TYPES))
    assert measured["clusters"][0][3]["target_loss"] == 1.7  # the clusters train toward it
    with pytest.raises(ProfilingError, match="loss target 0.5 is unreachable: .* levels off at gamma5"):
        fit_and_save(dataclasses.replace(job, target_loss=0.5), measurements, clusters, tmp_path / "low", {})
    assert not (tmp_path / "low").exists()  # refused before anything is saved


def test_one_key_covers_what_decides_the_measurements():
    job = ProfilingJob(PRESET, EMULATION, "local")
    key = cache_key(job, TYPES)
    assert key == cache_key(ProfilingJob(PRESET, dict(EMULATION), "local"), list(reversed(TYPES)))
    assert key != cache_key(job, ["fast"])
    assert key == cache_key(dataclasses.replace(job, quotas={"fast": 1},
                                                provenance_settings={"preset": "quick"}), TYPES)  # not measured
    for changed in (dataclasses.replace(job, async_rule="momentum"), dataclasses.replace(job, provider_name="aws"),
                    dataclasses.replace(job, target_loss=1.0),  # the clusters train toward it
                    dataclasses.replace(job, emulation={**EMULATION, "ps_megabits_per_s": 80.0}),
                    dataclasses.replace(job, preset=dataclasses.replace(PRESET, cluster_budget_s=60.0)),
                    dataclasses.replace(job, preset=dataclasses.replace(PRESET, workload_options={"seq_len": 16}))):
        assert cache_key(changed, TYPES) != key
