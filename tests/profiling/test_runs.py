"""Profiling on real runs of the local provider (a PS and workers as processes): bounded, cleaned up."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tasks.profiling.measurements import ProfilingError
from tasks.profiling.presets import QUICK
from tasks.profiling.single import param_mb, profile_type
from tasks.profiling.workflow import ProfilingJob, profile_workload
from tasks.providers.local import LocalProvider, _proc_start_ticks

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OPTIONS = {"seq_len": 8, "d_model": 16, "layers": 1, "heads": 2}


@pytest.fixture()
def provider(tmp_path):
    size_mb = param_mb("transformer-lm", OPTIONS)
    # one worker alone: 0.05 s compute (p3.2xlarge is the reference), ~0.02 s push + pull
    p = LocalProvider(tmp_path / "artifacts", bandwidth_scale=2 * size_mb * 8 / 0.02 / 10_000, reference_compute_s=0.05)
    yield p
    p.kill_all_started()


def _assert_nothing_left(provider):
    for table in provider.artifacts_dir.glob("*/instances.json"):
        run_id = table.parent.name
        assert provider.describe(run_id) == []
        for row in provider._load(run_id)["instances"]:
            assert _proc_start_ticks(row["pid"]) is None


def test_profile_type_measures_compute_comm_size_and_memory(provider):
    m = profile_type(provider, "single", "transformer-lm", "p3.2xlarge", iterations=10, workload_options=OPTIONS,
                     batch_per_gpu=4, ps_megabits_per_s=1000.0, memory_batches=(1, 2, 4))
    assert m.gpus == 1 and m.batch_per_gpu == 4 and m.iterations == 10 and len(m.steps) == 10
    assert m.compute_time_s >= 0.05 * 0.99  # padded up to the reference compute time (never below it)
    assert m.param_mb == param_mb("transformer-lm", OPTIONS)
    assert m.required_bandwidth_mbps == pytest.approx(2 * m.param_mb / m.comm_time_s)
    assert [p.batch_per_gpu for p in m.memory_points] == [1, 2, 4] and m.alpha2 > 0
    assert m.memory_device == "cpu" and m.max_batch_per_gpu >= 1
    _assert_nothing_left(provider)


def test_a_diverging_run_is_a_clear_error_and_writes_no_profile(provider, tmp_path):
    preset = dataclasses.replace(QUICK, workload="tests.profiling_workloads:diverging", workload_options={},
                                 types=("p3.2xlarge",), iterations=12)
    emulation = {"ps_megabits_per_s": 1000.0, "reference_compute_s": 0.05}
    with pytest.raises(ProfilingError, match="diverged"):
        profile_workload(provider, ProfilingJob(preset, emulation, provider.name), directory=tmp_path / "profiles",
                         run_id="diverge")
    assert not (tmp_path / "profiles").exists() or not any((tmp_path / "profiles").rglob("*"))
    _assert_nothing_left(provider)


def test_validation_repeats_a_configuration_and_scores_the_mean(provider):
    from tasks.core.profile import load_profile
    from tasks.profiling.validate import validate_profile

    shipped = load_profile("profiles/transformer-lm-local-quick.json")
    profile = shipped.model_copy(update={"workload": "transformer-lm"})
    seen = []
    report = validate_profile(provider, profile, "transformer-lm", [{"p3.2xlarge": 1}], 3.5, run_id="val",
                              workload_options=OPTIONS, ps_megabits_per_s=1000.0, repeats=2,
                              on_run=lambda cluster, run: seen.append((cluster, run)))
    (result,) = report.configs
    assert len(result.runs) == 2 and all(r.observed_iterations >= 1 for r in result.runs)
    assert seen == [({"p3.2xlarge": 1}, r) for r in result.runs]  # progress after each run
    assert result.observed_iterations == pytest.approx(sum(r.observed_iterations for r in result.runs) / 2)
    assert result.observed_time_s == pytest.approx(sum(r.observed_time_s for r in result.runs) / 2)
    assert result.time_error == pytest.approx(abs(result.predicted_time_s - result.observed_time_s) / result.observed_time_s)
    _assert_nothing_left(provider)
    with pytest.raises(ProfilingError, match="repeats must be at least 1"):
        validate_profile(provider, profile, "transformer-lm", [{"p3.2xlarge": 1}], 3.5, repeats=0)


def test_clusters_train_in_waves_and_all_are_measured(provider):
    from tasks.profiling.clusters import band_reached, profile_clusters

    m = profile_type(provider, "alone", "transformer-lm", "p3.2xlarge", iterations=6, workload_options=OPTIONS,
                     batch_per_gpu=4, ps_megabits_per_s=1000.0, memory_batches=(1, 2, 4))
    clusters = [{"p3.2xlarge": 2}, {"p3.2xlarge": 1}]
    measured = profile_clusters(provider, "waves", "transformer-lm", [m], clusters, duration_s=1.0,
                                workload_options=OPTIONS, ps_megabits_per_s=1000.0, side_by_side=1)
    assert [c.cluster for c in measured] == clusters and [c.n for c in measured] == [2, 1]
    assert band_reached([c.losses for c in measured])  # a wave left behind by a later one was trained again
    import json

    def update_times(k):
        lines = (provider.artifacts_dir / f"waves-c{k}" / "telemetry.jsonl").read_text().splitlines()
        return [r["t"] for r in map(json.loads, lines) if r["kind"] == "update"]

    assert update_times(0)[-1] < update_times(1)[0]  # one wave after the other
    _assert_nothing_left(provider)
    with pytest.raises(ProfilingError, match="side_by_side must be at least 1"):
        profile_clusters(provider, "waves0", "transformer-lm", [m], clusters, side_by_side=0)


def test_clusters_that_share_no_loss_band_within_the_budget_say_to_raise_it(provider):
    """A model whose loss never falls: the clusters train past their duration until the budget
    ends, then one error naming the flag; nothing is left running."""
    from tasks.profiling.clusters import profile_clusters

    spec = "tests.plugins.broken:never_learns"
    m = profile_type(provider, "flat", spec, "p3.2xlarge", iterations=6, batch_per_gpu=4,
                     ps_megabits_per_s=1000.0, memory_batches=(1, 2, 4))
    with pytest.raises(ProfilingError, match=r"within the profiling budget of 20 s .*raise --profile-budget-s"):
        profile_clusters(provider, "flat-clusters", spec, [m], [{"p3.2xlarge": 2}, {"p3.2xlarge": 1}],
                         duration_s=1.0, ps_megabits_per_s=1000.0, budget_s=20.0)
    _assert_nothing_left(provider)


def test_training_a_diverging_workload_stops_and_exits_1_with_one_line(tmp_path, capsys):
    from tasks.cli.main import main

    status = main(["train", "--workload", "tests.profiling_workloads:diverging", "--workers", "p3.2xlarge=1",
                   "--batch-size", "8", "--max-updates", "500", "--timeout-s", "120", "--json",
                   "--artifacts", str(tmp_path / "artifacts")])
    out, err = capsys.readouterr()
    assert status == 1 and json.loads(out)["stopped"] == "diverged"
    (line,) = [line for line in err.splitlines() if line.startswith("spotfill: ")]
    assert "the loss diverged (NaN or infinite" in line
