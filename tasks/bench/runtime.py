"""`spotfill bench runtime`: what the runtime costs and how it scales, measured on this machine.

1. Overhead, case by case: one runtime worker (the real worker loop, in this process, against PS
   processes over gloo; no shaping, no padding) against a plain single-process training loop
   (forward, backward, optimizer step) of the same workload, batch, optimizer and device,
   alternating in short rounds in the same run (a shared machine's load changes by the second).
   Cases: the tiny one (ResNet-20 width 16), ResNet-110 and a 25M-parameter transformer LM, at
   sizes that fit 2 CPU cores, or on CUDA at the sizes of a real GPU (GPU_CASES); the transformer
   also with its push sent after backward and its pull landed before forward, to show what
   overlapping them with compute buys. Per case: plain and
   runtime samples/s (median step times) and their ratio; the worker's compute phase against the
   plain step; push + pull, its effective GB/s (2 x the vector's bytes / push+pull time) against a
   raw gloo round trip of the same bytes between two processes on this machine (the loopback's
   rate); the PS's apply time per MB (telemetry).
2. Throughput against the number of workers, 1..8 (--quick: 1, 4, 8), with k = 1 and k = 2 PS
   shards, each an elastic run on the local provider: workers are added (none restarted); once all
   have joined and warmed up, the cluster's accepted samples are counted over a window (10 s;
   --quick 3 s). Workers emulate an instance whose compute takes `reference_compute_s` (the
   measured compute is padded to it, so this 2-core machine is not the bottleneck) and each PS
   shard's bandwidth is capped at `ps_bandwidth_mbps` by its token bucket, so throughput grows,
   then bends where the PS links saturate: at k x the one-PS cap with k shards (the planner's
   k x Bps). Plot: artifacts/bench-runtime/throughput_vs_workers.png.
3. Scaling inside an instance: samples/s of one worker of a g-GPU type over one of a 1-GPU type of
   the same per-GPU speed, at the same batch per GPU, g = 1, 2, 4 (replicas on the CPU, the local
   provider's emulation of a multi-GPU instance), with each replica's compute padded to
   `reference_compute_s` (compute dominates, as on GPUs) and unpadded (the host's own compute: on a
   machine with fewer cores than replicas it cannot scale); and the gradient sum's time against the
   PCIe bound 2 g S / Bpcie it is paced to: the link's busy time, and the part the iteration waits
   for after compute (exposed). Then the overlap: padded, on a link slowed until the 2-GPU bound is
   a third of the step, the sum started bucket by bucket during backward (the runtime's way) and
   after backward (`--sum-after-backward`: before the overlap).

4. Evaluation during training: one runtime worker (the tiny case) alternating, in rounds, between
   two parameter servers, one running the workload's evaluate every EVAL_EVERY_UPDATES updates on
   its snapshot (tasks/runtime/periodic_eval.py) and one never; updates/s (whole rounds: the
   evaluations' cost falls on a few steps, which a median would not see) with evaluation over
   without: the training it retains (`evaluation_cost`).

`--part overhead|workers|gpus|evaluation` runs one of the four.

`run_runtime_bench(device, quick)` returns the whole result as a dict (for `spotfill bench gpu`);
nothing here imports prefect or boto3.
"""
from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.providers.base import InstanceType
from tasks.providers.local import REPO, LocalProvider, default_pcie_mbytes_per_s
from tasks.runtime import driver, wire
from tasks.runtime.pieces import PIECE_MB
from tasks.runtime.replicas import pcie_floor_s
from tasks.runtime.telemetry import read_records
from tasks.runtime.worker import WorkerConfig, device_batches, run_worker
from tasks.runtime.workloads import build_workload


@dataclass(frozen=True)
class Case:
    label: str
    workload: str
    options: dict
    batch: int
    # also run, in the same rounds, a worker that moves everything in one piece: the push after
    # backward, the pull before forward; what overlapping them with compute buys
    with_whole: bool = False

    @property
    def slug(self) -> str:
        return f"{self.workload}-b{self.batch}"


WHOLE_MB = 1e9  # a piece larger than any model: nothing overlaps compute
WHOLE_LABEL = ", push and pull whole"
TINY = Case("tiny: resnet20 width 16", "resnet20", {"width": 16}, 32)
TRANSFORMER_CPU = Case("transformer-lm 25M (d_model 512, 8 layers, seq 32), batch 2", "transformer-lm",
                       {"d_model": 512, "layers": 8, "heads": 8, "seq_len": 32}, 2, with_whole=True)
