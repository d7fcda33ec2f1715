"""`spotfill bench gpu [--json]`: the one prepared check for a machine with a CUDA GPU.

Aiming at CHECK_BUDGET_S (330 s) on one GPU, it runs in this order:
1. filling: `bench filling` on the GPU at realistic sizes (resnet110-cifar100 at batch 128 trains,
   a ResNet-50-shaped CNN at 224x224 serves, 20 online requests/s with a 50 ms SLO, the bubble of
   a p3.2xlarge from the profile), >= 3 interleaved rounds per mode, checked against the targets;
2. runtime: the runtime bench's overhead cases on the GPU (`bench runtime --quick` without the
   scaling curves, which emulate compute);
3. profile: one workload's training step (CUDA events) and peak memory
   (torch.cuda.max_memory_allocated) at a few batch sizes, the memory fit (Eq. 10) and the
   largest batch the GPU holds;
4. gpus: the multi-GPU worker (tasks/runtime/replicas.py) on every GPU the machine has: one worker
   of an instance with that many GPUs trains alone, its replicas handed each pull and summing each
   push over NCCL (with one GPU, the same path with one replica: `--sum-in-instance`); its
   samples/s and the intra-instance sum's median seconds;
5. train: a short run of the runtime on the local provider (a PS and one worker on this GPU, links
   shaped to a tenth of the type's NIC) whose worker fills its bubbles with ResNet-50 inference,
   with the harvest and the compute slowdown it reports.
A failing section records its error (one line) and the others still run; each is told the time
left of CHECK_BUDGET_S (the train section's window shortens to fit; one with none left is
skipped). Before anything starts: no CUDA device -> one line, exit 2; inference models that do not
fit the GPU's free memory -> one line naming the model, exit 2. Nothing reached from here imports
Prefect or boto3.
"""
from __future__ import annotations

import gc
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from tasks.bench import filling as filling_bench
from tasks.bench.runtime import emulated_type, run_runtime_bench, samples_per_s_of_one_worker
from tasks.bench.trainloop import TrainingJob
from tasks.core.errors import UserInputError, error_line
from tasks.filling.attach import CONFIG_ENV, check_memory_fits, parse_fill_config, read_worker_metrics
from tasks.profiling.memory import measure_memory
from tasks.providers.local import LocalProvider, REPO
from tasks.runtime import driver

# key of the filling result -> (comparison, threshold): the issue's targets on a GPU
TARGETS = {
    "training_retained": (">=", 0.98),
    "fill_efficiency": (">=", 0.5),
    "offline_share_of_solo": (">=", 0.3),
    "spill_share_of_training_time": ("<=", 0.02),
    "online_p95_s": ("<=", 0.05),
    "online_served_share": (">=", 0.99),
}
CHECK_BUDGET_S = 330.0  # the whole check: six minutes less the interpreter's start and the output
FILLING_MAX_S = 100.0  # no filling round starts after this (>= 3 rounds run regardless)
MIN_ROUNDS = 3  # the retained figure is a median over at least this many rounds
PROFILE_WORKLOAD, PROFILE_BATCHES = "resnet110-cifar100", (64, 128, 256, 512)
TRAIN_WORKLOAD, TRAIN_BATCH, TRAIN_TYPE = "resnet110-cifar100", 128, "p3.2xlarge"
# One worker: on a cluster each worker has its GPU to itself. Two on one GPU would each count the
# other's inference as its own slowdown (stream priorities order work within a process only).
TRAIN_WORKERS = 1
RUNTIME_LEAVES_S = 150.0  # what a runtime case may not start into: the profile, gpus and train sections' time
GPUS_WINDOW_S = 10.0  # the multi-GPU worker's measured window, once it has pushed three times
TRAIN_WINDOW_S = 40.0  # training time after the first update
TRAIN_FIRST_UPDATE_S = 90.0  # the worker starts, builds the model on the GPU and pushes once within this
TRAIN_STOP_S = 20.0  # what the train section keeps of its time for stopping the run and reading the reports
TRAIN_BANDWIDTH_SCALE = 0.1  # links at a tenth of the NIC: push + pull of 7 MB takes ~0.1 s
TRAIN_FILL = {"model": "resnet50", "max_batch": 32, "dataset_size": 128, "slo_s": 0.05,
              "online_rate_per_s": 10.0, "margin_s": 0.001}


