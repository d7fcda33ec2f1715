"""The GPU side of filling, as far as a CPU machine can check it: the profile's bubble, the device
time hooks (CUDA events feed the guard and the cost models), the memory check before anything
starts, the targets of `bench gpu`, and every CUDA entry point failing cleanly without a device
(`python3 -m tasks.cli.main bench gpu` included, with Prefect and boto3 unimportable)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tasks.bench import filling as bench
from tasks.bench.trainloop import TrainingJob
from tasks.core.errors import UserInputError
from tasks.filling.attach import (CONFIG_ENV, FillConfig, assemble, check_memory_fits,
                                  worker_fill_config)
from tasks.filling.guard import StepTimeGuard
from tasks.filling.monitor import BubbleMonitor
from tests.helpers import LOCAL_QUICK_PROFILE, REPO, fake_result

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")


def test_bubble_is_the_push_and_pull_of_the_named_type():
    s_mb = 6.95
    # resnet110-cifar100: Breq 142 MB/s, Bpcie 10000 MB/s; p3.2xlarge has 1 GPU, p2.8xlarge 8
    assert bench.profile_bubble_s(s_mb, "p3.2xlarge") == pytest.approx(2 * s_mb / 142 + 2 * s_mb / 10000)
    assert bench.profile_bubble_s(s_mb, "p2.8xlarge") == pytest.approx(2 * s_mb / 142 + 16 * s_mb / 10000)
    assert bench.profile_bubble_s(s_mb, "p3.2xlarge", scale=0.5) == pytest.approx(
        bench.profile_bubble_s(s_mb, "p3.2xlarge") / 2)


def test_a_type_with_its_own_required_bandwidth_uses_it():
    bubble_s = bench.profile_bubble_s(1.0, "p3.2xlarge", LOCAL_QUICK_PROFILE)
    assert bubble_s == pytest.approx(2 / 18.35745702237873 + 2 / 1e6)


@pytest.mark.parametrize("kwargs,fragment", [({"instance_type": "z9.huge"}, "unknown instance type"),
                                             ({"bubble_scale": 0.0}, "--bubble-scale must be > 0")])
def test_bad_bubble_options_are_refused_before_any_work(kwargs, fragment):
    with pytest.raises(UserInputError, match=fragment):
        bench.check_options([20.0], **kwargs)


def test_device_compute_time_replaces_the_host_clock_for_the_guard():
    seen = []
    monitor = BubbleMonitor(clock=lambda: 100.0)
    monitor.on_compute_time(seen.append)
    monitor.compute_start(0)
    monitor.compute_end(0, 0.0275)  # what the CUDA events measured
    monitor.compute_start(1)
    monitor.compute_end(1)  # host clock: 0 s here
    assert seen == [0.0275, 0.0]


def test_guard_reports_what_inference_cost_the_compute_phase():
    guard = StepTimeGuard(tolerance=0.5, calibration_steps=2)
    assert guard.slowdown() is None
    for compute_s in (1.0, 1.0, 1.0):
        guard.observe_compute_s(compute_s, clean=True)
    guard.observe_compute_s(1.2, clean=False)
    guard.observe_compute_s(1.4, clean=False)
    assert guard.slowdown() == pytest.approx(0.3)


class DeviceTimedExecutor:
    """Stands in for the CUDA executor: its chunks 'take' 0.5 s on the device."""
    device = "fake"

    def lane_setup(self, lane: str) -> None:
        pass

    def run(self, chunk) -> float:
        return 0.5


def test_chunk_costs_learn_from_the_device_time_the_executor_reports():
    filler = assemble(FillConfig(online_rate_per_s=0.0, max_batch=4, dataset_size=8), "gated")
    filler.executor = DeviceTimedExecutor()
    filler.calibrate(repeats=1)
    assert filler.scheduler.costs.cost_s == {1: 0.5, 2: 0.5, 4: 0.5}


def test_training_job_runs_a_runtime_workload_and_hands_edges_to_the_listener():
    job = TrainingJob.from_workload("resnet20", {"width": 4}, batch=4)
    assert job.name == "resnet20" and job.param_mb == pytest.approx(job.param_bytes / 1e6)
    job.set_bubble(0.001)
    monitor = BubbleMonitor()
    times = job.run(2, monitor)
    assert len(times) == 2 and len(monitor.compute_times_s) == 2 and monitor.bubble_count == 2


def test_memory_check_counts_every_copy_and_refuses_before_building_on_a_device():
    config = FillConfig(model="cnn", max_batch=32, memory_budget_mb=1e6)
    check_memory_fits(config)
    one = FillConfig(model="cnn", max_batch=32, memory_budget_mb=10.0)
    with pytest.raises(UserInputError, match=r"inference model cnn x 6 needs ~\d+ MB at batch 32 but only 10 MB"):
        check_memory_fits(one, copies=6)


def test_worker_takes_fill_fields_from_the_environment(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, '{"model": "transformer", "max_batch": 4}')
    config = worker_fill_config({"online_rate_per_s": 3.0})
    assert (config.model, config.max_batch, config.online_rate_per_s) == ("transformer", 4, 3.0)
    monkeypatch.setenv(CONFIG_ENV, '{"model": "resnet18"}')
    with pytest.raises(UserInputError, match="^fill config from SPOTFILL_FILL_CONFIG: model"):
        worker_fill_config({})
    monkeypatch.setenv(CONFIG_ENV, '{"seed": {"nested": 1}}')  # a nested value names the variable too
    with pytest.raises(UserInputError, match="^fill config from SPOTFILL_FILL_CONFIG: seed"):
        worker_fill_config({})
    monkeypatch.setenv(CONFIG_ENV, "{model")
    with pytest.raises(UserInputError, match=f"^{CONFIG_ENV}: not valid JSON"):
        worker_fill_config({})
    monkeypatch.setenv(CONFIG_ENV, '{"max_batch": 4, "max_batch": 64}')  # which one counts is the reader's guess
    with pytest.raises(UserInputError, match=f"^{CONFIG_ENV}: key 'max_batch' is given twice in one object"):
        worker_fill_config({})


def test_targets_are_judged_with_their_direction():
    from tasks.bench.filling import judge
    from tasks.bench.gpu import TARGETS, served_share

    checks = judge({"training_retained": 0.99, "fill_efficiency": 0.4, "online_p95_s": 0.05,
                    "spill_share_of_training_time": 0.03, "offline_share_of_solo": None,
                    "online_served_share": 0.995}, TARGETS)
    assert [k for k, c in checks.items() if c["met"]] == ["training_retained", "online_p95_s",
                                                          "online_served_share"]
    assert checks["fill_efficiency"]["target"] == ">= 0.5"
    assert served_share({"online_served": 99, "online_shed": 1}) == pytest.approx(0.99)
    assert served_share({"online_served": 0, "online_shed": 0}) is None


def test_the_check_judges_every_mode_against_the_targets_and_counts_the_rounds():
    from tasks.bench.gpu import TARGETS, filling_summary

    result = fake_result(20.0)
    result["modes"]["naive"].update(training_retained=0.7, online_p95_s=0.09)
    result["modes"]["rate_limited"].update(online_served=90, online_shed=10)
    summary = filling_summary(result)
    assert (summary["online_rate_per_s"], summary["slo_s"], summary["rounds"]) == (20.0, 0.5, 12)
    assert set(summary["checks"]) == {*TARGETS, "rounds"} and all(c["met"] for c in summary["checks"].values())
    naive = summary["modes"]["naive"]["checks"]
    assert [k for k, c in naive.items() if not c["met"]] == ["training_retained", "online_p95_s"]
    assert naive["training_retained"] == {"value": 0.7, "target": ">= 0.98", "met": False}
    assert summary["modes"]["rate_limited"]["online_served_share"] == pytest.approx(0.9)
    assert not summary["modes"]["rate_limited"]["checks"]["online_served_share"]["met"]
    result["settings"]["rounds_run"] = 2
    assert not filling_summary(result)["checks"]["rounds"]["met"]


def test_the_check_output_is_strict_json_whatever_numbers_the_sections_return():
    import json

    import numpy as np

    from tasks.bench.gpu import json_safe

    raw = {"r2": np.float64(0.5), "n": np.int64(3), "loss": float("nan"), "cap": np.float32("inf"),
           "by_batch": {64: [np.float64(1.5), None]}, "arr": np.array([1, 2]), "name": "x"}
    safe = json_safe(raw)
    assert safe == {"r2": 0.5, "n": 3, "loss": None, "cap": None, "by_batch": {"64": [1.5, None]},
                    "arr": [1, 2], "name": "x"}
    json.dumps(safe, allow_nan=False)


def test_bench_gpu_refuses_models_the_gpu_memory_cannot_hold_before_any_section(monkeypatch, capsys):
    """A CUDA machine whose GPU has 50 MiB free: one line naming the model, exit 2, nothing run."""
    from tasks.cli.main import main
    from tasks.bench import gpu as gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (50 * 2**20, 80 * 2**30))

    def must_not_run():
        raise AssertionError("a section ran")

    monkeypatch.setattr(gpu_check, "SECTIONS", dict.fromkeys(gpu_check.SECTIONS, must_not_run))
    assert main(["bench", "gpu", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "inference model resnet50 x 5 needs ~" in err and "only 50 MB remain" in err


def test_profile_section_runs_its_code_on_the_cpu():
    """The GPU profile's code path, on the CPU with a small model: step times, peak memory per
    batch, the memory fit and the largest batch."""
    from tasks.bench.gpu import profile_section

    out = profile_section("resnet20", (2, 4, 8), steps=1, options={"width": 4}, device="cpu")
    assert out["device"] == "cpu" and set(out["step_ms"]) == {2, 4, 8}
    assert all(ms > 0 for ms in out["step_ms"].values())
    assert out["peak_mb"][8] > out["peak_mb"][2] > 0
    assert out["max_batch_per_gpu"] > 8


@no_cuda
def test_cuda_entry_points_fail_cleanly_without_a_device():
    from tasks.bench import gpu as gpu_check
    from tasks.filling.cuda_timing import DeviceTimedPhases
    from tasks.filling.executor import (CudaExecutor, lowest_priority_stream, training_stream,
                                        training_stream_scope)
    from tasks.filling.models import build_workload

    for call in (lambda: training_stream(), lambda: lowest_priority_stream("cuda"),
                 lambda: training_stream_scope("cuda"),
                 lambda: CudaExecutor(build_workload("cnn", 4)), lambda: DeviceTimedPhases(None),
                 lambda: TrainingJob(batch=4, width=4, device="cuda")):
        with pytest.raises(RuntimeError, match="no CUDA device"):
            call()
    for call in (lambda: bench.run_bench(quick=True, device="cuda"), gpu_check.preflight,
                 gpu_check.profile_section, lambda: check_memory_fits(FillConfig(device="cuda"))):
        with pytest.raises(UserInputError, match="no CUDA device|sees none"):
            call()


def test_a_filling_worker_computes_on_the_highest_priority_stream_on_cuda_only():
    from tasks.filling.executor import training_stream_scope
    from tasks.runtime.worker import fill_stream_scope

    with fill_stream_scope(None, "cuda"):  # no filler: the worker's streams are left alone
        pass
    with fill_stream_scope(object(), "cpu"), training_stream_scope("cpu"):
        pass
    if not torch.cuda.is_available():
        return
    _least, greatest = torch.cuda.Stream.priority_range()
    with fill_stream_scope(object(), "cuda"):
        assert torch.cuda.current_stream().priority == greatest
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


BLOCKED = """
import runpy, sys
for name in ("prefect", "boto3", "botocore"):
    sys.modules[name] = None  # any import of them now raises ImportError