TRANSFORMER_GPU = Case("transformer-lm 25M (d_model 512, 8 layers, seq 128), batch 32", "transformer-lm",
                       {"d_model": 512, "layers": 8, "heads": 8, "seq_len": 128}, 32, with_whole=True)
CPU_CASES = (TINY, Case("resnet110, batch 16", "resnet110", {"width": 16}, 16), TRANSFORMER_CPU)
GPU_CASES = (TINY, Case("resnet110, batch 128", "resnet110", {"width": 16}, 128), TRANSFORMER_GPU)
SCALING_WORKLOAD, SCALING_OPTIONS, SCALING_BATCH = "resnet20", {"width": 8}, 8
REFERENCE_COMPUTE_S = 0.6
SLOW_PCIE_BOUND_S = 0.2  # the overlap's case: a 2-GPU sum that needs a third of the padded step on the link
PS_BANDWIDTH_MBPS = 30.0
WORKER_TYPE = "p3.2xlarge"  # relative speed 1.0 in the default catalog
MAX_WORKERS = 8
EVAL_EVERY_UPDATES = 50
EVAL_WAIT_S = 120.0  # an evaluation of the tiny case takes about a second


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


def plain_loop(case: Case, device: str):
    """Plain single-process training on `device`, one step per `next()`: the baseline. Batches
    come the way the worker gets them (worker.device_batches)."""
    import torch

    workload = build_workload(case.workload, case.options)
    model = workload.model.to(device)
    optimizer = workload.make_optimizer(model.parameters())
    for group in optimizer.param_groups:
        group["lr"] = workload.lr_for_batch(case.batch)
    batches = device_batches(workload.batches(case.batch, 1), torch.device(device))
    while True:
        inputs, targets = next(batches)
        loss = workload.loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        yield loss.item()


def overhead(artifacts: Path, case: Case, rounds: int, steps: int, device: str = "cpu") -> dict:
    """Per-step seconds of the plain loop and of the runtime worker, and the PS's telemetry. They
    alternate: each round runs `steps` plain steps, then the real worker loop for `steps` steps
    (and, for a case `with_whole`, then a worker moving everything in one piece, under "whole");
    the first step of each is warm-up and not counted. A runtime step is compute + push + pull,
    from one step's end of communication to the next."""
    import torch

    torch.set_num_threads(1)
    plain = plain_loop(case, device)
    provider = LocalProvider(artifacts, bandwidth_scale=None)
    run = driver.start_run(provider, f"overhead-{case.slug}", case.workload, workload_options=case.options,
                           ps_type=WORKER_TYPE, checkpoint_every_s=3600.0)
    host, port = run.ps_address.rsplit(":", 1)
    piece_mb = {"pieces": PIECE_MB, **({"whole": WHOLE_MB} if case.with_whole else {})}
    plain_step_s: list[float] = []
    step_s: dict[str, list[float]] = {variant: [] for variant in piece_mb}
    try:
        for round_ in range(rounds):
            ends = []
            for _ in range(steps + 1):
                next(plain)
                ends.append(time.monotonic())
            plain_step_s += [b - a for a, b in zip(ends, ends[1:])]
            for variant, mb in piece_mb.items():
                clock = _StepClock()
                run_worker(WorkerConfig(host, int(port), case.workload, case.batch, case.options, device=device,
                                        instance_id=f"{variant}-{round_}", instance_type=WORKER_TYPE,
                                        max_steps=steps + 1, piece_mb=mb),
                           listener=clock)
                step_s[variant] += [clock.comm_end_s[k] - clock.comm_end_s[k - 1] for k in range(1, steps + 1)]
        driver.stop_run(run)
    finally:
        provider.cleanup(run.run_id)
    records = read_records(run.run_dir)
    variant_of = {r["worker"]: r["instance_id"].split("-")[0] for r in records if r["kind"] == "join"}
    measured = {variant: {"plain_step_s": plain_step_s, "runtime_step_s": step_s[variant],
                          "updates": [r for r in records if r["kind"] == "update" and r["comm_s"] is not None
                                      and variant_of[r["worker"]] == variant]}
                for variant in piece_mb}
    return {**measured["pieces"], **({"whole": measured["whole"]} if case.with_whole else {})}


