"""`spotfill bench filling`: training alone, inference alone, naive co-location, rate-limited
(TGS-like) co-location and the gated filler, measured in one run on this machine.

Each round runs every training mode once (order rotated per round) with the same seeds; the
first `warmup_steps` of each run are discarded (they also hold the guard's calibration steps).
Retained = mean step time alone / mean step time with the mode (samples per step are fixed),
per round, median over rounds; step-time slowdowns compare p50 and p99 of the same round.
The bubble is set to `bubble_share` of the step by choosing the emulated link bandwidth from the
solo compute time measured at the start.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from tasks.filling.attach import FillConfig, assemble
from tasks.filling.monitor import BubbleMonitor
from tasks.filling.trainloop import TrainingJob

MODES = ("naive", "rate_limited", "gated")
ARTIFACT = Path("artifacts") / "filling_bench.png"


def _settings(quick: bool) -> dict:
    return {"rounds": 3 if quick else 5, "warmup_steps": 8, "steps": 25 if quick else 80,
            "solo_inference_s": 3.0 if quick else 6.0, "bubble_share": 0.5}


def bench_config() -> FillConfig:
    return FillConfig(online_rate_per_s=20.0, slo_s=0.5, max_batch=32, intra_op_threads=2,
                      max_in_flight=1, margin=0.25, tolerance=0.05, queue_capacity=64)


def _window(before: dict, after: dict) -> dict:
    keys = ("offline_samples", "online_served", "online_offered", "online_shed_overflow",
            "online_shed_expired", "busy_s", "busy_in_bubble_s", "spill_s", "bubble_s", "chunks")
    return {k: after[k] - before[k] for k in keys}


def _run_training(job: TrainingJob, listener, warmup: int, steps: int, filler=None) -> dict:
    job.run(warmup, listener)
    since_s = time.perf_counter()
    before = filler.metrics() if filler else None
    times = job.run(steps, listener, first_step=warmup)
    out = {"step_times_s": times, "wall_s": time.perf_counter() - since_s}
    if filler is not None:
        after = filler.metrics(since_s)
        out.update(_window(before, after))
        out.update({k: after[k] for k in ("online_p50_s", "online_p95_s", "online_p99_s",
                                          "guard_budget", "guard_shrinks", "error")})
    return out


def _colocated(job: TrainingJob, config: FillConfig, policy: str, s: dict) -> dict:
    filler = assemble(config, policy)
    filler.calibrate()
    filler.start()
    try:
        return _run_training(job, filler, s["warmup_steps"], s["steps"], filler)
    finally:
        filler.close()


def _inference_alone(config: FillConfig, duration_s: float) -> dict:
    filler = assemble(config, "naive")
    filler.calibrate()
    since_s = time.perf_counter()
    filler.start()
    time.sleep(duration_s)
    filler.close()
    wall_s = time.perf_counter() - since_s
    m = filler.metrics()
    return {"offline_samples_per_s": m["offline_samples"] / wall_s, "online_p50_s": m["online_p50_s"],
            "online_p95_s": m["online_p95_s"], "online_p99_s": m["online_p99_s"],
            "busy_fraction": m["busy_s"] / wall_s}


def _summarize(alone: dict, run: dict) -> dict:
    a, r = np.array(alone["step_times_s"]), np.array(run["step_times_s"])
    busy_s = run["busy_s"]
    return {
        "training_retained": float(a.mean() / r.mean()),
        "step_slowdown_p50": float(np.percentile(r, 50) / np.percentile(a, 50) - 1),
        "step_slowdown_p99": float(np.percentile(r, 99) / np.percentile(a, 99) - 1),
        "fill_efficiency": run["busy_in_bubble_s"] / run["bubble_s"] if run["bubble_s"] else 0.0,
        "spill_s": run["spill_s"],
        "spill_fraction": run["spill_s"] / busy_s if busy_s else 0.0,
        "offline_samples_per_s": run["offline_samples"] / run["wall_s"],
        "online_p50_s": run["online_p50_s"], "online_p95_s": run["online_p95_s"],
        "online_p99_s": run["online_p99_s"],
        "online_shed": run["online_shed_overflow"] + run["online_shed_expired"],
        "online_offered": run["online_offered"],
        "guard_shrinks": run["guard_shrinks"],
    }


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(statistics.median(values)) if values else None


def run_bench(quick: bool) -> dict:
    s = _settings(quick)
    config = bench_config()
    job = TrainingJob()
    probe = BubbleMonitor()
    job.set_bubble(1e-3)
    job.run(s["warmup_steps"], probe)
    compute_s = statistics.median(probe.compute_times_s[-5:])
    job.set_bubble(compute_s * s["bubble_share"] / (1 - s["bubble_share"]))

    solo = _inference_alone(config, s["solo_inference_s"])
    rounds = []
    for r in range(s["rounds"]):
        order = ["alone", *MODES]
        order = order[r % len(order):] + order[:r % len(order)]
        runs = {}
        for mode in order:
            if mode == "alone":
                monitor = BubbleMonitor()
                runs[mode] = _run_training(job, monitor, s["warmup_steps"], s["steps"])
            else:
                runs[mode] = _colocated(job, config, mode, s)
        rounds.append({mode: _summarize(runs["alone"], runs[mode]) for mode in MODES})
        rounds[-1]["alone_step_s"] = float(np.mean(runs["alone"]["step_times_s"]))

    modes = {mode: {k: _median([rd[mode][k] for rd in rounds]) for k in rounds[0][mode]}
             for mode in MODES}
    for mode in MODES:
        modes[mode]["offline_share_of_solo"] = (
            modes[mode]["offline_samples_per_s"] / solo["offline_samples_per_s"])
    gated, naive = modes["gated"], modes["naive"]
    result = {
        "training_retained": gated["training_retained"],
        "naive_training_retained": naive["training_retained"],
        "rate_limited_training_retained": modes["rate_limited"]["training_retained"],
        "step_slowdown_p50": gated["step_slowdown_p50"],
        "step_slowdown_p99": gated["step_slowdown_p99"],
        "fill_efficiency": gated["fill_efficiency"],
        "spill_fraction": gated["spill_fraction"],
        "offline_samples_per_s": gated["offline_samples_per_s"],
        "offline_share_of_solo": gated["offline_share_of_solo"],
        "online_p95_s": gated["online_p95_s"],
        "naive_online_p95_s": naive["online_p95_s"],
        "solo_inference": solo,
        "modes": modes,
        "rounds": rounds,
        "settings": {**s, "compute_s": compute_s, "comm_s": job.transfer_s(),
                     "bandwidth_mbps": job.bandwidth_mbps, "param_mb": job.param_bytes / 2**20,
                     "training_batch": job.batch, "fill_config": config.model_dump()},
    }
    result["plot"] = _plot(result)
    return result


def _plot(result: dict) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    modes = result["modes"]
    names = list(MODES)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    panels = [("training retained", [modes[m]["training_retained"] for m in names], 1.0),
              ("offline inference (samples/s)", [modes[m]["offline_samples_per_s"] for m in names],
               result["solo_inference"]["offline_samples_per_s"]),
              ("online p95 latency (s)", [modes[m]["online_p95_s"] or 0 for m in names],
               result["solo_inference"]["online_p95_s"])]
    for ax, (title, values, reference) in zip(axes, panels):
        ax.bar(names, values, color=["tab:red", "tab:orange", "tab:green"])
        if reference is not None:
            ax.axhline(reference, color="k", linestyle="--", linewidth=1, label="alone")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle("spotfill bench filling (medians over rounds)")
    fig.tight_layout()
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(ARTIFACT, dpi=110)
    plt.close(fig)
    return str(ARTIFACT)


def format_table(result: dict) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    st = result["settings"]
    lines = [f"training: compute {st['compute_s'] * 1e3:.1f} ms + comm {st['comm_s'] * 1e3:.1f} ms "
             f"per step; {st['rounds']} rounds x {st['steps']} steps (warm-up {st['warmup_steps']} "
             "discarded)",
             f"{'mode':<13}{'retained':>9}{'p50 slow':>9}{'p99 slow':>9}{'fill eff':>9}"
             f"{'spill':>7}{'offline/s':>10}{'of solo':>8}{'on p50':>8}{'on p95':>8}{'shed':>6}"]
    solo = result["solo_inference"]
    lines.append(f"{'infer alone':<13}{'-':>9}{'-':>9}{'-':>9}{'-':>9}{'-':>7}"
                 f"{solo['offline_samples_per_s']:>10.1f}{'1.00':>8}"
                 f"{fmt(solo['online_p50_s'], '.3f'):>8}{fmt(solo['online_p95_s'], '.3f'):>8}{'-':>6}")
    for mode in MODES:
        m = result["modes"][mode]
        lines.append(f"{mode:<13}{m['training_retained']:>9.3f}{m['step_slowdown_p50']:>+9.1%}"
                     f"{m['step_slowdown_p99']:>+9.1%}{m['fill_efficiency']:>9.2f}"
                     f"{m['spill_fraction']:>7.2f}{m['offline_samples_per_s']:>10.1f}"
                     f"{m['offline_share_of_solo']:>8.2f}{fmt(m['online_p50_s'], '.3f'):>8}"
                     f"{fmt(m['online_p95_s'], '.3f'):>8}{m['online_shed']:>6.0f}")
    if result.get("plot"):
        lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)