def _require_cuda():
    import torch

    if not torch.cuda.is_available():
        raise UserInputError("bench gpu needs a CUDA device, but torch sees none")
    return torch


def preflight() -> None:
    """Refuse (one line) before any work: no CUDA device, or inference models that do not fit the
    GPU's free memory (the bench's fillers, one per mode plus inference alone; then the train
    section's workers)."""
    _require_cuda()
    check_memory_fits(filling_bench.bench_config("cuda"), copies=len(filling_bench.MODES) + 1)
    check_memory_fits(parse_fill_config({**TRAIN_FILL, "device": "cuda"}), copies=TRAIN_WORKERS)


def served_share(mode: dict) -> float | None:
    """Requests served / (served + shed for overflow or expiry); None when none arrived."""
    total = mode["online_served"] + mode["online_shed"]
    return mode["online_served"] / total if total else None


def mode_values(mode: dict) -> dict:
    """One mode's numbers under the TARGETS' keys (the served share computed from its counts)."""
    return {**{k: mode[k] for k in TARGETS if k != "online_served_share"},
            "online_served_share": served_share(mode)}


def filling_section(*, left_s: float = math.inf) -> dict:
    return filling_summary(filling_bench.run_bench(quick=True, device="cuda", max_s=FILLING_MAX_S))


def filling_summary(result: dict) -> dict:
    """The bench's result as the check reports it: every mode's numbers with each target, its
    value and whether it was met (`checks` for the gated filler, whose targets these are; the
    naive and rate-limited modes are judged the same way so that their price is visible), and
    whether enough rounds ran for the medians."""
    st = result["settings"]
    modes = {}
    for mode, m in result["modes"].items():
        values = mode_values(m)
        modes[mode] = {**values, "offline_samples_per_s": m["offline_samples_per_s"],
                       "online_p50_s": m["online_p50_s"], "online_served": m["online_served"],
                       "online_shed": m["online_shed"], "guard_shrinks": m["guard_shrinks"],
                       "filler_error": m.get("filler_error"),
                       "checks": filling_bench.judge(values, TARGETS)}
    checks = {**modes["gated"]["checks"],
              "rounds": {"value": st["rounds_run"], "target": f">= {MIN_ROUNDS}",
                         "met": st["rounds_run"] >= MIN_ROUNDS}}
    return {"checks": checks, "modes": modes, "solo_inference": result["solo_inference"],
            "rounds": st["rounds_run"], "compute_s": st["compute_s"], "comm_s": st["comm_s"],
            "training": f"{st['training']} batch {st['training_batch']}",
            "inference": st["fill_config"]["model"], "online_rate_per_s": result["online_rate_per_s"],
            "slo_s": st["fill_config"]["slo_s"], "elapsed_s": st["elapsed_s"]}


def runtime_section(*, left_s: float = math.inf) -> dict:
    # The overhead cases at GPU sizes; not the scaling curves: they pad compute to an emulated
    # time (no GPU needed) and would take minutes of the check's budget. No case starts once the
    # profile and train sections would be left less than RUNTIME_LEAVES_S.
    result = run_runtime_bench("cuda", quick=True, scaling=False, max_s=left_s - RUNTIME_LEAVES_S)
    return {k: v for k, v in result.items() if k not in ("run_dir", "plot")}


def _timed_step_s(job, step: int) -> float:
    """One training step's time: the GPU's (CUDA events) on CUDA, the host's on the CPU."""
    t0 = time.perf_counter()
    device_s = job.compute(step)
    return time.perf_counter() - t0 if device_s is None else device_s