def evaluation_cost(artifacts: Path, case: Case, rounds: int, every_updates: int = EVAL_EVERY_UPDATES,
                    device: str = "cpu") -> dict:
    """Updates/s of one worker against a PS that evaluates every `every_updates` updates and
    against one that never does, alternating rounds of 2 x `every_updates` updates (the first
    step of each not counted); each rate is whole rounds' steps over their seconds. A warm-up of
    half that puts the evaluations at a quarter and three quarters of each round, and an
    evaluated round ends only once its evaluations have been written (that wait, if any, counts
    as its time), so no evaluation runs during the other PS's round."""
    import torch

    torch.set_num_threads(1)
    provider = LocalProvider(artifacts, bandwidth_scale=None)
    steps, warm = 2 * every_updates - 1, every_updates // 2
    runs = {}
    try:
        for label, every in (("evaluated", every_updates), ("not evaluated", None)):
            runs[label] = driver.start_run(provider, f"evaluation-{label.replace(' ', '-')}", case.workload,
                                           workload_options=case.options, ps_type=WORKER_TYPE,
                                           checkpoint_every_s=3600.0, eval_every_updates=every)

        def train(label: str, instance_id: str, max_steps: int) -> _StepClock:
            host, port = runs[label].ps_address.rsplit(":", 1)
            clock = _StepClock()
            run_worker(WorkerConfig(host, int(port), case.workload, case.batch, case.options, device=device,
                                    instance_id=instance_id, instance_type=WORKER_TYPE, max_steps=max_steps),
                       listener=clock)
            return clock

        train("evaluated", "warm-up", warm)
        seconds = {label: 0.0 for label in runs}
        for round_ in range(rounds):
            for label in runs:
                clock = train(label, f"{label.replace(' ', '-')}-{round_}", steps + 1)
                seconds[label] += clock.comm_end_s[steps] - clock.comm_end_s[0]
            due = (warm + (round_ + 1) * (steps + 1)) // every_updates
            waited_s = time.monotonic()
            while sum(1 + r["skipped"] for r in read_records(runs["evaluated"].run_dir) if r["kind"] == "evaluation") < due:
                if time.monotonic() - waited_s > EVAL_WAIT_S:
                    raise TimeoutError(f"the PS wrote no evaluation of update {due * every_updates} within {EVAL_WAIT_S:g} s")
                time.sleep(0.05)
            seconds["evaluated"] += time.monotonic() - waited_s
        for run in runs.values():
            driver.stop_run(run)
    finally:
        for run in runs.values():
            provider.cleanup(run.run_id)
    evaluations = [r for r in read_records(runs["evaluated"].run_dir) if r["kind"] == "evaluation"]
    rates = {label: rounds * steps / s for label, s in seconds.items()}
    return {
        "case": case.label, "every_updates": every_updates, "rounds": rounds, "steps_each": steps,
        "updates_per_s_evaluated": rates["evaluated"], "updates_per_s_not_evaluated": rates["not evaluated"],
        "retained": rates["evaluated"] / rates["not evaluated"],
        "evaluations": len(evaluations), "skipped": sum(r["skipped"] for r in evaluations),
        "eval_s_median": statistics.median(r["eval_s"] for r in evaluations) if evaluations else None,
        "last_metrics": evaluations[-1]["metrics"] if evaluations else None,
    }