sys.argv = ["tasks.cli.main", "bench", "gpu", "--json"]
runpy.run_module("tasks.cli.main", run_name="__main__", alter_sys=True)
"""


@pytest.mark.integration
@no_cuda
def test_bench_gpu_without_cuda_is_one_line_exit_2_and_needs_neither_prefect_nor_boto3():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", BLOCKED], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "CUDA" in proc.stderr, proc.stderr


GPUS_SECTION_ON_CPU = """
import json, sys
for name in ("prefect", "boto3", "botocore"):
    sys.modules[name] = None  # any import of them now raises ImportError
from tasks.bench.gpu import gpus_section
print(json.dumps(gpus_section(window_s=1.0, workload="resnet20", options={"width": 4}, batch_per_gpu=2,
                              device="cpu", artifacts_dir=sys.argv[1])))
"""


@pytest.mark.integration
def test_bench_gpus_multi_gpu_section_runs_the_replicas_path_on_the_cpu_without_prefect_or_boto3(tmp_path):
    """bench gpu's gpus section, on the CPU: the same code it drives on GPUs (a worker of an
    instance with two replicas, their sum over the local group), with Prefect and boto3 blocked."""
    import json

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", GPUS_SECTION_ON_CPU, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["gpus"], out["device"]) == (2, "cpu") and out["samples_per_s"] > 0
    assert out["sums"] > 0 and out["intra_sum_s"] >= 0  # each update carried the instance's sum


def test_gpu_check_keeps_going_past_a_failing_section_and_prints_one_json_object(monkeypatch, capsys):
    """run_bench and the table on made-up sections: a section that raises records one line."""
    import json
    from types import SimpleNamespace

    from tasks.cli.main import main
    from tasks.bench import gpu as gpu_check

    fake_torch = SimpleNamespace(__version__="2.x", version=SimpleNamespace(cuda="13.0"),
                                 cuda=SimpleNamespace(get_device_name=lambda: "Fake GPU"))
    monkeypatch.setattr(gpu_check, "_require_cuda", lambda: fake_torch)
    monkeypatch.setattr(gpu_check, "preflight", lambda: None)
    filling = gpu_check.filling_summary(fake_result(20.0))

    def broken(left_s):
        raise RuntimeError("CUDA out of memory\nsecond line")

    def unfit(left_s):  # a user-input error inside a section is that section's, not the check's end
        raise UserInputError("memory fit: too few points")

    def exits(left_s):  # a worker run in-process gives up with SystemExit: that section's end only
        raise SystemExit("spotfill worker: the parameter server did not come back within 60 s")

    monkeypatch.setattr(gpu_check, "SECTIONS", {"filling": lambda left_s: filling, "runtime": broken,
                                                "profile": unfit, "train": exits})
    assert main(["bench", "gpu", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["device_name"] == "Fake GPU" and result["runtime"]["error"] == "RuntimeError: CUDA out of memory"
    assert result["targets_met"] is True and result["profile"]["error"] == "UserInputError: memory fit: too few points"
    assert result["train"]["error"].startswith("SystemExit: spotfill worker: the parameter server did not come back")
    # every section's numbers reach stderr as it ends, so a check killed at its limit keeps them
    progress = [line for line in err.splitlines() if line.startswith("bench gpu: ")]
    assert [line.split(":")[1].strip() for line in progress] == ["filling", "runtime", "profile", "train"]
    assert json.loads(progress[-1].split(": ", 2)[2])["error"] == result["train"]["error"]
    table = gpu_check.format_table(result)
    assert "Fake GPU" in table and "runtime" in table and "too few points" in table and "target online_p95_s <= 0.05: 0.01 met" in table
    assert "target rounds >= 3: 12 met" in table


def test_gpu_check_tells_each_section_the_time_left_and_skips_one_with_none(monkeypatch):
    from types import SimpleNamespace

    from tasks.bench import gpu as gpu_check

    fake_torch = SimpleNamespace(__version__="2.x", version=SimpleNamespace(cuda="13.0"),
                                 cuda=SimpleNamespace(get_device_name=lambda: "Fake GPU"))
    monkeypatch.setattr(gpu_check, "_require_cuda", lambda: fake_torch)
    monkeypatch.setattr(gpu_check, "preflight", lambda: None)
    told = []

    def section(left_s):
        told.append(left_s)
        return {}

    def spends_it_all(left_s):
        told.append(left_s)
        monkeypatch.setattr(gpu_check, "CHECK_BUDGET_S", 0.0)  # as if this section had taken it all
        return {}

    monkeypatch.setattr(gpu_check, "SECTIONS", {"filling": section, "runtime": spends_it_all,
                                                "profile": section, "train": section})
    budget_s = gpu_check.CHECK_BUDGET_S
    result = gpu_check.run_bench()
    assert len(told) == 2 and 0 < told[1] <= told[0] <= budget_s
    assert result["profile"]["error"] == result["train"]["error"] == "TimeoutError: skipped: the check's 0 s were spent"


def test_run_report_sums_the_workers_harvest_and_keeps_the_worst_slowdown(tmp_path):
    import json

    from tasks.filling.attach import read_worker_metrics
    from tasks.pipeline.report import inference_harvested

    (tmp_path / "filling").mkdir()
    for name, samples, slowdown in (("a", 100, 0.01), ("b", 50, 0.03), ("c", 7, None)):
        (tmp_path / "filling" / f"{name}.json").write_text(json.dumps(
            {"offline_samples": samples, "online_served": 2, "compute_slowdown": slowdown}))
    (tmp_path / "filling" / "d.json").write_text("{half")  # a worker caught mid-write
    assert len(read_worker_metrics(tmp_path / "filling")) == 3
    totals = inference_harvested(tmp_path)
    assert (totals["workers"], totals["offline_samples"], totals["online_requests"]) == (3, 157, 6)
    assert totals["compute_slowdown_max"] == pytest.approx(0.03)


@pytest.mark.integration
def test_train_section_stops_at_once_with_the_workers_last_words_when_they_all_exit(tmp_path):
    """A worker that cannot start (here: a fill config naming no known model) must not cost the
    check its 90 s wait for a first update: the section ends when no worker is left, with the
    line the worker died on, and leaves no process behind."""
    from tasks.bench import gpu as gpu_check
    from tasks.providers.local import LocalProvider

    bad_fill = {**gpu_check.TRAIN_FILL, "model": "no-such-model"}
    with pytest.raises(RuntimeError, match="every worker exited; .*log ends: .*fill config from SPOTFILL_FILL_CONFIG: model"):
        gpu_check.train_section(window_s=1.0, workload="transformer-lm", options={"seq_len": 8}, batch=2,
                                fill=bad_fill, device="cpu", artifacts_dir=tmp_path)
    (run_id,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("gpu-check-")]
    assert LocalProvider(tmp_path).describe(run_id) == []


def test_the_runtime_bench_starts_no_case_past_its_time(monkeypatch):
    """bench gpu's runtime section gives the cases a time; one that would start after it is named,
    not run (the profile and train sections keep their share of the check)."""
    from tasks.bench import runtime as bench

    ran = []
    monkeypatch.setattr(bench, "overhead", lambda runs, case, **kw: ran.append(case.label) or {})
    result = bench.run_runtime_bench("cpu", quick=True, scaling=False, max_s=0.0)
    assert ran == [] and result["cases"] == [] and result["skipped"] == [c.label for c in bench.CPU_CASES] + ["evaluation"]
