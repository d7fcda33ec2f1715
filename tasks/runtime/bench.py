"""`spotfill bench runtime`: what the runtime costs and how it scales, measured on this machine.

1. Overhead: one runtime worker (the real worker loop against a PS process over gloo; no
   shaping, no padding) against a plain single-process training loop (forward, backward,
   optimizer step), same model (ResNet-20, width 16), same batch, one thread each, alternating in
   short rounds in the same run (the machine is shared, its load changes by the second):
   samples/s = batch / median step time, overhead_ratio = runtime samples/s / plain samples/s
   (medians resist other processes' load spikes; the ratios of total times and of the fastest
   steps, timeit's rule for noisy machines, are reported too).
2. Throughput against the number of workers, 1..8 (--quick: 1, 2, 4, 8), in one elastic run on
   the local provider: workers are added (none restarted); once all have joined and warmed up,
   the cluster's accepted samples are counted over a window (10 s; --quick 3 s). Workers emulate an instance whose compute takes
   `reference_compute_s` (the measured compute is padded to it, so this 2-core machine is not the
   bottleneck) and the PS's bandwidth is capped at `ps_bandwidth_mbps` by the shared token bucket,
   so throughput grows, then bends where the PS link saturates. Plot: artifacts/bench-runtime/
   throughput_vs_workers.png (measured; linear scaling of the 1-worker rate; the PS cap,
   ps_bandwidth / (2 x parameter bytes) x batch).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from tasks.providers.local import REPO, LocalProvider
from tasks.runtime import driver
from tasks.runtime.telemetry import read_records

OVERHEAD_WORKLOAD, OVERHEAD_OPTIONS, OVERHEAD_BATCH = "resnet20", {"width": 16}, 32
SCALING_WORKLOAD, SCALING_OPTIONS, SCALING_BATCH = "resnet20", {"width": 8}, 8
REFERENCE_COMPUTE_S = 0.6
PS_BANDWIDTH_MBPS = 30.0
WORKER_TYPE = "p3.2xlarge"  # relative speed 1.0 in the default catalog
MAX_WORKERS = 8


class _StepClock:
    """A PhaseListener that notes when each step's compute starts and its communication ends."""

    def __init__(self):
        self.compute_start_s: dict[int, float] = {}
        self.comm_end_s: dict[int, float] = {}

    def compute_start(self, step: int) -> None:
        self.compute_start_s[step] = time.monotonic()

    def compute_end(self, step: int) -> None:
        pass

    def comm_start(self, step: int) -> None:
        pass

    def comm_end(self, step: int) -> None:
        self.comm_end_s[step] = time.monotonic()


def overhead(artifacts: Path, rounds: int, steps: int) -> tuple[list[float], list[float]]:
    """Per-step seconds of the plain loop and of the runtime worker. The machine is shared and its
    load changes by the second, so the two alternate: each round runs `steps` plain steps, then
    the real worker loop (in this process, against a PS process over gloo) for `steps` steps; the
    first step of each is warm-up and not counted. A runtime step is compute + push + pull, from
    one step's end of communication to the next."""
    import torch

    from tasks.runtime.worker import WorkerConfig, run_worker
    from tasks.runtime.workloads import build_workload

    torch.set_num_threads(1)
    plain = build_workload(OVERHEAD_WORKLOAD, OVERHEAD_OPTIONS).plain_steps(OVERHEAD_BATCH)
    provider = LocalProvider(artifacts, bandwidth_scale=None)
    run = driver.start_run(provider, "overhead", OVERHEAD_WORKLOAD, workload_options=OVERHEAD_OPTIONS,
                           ps_type=WORKER_TYPE, checkpoint_every_s=3600.0)
    host, port = run.ps_address.rsplit(":", 1)
    plain_step_s: list[float] = []
    runtime_step_s: list[float] = []
    try:
        for _ in range(rounds):
            ends = []
            for _ in range(steps + 1):
                next(plain)
                ends.append(time.monotonic())
            plain_step_s += [b - a for a, b in zip(ends, ends[1:])]
            clock = _StepClock()
            run_worker(WorkerConfig(host, int(port), OVERHEAD_WORKLOAD, OVERHEAD_BATCH, OVERHEAD_OPTIONS,
                                    instance_type=WORKER_TYPE, max_steps=steps + 1), listener=clock)
            runtime_step_s += [clock.comm_end_s[k] - clock.comm_end_s[k - 1] for k in range(1, steps + 1)]
        driver.stop_run(run)
    finally:
        provider.cleanup(run.run_id)
    return plain_step_s, runtime_step_s