def profile_section(workload: str = PROFILE_WORKLOAD, batches=PROFILE_BATCHES, steps: int = 5,
                    options: dict | None = None, device: str = "cuda", *, left_s: float = math.inf) -> dict:
    """Step time (median of `steps` after one warm-up) and peak memory per batch size, the memory
    fit and the largest power-of-two batch the GPU's memory admits (`device` cpu: a dry run of
    the same code, memory as tasks.profiling.memory counts it there, 'GPU memory' = 16 GB)."""
    from tasks.profiling.fit import fit_memory, max_batch_per_gpu  # deferred: scipy (start-up cost)

    torch = _require_cuda() if device == "cuda" else None
    step_ms = {}
    for batch in batches:
        job = TrainingJob.from_workload(workload, options, batch, device)
        job.compute(0)
        step_ms[batch] = 1e3 * statistics.median(_timed_step_s(job, i) for i in range(1, steps + 1))
        del job
        if torch is not None:
            torch.cuda.empty_cache()
    if torch is not None:  # what earlier sections left (a filler's reference cycle) would shift the peaks
        gc.collect()
        torch.cuda.empty_cache()
    described, points = measure_memory(workload, options, list(batches), device=device)
    fit = fit_memory([p.batch_per_gpu for p in points], [p.peak_bytes for p in points])
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if torch is not None else 16.0
    return {"workload": workload, "device": described, "step_ms": step_ms,
            "peak_mb": {p.batch_per_gpu: p.peak_bytes / 1e6 for p in points},
            "memory_fit": fit.params, "memory_fit_r2": fit.r2, "gpu_memory_gb": total_gb,
            "max_batch_per_gpu": max_batch_per_gpu(fit.params["alpha2"], fit.params["beta2"], total_gb)}


def gpus_section(window_s: float = GPUS_WINDOW_S, workload: str = TRAIN_WORKLOAD, options: dict | None = None,
                 batch_per_gpu: int = TRAIN_BATCH, device: str = "cuda", artifacts_dir: Path | None = None,
                 *, left_s: float = math.inf) -> dict:
    """One worker through the multi-GPU path on the machine's GPUs (`device` cpu: two replicas
    on the CPU, the emulated instance a CPU test drives through the same code): samples/s, and the
    intra-instance sum's median seconds, exposed after compute and on the link (with one GPU, a sum
    over one replica: the path's own cost)."""
    if device == "cuda":
        gpus = _require_cuda().cuda.device_count()
    else:
        gpus = 2
    itype = emulated_type(gpus)
    # real compute, links not shaped, the sum not paced: what this machine's GPUs and NCCL do
    provider = LocalProvider(artifacts_dir or REPO / "artifacts", types=[itype], relative_speed={itype.name: 1.0},
                             bandwidth_scale=None)
    window_s = max(1.0, min(window_s, left_s - 90.0))
    rate, sums_s, links_s = samples_per_s_of_one_worker(
        provider, time.strftime("gpu-check-gpus-%Y%m%dT%H%M%S"), itype.name, batch_per_gpu * gpus, window_s,
        workload=workload, options=options or {}, worker_args=("--device", device, "--sum-in-instance"))
    return {"workload": f"{workload} batch {batch_per_gpu} per GPU", "gpus": gpus, "device": device,
            "window_s": window_s, "samples_per_s": rate, "sums": len(sums_s),
            "intra_sum_s": statistics.median(sums_s) if sums_s else None,
            "intra_sum_link_s": statistics.median(links_s) if links_s else None}