def loopback_gbps(nbytes: int, repeats: int = 5) -> float:
    """The machine's own rate for a transfer of `nbytes`: raw gloo round trips of one tensor between
    this process and a child echoing it back, 2 x nbytes / median round trip, in GB/s."""
    import datetime

    import torch
    from torch.distributed import PrefixStore, ProcessGroupGloo

    port = driver.free_port()
    store = wire.host_store(port, 60)
    numel = max(1, nbytes // 4)
    child = subprocess.Popen([sys.executable, "-c", f"from tasks.bench.runtime import echo; echo({port}, {numel}, {repeats + 1})"],
                             cwd=REPO)
    try:
        group = ProcessGroupGloo(PrefixStore("loopback/", store), 0, 2, datetime.timedelta(seconds=60))
        x = torch.ones(numel)
        round_trips = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            group.send([x], 1, 0).wait()
            group.recv([x], 1, 0).wait()
            round_trips.append(time.perf_counter() - start)
        child.wait(timeout=60)
    finally:
        child.kill()
    return 2 * numel * 4 / statistics.median(round_trips[1:]) / 1e9


def echo(port: int, numel: int, repeats: int) -> None:
    """The child of loopback_gbps: receive the tensor and send it back, `repeats` times."""
    import datetime

    import torch
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = ProcessGroupGloo(PrefixStore("loopback/", store), 1, 2, datetime.timedelta(seconds=60))
    x = torch.empty(numel)
    for _ in range(repeats):
        group.recv([x], 0, 0).wait()
        group.send([x], 0, 0).wait()


def bus_copy_s(numel: int, device: str, repeats: int = 5) -> tuple[float, float]:
    """One crossing of the bus for a vector of `numel` floats through pinned host memory, each way
    alone: (to the device: the pull's copy, to the host: the push's), median seconds; zeros off
    CUDA, where there is no bus."""
    if device != "cuda":
        return 0.0, 0.0
    import torch

    host = torch.empty(numel, pin_memory=True)
    on_device = torch.empty(numel, device="cuda")

    def median_s(copy) -> float:
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    return (median_s(lambda: on_device.copy_(host, non_blocking=True)),
            median_s(lambda: host.copy_(on_device, non_blocking=True)))


def case_result(label: str, batch: int, measured: dict, vector_mb: float, loopback: float,
                bus_s: tuple[float, float] = (0.0, 0.0)) -> dict:
    """One case's row: rates, their ratio, where a runtime step goes, the link against loopback,
    and the link bound: the step this machine's links would allow if nothing overlapped (the
    plain step, both bus copies, push + pull at the loopback's rate). The worker overlaps its push
    with backward (push.py) and its pull with forward (pull.py), so it can beat the bound."""
    plain_s, runtime_s, updates = measured["plain_step_s"], measured["runtime_step_s"], measured["updates"]
    comm_s = statistics.median(r["comm_s"] for r in updates)
    compute_s = statistics.median(r["compute_s"] for r in updates)
    plain_step_s, runtime_step_s = statistics.median(plain_s), statistics.median(runtime_s)
    to_device_s, to_host_s = bus_s
    bound_s = plain_step_s + to_device_s + to_host_s + 2 * vector_mb / 1e3 / loopback
    return {
        "case": label,
        "vector_mb": vector_mb,
        "plain_samples_per_s": batch / plain_step_s,
        "runtime_samples_per_s": batch / runtime_step_s,
        "ratio": plain_step_s / runtime_step_s,
        "ratio_of_totals": sum(plain_s) / sum(runtime_s),
        "steps_each": len(plain_s),
        "plain_step_s": plain_step_s,
        "worker_compute_s": compute_s,
        "compute_over_plain_step": compute_s / plain_step_s,
        # the worker's compute phase holds what of the pull forward waited for and, on CUDA, the
        # pull's bus copies (on a copy stream, each ahead of its piece's first reader; the push's
        # run on a copy stream during backward and after it): without the bus copy, it is the
        # same kernels as the plain step plus the pull's wait
        "bus_copy_s": to_device_s + to_host_s,
        "bus_to_device_s": to_device_s,
        "compute_less_bus_over_plain_step": (compute_s - to_device_s) / plain_step_s,
        "link_bound_step_s": bound_s,
        "ratio_to_link_bound": bound_s / runtime_step_s,
        "push_pull_s": comm_s,
        "push_pull_gbps": 2 * vector_mb / 1e3 / comm_s,
        "loopback_gbps": loopback,
        "push_pull_over_loopback": 2 * vector_mb / 1e3 / comm_s / loopback,
        "ps_apply_ms_per_mb": statistics.median(r["apply_ms_per_mb"] for r in updates),
    }


def throughput_by_workers(artifacts: Path, counts: list[int], window_s: float, num_ps: int = 1) -> tuple[dict[str, float], float]:
    """Samples/s of the cluster at each worker count (ascending; workers are added to reach the
    next count, launched together) with `num_ps` PS shards, and the parameter megabytes moved per
    push (and per pull)."""
    param_mb = wire.flat_size(build_workload(SCALING_WORKLOAD, SCALING_OPTIONS).model) * 4 / 1e6
    provider = LocalProvider(artifacts, reference_compute_s=REFERENCE_COMPUTE_S, bandwidth_scale=None)
    run = driver.start_run(provider, f"scaling-k{num_ps}", SCALING_WORKLOAD, workload_options=SCALING_OPTIONS,
                           ps_type=WORKER_TYPE, ps_mbps=PS_BANDWIDTH_MBPS, checkpoint_every_s=3600.0, num_ps=num_ps)
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


INSTANCE_GPUS = (1, 2, 4)
PARTS = ("overhead", "workers", "gpus", "evaluation")


def emulated_type(gpus: int) -> InstanceType:
    """A g-GPU type of one per-GPU speed: its replicas all pad to the same step."""
    return InstanceType(f"emulated-{gpus}gpu", gpus, "emulated", 16.0 * gpus, 1250.0, 1.0 * gpus, 0.3 * gpus)


def samples_per_s_of_one_worker(provider: LocalProvider, run_id: str, instance_type: str, batch: int,
                                window_s: float, workload: str = SCALING_WORKLOAD, options: dict = SCALING_OPTIONS,
                                worker_args: tuple[str, ...] = ()) -> tuple[float, list[float], list[float]]:
    """One worker of the type (given `worker_args`) trains alone; its accepted samples/s over a
    window once warm, and the intra-instance sums' exposed seconds and link seconds in that window."""
    run = driver.start_run(provider, run_id, workload, workload_options=options,
                           ps_type=instance_type, checkpoint_every_s=3600.0)
    try:
        driver.add_workers(run, instance_type, 1, batch, extra_args=worker_args)
        driver.wait_for(run, lambda p: sum(w.updates for w in p.workers.values()) >= 3, timeout_s=120)
        start_t = time.time()
        time.sleep(window_s)
        end_t = time.time()
        driver.wait_for(run, lambda p: (p.last_update_t or 0) >= end_t, timeout_s=60)
        window = [r for r in read_records(run.run_dir) if r["kind"] == "update" and start_t <= r["t"] < end_t]
        driver.stop_run(run)
    finally:
        provider.cleanup(run_id)
    sums = [r for r in window if r["intra_sum_s"] is not None]
    return (sum(r["samples"] for r in window) / (end_t - start_t), [r["intra_sum_s"] for r in sums],
            [r["intra_sum_link_s"] for r in sums])


def scaling_inside_an_instance(artifacts: Path, window_s: float) -> dict:
    """Samples/s of a g-GPU worker over a 1-GPU worker at batch SCALING_BATCH per GPU, padded and
    unpadded, on the shipped profile's PCIe; the sums' median seconds (exposed after compute, and
    on the link) against the PCIe bound. Then the overlap, padded: on a link slowed until the
    2-GPU bound is SLOW_PCIE_BOUND_S, the sum started during backward (the runtime's way) and after
    it (`--sum-after-backward`: before the overlap)."""
    types = [emulated_type(g) for g in INSTANCE_GPUS]
    pcie_mbytes_per_s = default_pcie_mbytes_per_s()
    numel = wire.flat_size(build_workload(SCALING_WORKLOAD, SCALING_OPTIONS).model)
    slow_mbytes_per_s = 2 * 2 * numel * 4 / SLOW_PCIE_BOUND_S / 1e6
    multi = [t for t in types if t.gpus > 1]
    # (padded, PCIe MB/s, [(type, sum after backward)])
    variants = [(True, pcie_mbytes_per_s, [(t, False) for t in types]),
                (False, pcie_mbytes_per_s, [(t, False) for t in types]),
                (True, slow_mbytes_per_s, [(t, after) for t in multi for after in (False, True)])]
    rows = []
    for padded, pcie, cases in variants:
        provider = LocalProvider(artifacts, types=types, relative_speed={t.name: 1.0 for t in types},
                                 reference_compute_s=REFERENCE_COMPUTE_S if padded else None, bandwidth_scale=1.0,
                                 pcie_mbytes_per_s=pcie)
        one = None
        for itype, after_backward in cases:
            rate, sums_s, links_s = samples_per_s_of_one_worker(
                provider, f"gpus-{itype.gpus}-{'padded' if padded else 'host'}-{pcie:.0f}{'-after' if after_backward else ''}",
                itype.name, SCALING_BATCH * itype.gpus, window_s,
                worker_args=("--sum-after-backward",) if after_backward else ())
            one = one or rate
            rows.append({"gpus": itype.gpus, "padded": padded, "pcie_mbytes_per_s": pcie,
                         "sum_after_backward": after_backward, "samples_per_s": rate,
                         "over_one_gpu": rate / one if pcie == pcie_mbytes_per_s else None,
                         "intra_sum_s": statistics.median(sums_s) if sums_s else None,
                         "intra_sum_link_s": statistics.median(links_s) if links_s else None,
                         "pcie_bound_s": pcie_floor_s(itype.gpus, numel, 8 * pcie) if itype.gpus > 1 else None})
    return {"rows": rows, "batch_per_gpu": SCALING_BATCH, "reference_compute_s": REFERENCE_COMPUTE_S,
            "pcie_mbytes_per_s": pcie_mbytes_per_s, "vector_mb": numel * 4 / 1e6,
            "workload": f"{SCALING_WORKLOAD} width {SCALING_OPTIONS['width']}"}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    top = 0.0
    for k, curve in result["throughput_by_workers"].items():
        workers = [int(n) for n in curve]
        measured = list(curve.values())
        ax.plot(workers, measured, "o-", label=f"measured, k = {k} PS")
        cap = int(k) * result["ps_cap_samples_per_s"]
        ax.axhline(cap, linestyle="--", color="red" if k == "1" else "purple", label=f"cap of {k} PS")
        top = max(top, max(measured), cap)
    ax.set_xlabel("workers")
    ax.set_ylabel("samples / s")
    ax.set_ylim(0, top * 1.2)
    ax.set_title(f"{SCALING_WORKLOAD} (width {SCALING_OPTIONS['width']}), batch {SCALING_BATCH}, "
                 f"compute {REFERENCE_COMPUTE_S:g} s, {result['ps_bandwidth_mbps']:g} Mbps a PS")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_runtime_bench(device: str = "cpu", quick: bool = False, scaling: bool = True,
                      max_s: float = math.inf, parts: tuple[str, ...] = PARTS) -> dict:
    """The whole benchmark as a dict: the overhead cases for `device` ("cpu" or "cuda") and, with
    `scaling`, the throughput curves with k = 1 and k = 2 PS shards. No case starts once `max_s`
    have passed (a check with a time budget); those left out are named under "skipped"."""
    artifacts = REPO / "artifacts" / "bench-runtime"
    runs = artifacts / time.strftime("%Y%m%dT%H%M%S")
    started_s = time.monotonic()
    cases, skipped = [], []
    for case in (GPU_CASES if device == "cuda" else CPU_CASES) if "overhead" in parts else ():
        if time.monotonic() - started_s >= max_s:
            skipped.append(case.label)
            continue
        numel = wire.flat_size(build_workload(case.workload, case.options).model)
        vector_mb = numel * 4 / 1e6
        rounds = (8 if quick else 20) if case is TINY else (5 if case.with_whole else 3)  # the two variants' gap is small against the noise
        measured = overhead(runs, case, rounds=rounds if not quick or case is TINY else 2, steps=3, device=device)
        loopback, bus_s = loopback_gbps(numel * 4), bus_copy_s(numel, device)
        cases.append(case_result(case.label, case.batch, measured, vector_mb, loopback, bus_s))
        if case.with_whole:
            cases.append(case_result(case.label + WHOLE_LABEL, case.batch, measured["whole"], vector_mb, loopback, bus_s))
    result: dict = {"device": device, "cases": cases, "quick": quick, "run_dir": str(runs)}
    if scaling and "gpus" in parts:
        result["inside_an_instance"] = scaling_inside_an_instance(runs, window_s=3.0 if quick else 10.0)
    if "evaluation" in parts and time.monotonic() - started_s >= max_s:
        skipped.append("evaluation")
    elif "evaluation" in parts:
        result["evaluation"] = evaluation_cost(runs, TINY, rounds=2 if quick else 6, device=device)
    if skipped:
        result["skipped"] = skipped
    if scaling and "workers" in parts:
        counts = [1, 4, 8] if quick else list(range(1, MAX_WORKERS + 1))
        curves = {}
        for k in (1, 2):
            curves[str(k)], param_mb = throughput_by_workers(runs, counts, window_s=3.0 if quick else 10.0, num_ps=k)
        result.update({
            "throughput_by_workers": curves,
            "ps_bandwidth_mbps": PS_BANDWIDTH_MBPS,
            "param_mb": param_mb,
            "ps_cap_samples_per_s": PS_BANDWIDTH_MBPS / 8 / (2 * param_mb) * SCALING_BATCH,
            "scaling_workload": f"{SCALING_WORKLOAD} width {SCALING_OPTIONS['width']}, batch {SCALING_BATCH}",
            "reference_compute_s": REFERENCE_COMPUTE_S,
            "k2_over_k1_at_max_workers": curves["2"][str(counts[-1])] / curves["1"][str(counts[-1])],
        })
        result["plot"] = str(artifacts / "throughput_vs_workers.png")
        plot(result, Path(result["plot"]))
    return result


def run_bench(quick: bool, part: str | None = None) -> dict:
    import torch

    return run_runtime_bench("cuda" if torch.cuda.is_available() else "cpu", quick, parts=(part,) if part else PARTS)


def format_table(result: dict) -> str:
    lines = []
    if result["cases"]:
        lines += [f"overhead on {result['device']}: one runtime worker against a plain loop (median step times)",
                  "  case | plain samples/s | runtime samples/s | ratio | of link bound | compute / plain step | "
                  "bus copies s | push+pull s | GB/s (loopback GB/s) | PS apply ms/MB"]
    for c in result["cases"]:
        lines.append(
            f"  {c['case']} ({c['vector_mb']:.1f} MB) | {c['plain_samples_per_s']:.2f} | {c['runtime_samples_per_s']:.2f} | "
            f"{c['ratio']:.3f} | {c['ratio_to_link_bound']:.3f} | "
            f"{c['worker_compute_s']:.4f} / {c['plain_step_s']:.4f} = {c['compute_over_plain_step']:.3f} | "
            f"{c['bus_copy_s']:.4f} | {c['push_pull_s']:.4f} | {c['push_pull_gbps']:.2f} ({c['loopback_gbps']:.2f}) | "
            f"{c['ps_apply_ms_per_mb']:.2f}")
    if "throughput_by_workers" in result:
        lines.append(f"throughput vs workers ({result['scaling_workload']}, compute {result['reference_compute_s']:g} s, "
                     f"each PS capped at {result['ps_bandwidth_mbps']:g} Mbps = {result['ps_cap_samples_per_s']:.1f} samples/s):")
        lines.append("  workers  " + "  ".join(f"k={k} samples/s" for k in result["throughput_by_workers"]))
        for n in result["throughput_by_workers"]["1"]:
            lines.append(f"  {n:>7}  " + "  ".join(f"{curve[n]:15.1f}" for curve in result["throughput_by_workers"].values()))
        lines.append(f"plot: {result['plot']}")
    if "inside_an_instance" in result:
        s = result["inside_an_instance"]
        lines.append(f"scaling inside an instance ({s['workload']}, {s['vector_mb']:.3f} MB, batch {s['batch_per_gpu']} "
                     f"per GPU, replicas on the CPU; PCIe {s['pcie_mbytes_per_s']:g} MB/s):")
        lines.append("  compute | PCIe MB/s | sum | GPUs | samples/s | over 1 GPU | over g | sum exposed s | "
                     "sum on the link s (medians) | PCIe bound s")
        for r in s["rows"]:
            compute = f"padded to {s['reference_compute_s']:g} s" if r["padded"] else "host, unpadded"
            when = "-" if r["gpus"] == 1 else "after backward" if r["sum_after_backward"] else "during backward"
            over = "- | -" if r["over_one_gpu"] is None else f"{r['over_one_gpu']:.2f} | {r['over_one_gpu'] / r['gpus']:.2f}"
            exposed_s, link_s, bound_s = ("-" if r[k] is None else f"{r[k]:.5f}"
                                          for k in ("intra_sum_s", "intra_sum_link_s", "pcie_bound_s"))
            lines.append(f"  {compute} | {r['pcie_mbytes_per_s']:g} | {when} | {r['gpus']} | {r['samples_per_s']:.1f} | "
                         f"{over} | {exposed_s} | {link_s} | {bound_s}")
    if "evaluation" in result:
        e = result["evaluation"]
        lines.append(f"evaluation during training ({e['case']}, every {e['every_updates']} updates, {e['rounds']} x "
                     f"{e['steps_each']} steps each): {e['updates_per_s_evaluated']:.2f} updates/s evaluated, "
                     f"{e['updates_per_s_not_evaluated']:.2f} not; retained {e['retained']:.3f}; "
                     f"{e['evaluations']} evaluations ({e['skipped']} skipped), median {e['eval_s_median'] or 0:.3f} s each")
    return "\n".join(lines)