def throughput_by_workers(artifacts: Path, counts: list[int], window_s: float) -> tuple[dict[str, float], float]:
    """Samples/s of the cluster at each worker count (ascending; workers are added to reach the
    next count, launched together), and the parameter megabytes moved per push (and per pull)."""
    from tasks.runtime import wire
    from tasks.runtime.workloads import build_workload

    param_mb = wire.flat_size(build_workload(SCALING_WORKLOAD, SCALING_OPTIONS).model) * 4 / 1e6
    provider = LocalProvider(artifacts, reference_compute_s=REFERENCE_COMPUTE_S, bandwidth_scale=None)
    run = driver.start_run(provider, "scaling", SCALING_WORKLOAD, workload_options=SCALING_OPTIONS,
                           ps_type=WORKER_TYPE, ps_mbps=PS_BANDWIDTH_MBPS, checkpoint_every_s=3600.0)
    result: dict[str, float] = {}
    try:
        for n in counts:
            driver.add_workers(run, WORKER_TYPE, n - len(run.progress().workers), SCALING_BATCH, plan_id=f"w{n}")
            driver.wait_for(run, lambda p: len(p.workers) == n and min(w.updates for w in p.workers.values()) >= 2,
                            timeout_s=120)
            start_t = time.time()
            time.sleep(window_s)
            end_t = time.time()
            driver.wait_for(run, lambda p: (p.last_update_t or 0) >= end_t, timeout_s=60)
            samples = sum(r["samples"] for r in read_records(run.run_dir)
                          if r["kind"] == "update" and start_t <= r["t"] < end_t)
            result[str(n)] = samples / (end_t - start_t)
        driver.stop_run(run)
    finally:
        provider.cleanup(run.run_id)
    return result, param_mb


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = [int(n) for n in result["throughput_by_workers"]]
    measured = list(result["throughput_by_workers"].values())
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(workers, measured, "o-", label="measured (local provider)")
    ax.plot(workers, [measured[0] * n for n in workers], ":", color="grey", label="linear in the 1-worker rate")
    ax.axhline(result["ps_cap_samples_per_s"], color="red", linestyle="--",
               label=f"PS cap: {result['ps_bandwidth_mbps']:g} Mbps / (2 x {result['param_mb']:.2f} MB)")
    ax.set_xlabel("workers")
    ax.set_ylabel("samples / s")
    ax.set_ylim(0, max(max(measured), result["ps_cap_samples_per_s"]) * 1.3)
    ax.set_title(f"{SCALING_WORKLOAD} (width {SCALING_OPTIONS['width']}), batch {SCALING_BATCH}, "
                 f"compute {REFERENCE_COMPUTE_S:g} s")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench(quick: bool) -> dict:
    artifacts = REPO / "artifacts" / "bench-runtime"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    runs = artifacts / stamp
    plain_step_s, runtime_step_s = overhead(runs, rounds=8 if quick else 20, steps=3)
    plain, runtime = OVERHEAD_BATCH / statistics.median(plain_step_s), OVERHEAD_BATCH / statistics.median(runtime_step_s)
    updates = [r for r in read_records(runs / "overhead") if r["kind"] == "update" and r["comm_s"] is not None]
    counts = [1, 2, 4, 8] if quick else list(range(1, MAX_WORKERS + 1))
    by_workers, param_mb = throughput_by_workers(runs, counts, window_s=3.0 if quick else 10.0)
    result = {
        "overhead_ratio": runtime / plain,
        "overhead_ratio_of_totals": sum(plain_step_s) / sum(runtime_step_s),
        "overhead_ratio_of_fastest": min(plain_step_s) / min(runtime_step_s),  # timeit's rule
        "overhead_steps_each": len(plain_step_s),
        # where a runtime step goes (worker telemetry) against a plain step, medians in seconds
        "plain_step_s_median": statistics.median(plain_step_s),
        "runtime_compute_s_median": statistics.median(r["compute_s"] for r in updates),
        "runtime_comm_s_median": statistics.median(r["comm_s"] for r in updates),
        "plain_samples_per_s": plain,
        "runtime_one_worker_samples_per_s": runtime,
        "overhead_workload": f"{OVERHEAD_WORKLOAD} width {OVERHEAD_OPTIONS['width']}, batch {OVERHEAD_BATCH}",
        "throughput_by_workers": by_workers,
        "ps_bandwidth_mbps": PS_BANDWIDTH_MBPS,
        "param_mb": param_mb,
        "ps_cap_samples_per_s": PS_BANDWIDTH_MBPS / 8 / (2 * param_mb) * SCALING_BATCH,
        "scaling_workload": f"{SCALING_WORKLOAD} width {SCALING_OPTIONS['width']}, batch {SCALING_BATCH}",
        "reference_compute_s": REFERENCE_COMPUTE_S,
        "quick": quick,
        "run_dir": str(runs),
    }
    result["plot"] = str(artifacts / "throughput_vs_workers.png")
    plot(result, Path(result["plot"]))
    return result


def format_table(result: dict) -> str:
    lines = [
        f"overhead ({result['overhead_workload']}): runtime 1 worker {result['runtime_one_worker_samples_per_s']:.1f} "
        f"samples/s / plain loop {result['plain_samples_per_s']:.1f} = {result['overhead_ratio']:.3f} "
        f"(median step times, {result['overhead_steps_each']} steps each; of total times "
        f"{result['overhead_ratio_of_totals']:.3f}; of the fastest steps {result['overhead_ratio_of_fastest']:.3f})",
        f"  median seconds: plain step {result['plain_step_s_median']:.4f}; runtime compute "
        f"{result['runtime_compute_s_median']:.4f} + push/pull {result['runtime_comm_s_median']:.4f}",
        f"throughput vs workers ({result['scaling_workload']}, compute {result['reference_compute_s']:g} s, "
        f"PS cap {result['ps_bandwidth_mbps']:g} Mbps = {result['ps_cap_samples_per_s']:.1f} samples/s):",
        "  workers  samples/s",
    ]
    lines += [f"  {n:>7}  {v:9.1f}" for n, v in result["throughput_by_workers"].items()]
    lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)