def train_section(window_s: float = TRAIN_WINDOW_S, workload: str = TRAIN_WORKLOAD,
                  options: dict | None = None, batch: int = TRAIN_BATCH, fill: dict = TRAIN_FILL,
                  device: str = "cuda", artifacts_dir: Path | None = None, *, left_s: float = math.inf) -> dict:
    """The runtime with filling on: a PS and TRAIN_WORKERS workers (--fill, --device; the
    inference model and sizes through $SPOTFILL_FILL_CONFIG), then the workers' own reports
    (`device` cpu with small sizes: a dry run of the same code). Within `left_s`: the first
    update and the window end TRAIN_STOP_S before it (a shorter window says so in `window_s`)."""
    if device == "cuda":
        _require_cuda()

    end_s = time.monotonic() + left_s - TRAIN_STOP_S
    provider = LocalProvider(artifacts_dir or REPO / "artifacts", bandwidth_scale=TRAIN_BANDWIDTH_SCALE)
    run_id = time.strftime("gpu-check-%Y%m%dT%H%M%S")
    run = driver.start_run(provider, run_id, workload, workload_options=options)
    metrics_dir = run.run_dir / "filling"
    fill_args = ("--device", device, "--fill", "--fill-online-rate", repr(fill["online_rate_per_s"]),
                 "--fill-online-slo-s", repr(fill["slo_s"]), "--fill-metrics-dir", str(metrics_dir))
    startup = replace(driver.worker_startup(run, batch, fill_args), env={CONFIG_ENV: json.dumps(fill)})
    try:
        workers = provider.launch(run_id, "p0", TRAIN_TYPE, TRAIN_WORKERS, role="worker", market="spot",
                                  startup=startup).instances
        first = _wait_while_workers_live(run, provider, workers, lambda p: p.updates_total > 0,
                                         min(TRAIN_FIRST_UPDATE_S, end_s - time.monotonic()))
        started_s, updates_0 = time.monotonic(), first.updates_total
        window_s = min(window_s, end_s - started_s)
        window = _wait_while_workers_live(run, provider, workers, lambda p: time.monotonic() - started_s >= window_s,
                                          window_s + 30)
        elapsed_s = time.monotonic() - started_s  # the window, not the shutdown after it
        final = driver.stop_run(run)
    finally:
        provider.cleanup(run_id)
    workers = read_worker_metrics(metrics_dir)
    total = lambda key: sum(m.get(key) or 0 for m in workers)  # noqa: E731
    slowdowns = [m["compute_slowdown"] for m in workers if m.get("compute_slowdown") is not None]
    return {
        "workload": f"{workload} batch {batch}", "workers": TRAIN_WORKERS, "window_s": elapsed_s, "inference": fill["model"], "updates": final.updates_total,
        "updates_per_s": (window.updates_total - updates_0) / elapsed_s,
        "smoothed_loss": final.smoothed_loss, "workers_reporting": len(workers),
        "inference_samples": total("inference_samples"),
        "inference_samples_per_s": sum(m["inference_samples"] / m["elapsed_s"] for m in workers
                                       if m.get("elapsed_s")),
        "online_served": total("online_served"), "online_offered": total("online_offered"),
        "fill_efficiency": total("busy_in_bubble_s") / total("bubble_s") if total("bubble_s") else None,
        "compute_slowdown_max": max(slowdowns) if slowdowns else None,
        "errors": [m["error"] for m in workers if m.get("error")],
        "run_dir": str(run.run_dir),
    }


def _wait_while_workers_live(run, provider, workers, condition, timeout_s: float):
    """driver.wait_for, but give up at once, with the last line of a dead worker's log, when none
    of `workers` is alive any more (a worker that failed to start would otherwise cost the whole
    timeout of a check that has minutes)."""
    ids = {w.instance_id for w in workers}

    def done_or_dead(progress) -> bool:
        if condition(progress):
            return True
        if ids & {i.instance_id for i in provider.describe(run.run_id)}:
            return False
        raise RuntimeError(f"every worker exited; {driver.last_log_line(run.run_dir, sorted(ids)[0])}")

    return driver.wait_for(run, done_or_dead, timeout_s=timeout_s, poll_s=0.5)


