"""`spotfill bench market`: replay speed in simulated training hours per wall second and per CPU
second, for the whole comparison and per policy, measured in the same run (the policies that
re-plan with a solver on every revocation against the restart policy, which never calls one),
with each policy's SLO attainment and mean cost, so that a faster replay can be checked to
decide the same."""
from __future__ import annotations

from tasks.core.catalog import REPO
from tasks.core.profile import load_profile
from tasks.core.traces import load_traces
from tasks.market.study import Study, run_study

PROFILE = REPO / "profiles" / "resnet110-cifar100.json"
G3_BANDS = {"g3.8xlarge": 4, "g3.16xlarge": 4}  # the advisor has no band for the retired g3 types


def run_bench(quick: bool) -> dict:
    study = Study(profile=load_profile(PROFILE), loss_target=0.8, deadline_s=2500.0, replays=5 if quick else 50,
                  level=0.95, traces=load_traces(), bands=G3_BANDS)
    result = run_study(study)
    per_policy = {name: p["simulated_hours_per_wall_s"] for name, p in result["policies"].items()}
    return {
        "replays_per_policy": study.replays,
        "simulated_hours": result["simulated_hours"],
        "wall_s": result["wall_s"],
        "simulated_hours_per_wall_s": result["simulated_hours_per_wall_s"],
        "simulated_hours_per_cpu_s": result["simulated_hours_per_cpu_s"],
        "per_policy_simulated_hours_per_wall_s": per_policy,
        "restart_vs_exact_speed_ratio": per_policy["restart-single"] / per_policy["exact"],
        "policies": {name: {k: p[k] for k in ("slo_attainment", "mean_cost_usd", "replans_solved", "replans_remembered")}
                     for name, p in result["policies"].items()},
    }


def format_table(result: dict) -> str:
    rows = [f"{result['replays_per_policy']} replays per policy, loss 0.8 by 2500 s",
            f"all policies    {result['simulated_hours_per_wall_s']:8.1f} simulated h / wall s "
            f"({result['simulated_hours_per_cpu_s']:.1f} / CPU s)"]
    rows.append(f"{'policy':<16}{'sim h / wall s':>15}{'SLO':>7}{'mean $':>8}{'solved':>8}{'remembered':>11}")
    for name, rate in result["per_policy_simulated_hours_per_wall_s"].items():
        p = result["policies"][name]
        rows.append(f"{name:<16}{rate:15.1f}{p['slo_attainment']:7.3f}{p['mean_cost_usd']:8.3f}"
                    f"{p['replans_solved']:8d}{p['replans_remembered']:11d}")
    rows.append(f"restart (no solver) vs exact (re-plans): {result['restart_vs_exact_speed_ratio']:.1f}x faster")
    return "\n".join(rows)