SECTIONS = {"filling": filling_section, "runtime": runtime_section, "profile": profile_section,
            "gpus": gpus_section, "train": train_section}


def run_bench(quick: bool = True) -> dict:
    """Every section, in order (`quick` is accepted for the bench CLI; the check is always this
    short). A section that fails records {"error": "..."}; the others still run. Each is told
    the seconds left of CHECK_BUDGET_S (the train section shortens its window to fit); one that
    would start with none left is skipped, with that as its error."""
    torch = _require_cuda()
    preflight()
    started_s = time.perf_counter()
    result = {"device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda}
    for name, section in SECTIONS.items():
        t0 = time.perf_counter()
        left_s = CHECK_BUDGET_S - (t0 - started_s)
        try:
            if left_s <= 0:
                raise TimeoutError(f"skipped: the check's {CHECK_BUDGET_S:g} s were spent")
            result[name] = section(left_s=left_s)
        except (Exception, SystemExit) as err:  # keep the other sections' numbers; say what broke, in one line
            result[name] = {"error": error_line(err)}
        result[name]["section_s"] = time.perf_counter() - t0
        # each section's numbers as soon as it ends, so a check killed at its limit keeps them
        print(f"bench gpu: {name}: {json.dumps(json_safe(result[name]))}", file=sys.stderr, flush=True)
    result["elapsed_s"] = time.perf_counter() - started_s
    checks = result["filling"].get("checks", {})
    result["targets_met"] = bool(checks) and all(c["met"] for c in checks.values())
    return json_safe(result)


def json_safe(value):
    """`value` with numpy scalars made Python numbers and NaN or infinite floats made None, so the
    one JSON object (strict: no NaN) always prints at the end of a run that took minutes."""
    if hasattr(value, "tolist"):  # a numpy (or torch) scalar or array
        value = value.tolist()
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict) -> str:
    lines = [f"bench gpu on {result['device_name']} (torch {result['torch']}, CUDA {result['cuda']}), "
             f"{result['elapsed_s']:.0f} s"]
    f = result["filling"]
    if "error" in f:
        lines.append(f"filling: error: {f['error']}")
    else:
        lines.append(f"filling: {f['training']} (compute {f['compute_s'] * 1e3:.1f} ms + bubble "
                     f"{f['comm_s'] * 1e3:.1f} ms), inference {f['inference']}, "
                     f"{f['online_rate_per_s']:g} requests/s (SLO {f['slo_s'] * 1e3:g} ms), {f['rounds']} rounds")
        lines.append(f"  {'mode':<13}{'retained':>9}{'fill eff':>9}{'offl/solo':>10}{'spill/T':>8}"
                     f"{'p95 ms':>8}{'served':>8}{'targets met':>13}")
        for mode, m in f["modes"].items():
            p95 = None if m["online_p95_s"] is None else m["online_p95_s"] * 1e3
            lines.append(f"  {mode:<13}{m['training_retained']:>9.3f}{m['fill_efficiency']:>9.2f}"
                         f"{m['offline_share_of_solo']:>10.2f}{m['spill_share_of_training_time']:>8.3f}"
                         f"{_fmt(p95, '.1f'):>8}{_fmt(m['online_served_share'], '.3f'):>8}"
                         f"{sum(c['met'] for c in m['checks'].values()):>9}/{len(m['checks'])}")
        for key, c in f["checks"].items():
            lines.append(f"  target {key} {c['target']}: {_fmt(c['value'], '.4g')} "
                         f"{'met' if c['met'] else 'NOT met'}")
    for name in [n for n in SECTIONS if n != "filling"]:
        section = result[name]
        shown = {k: v for k, v in section.items() if k not in ("section_s",)}
        lines.append(f"{name} ({section['section_s']:.0f} s): " + json.dumps(shown, default=str))
    lines.append(f"all filling targets met: {result['targets_met']}")
    return "\n".join(lines)
