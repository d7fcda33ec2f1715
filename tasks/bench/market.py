"""`spotfill bench market`: replay speed in simulated training hours per wall second and per CPU
second, for the whole comparison and per policy, measured in the same run (the policies that
re-plan with a solver on every revocation against the restart policy, which never calls one),
with each policy's SLO attainment and mean cost, so that a faster replay can be checked to
decide the same. Two markets: the spot market of the traces (the seven spot policies, no
on-demand workers), and a drought (no spot capacity of any type for the middle third of the
deadline) where the policies that mix in on-demand workers are compared too."""
from __future__ import annotations

from tasks.core.catalog import REPO
from tasks.core.profile import load_profile
from tasks.core.traces import load_traces
from tasks.market.study import Study, run_study

PROFILE = REPO / "profiles" / "resnet110-cifar100.json"
G3_BANDS = {"g3.8xlarge": 4, "g3.16xlarge": 4}  # the advisor has no band for the retired g3 types


SPOT_DEADLINE_S = 2500.0
DROUGHT_DEADLINE_S = 4000.0


def run_bench(quick: bool) -> dict:
    replays = 5 if quick else 50
    spot = Study(profile=load_profile(PROFILE), loss_target=0.8, deadline_s=SPOT_DEADLINE_S, replays=replays,
                 level=0.95, traces=load_traces(), bands=G3_BANDS, on_demand_quota={})
    third = DROUGHT_DEADLINE_S / 3
    drought = Study(profile=load_profile(PROFILE), loss_target=0.8, deadline_s=DROUGHT_DEADLINE_S, replays=replays,
                    level=0.95, traces=load_traces(), bands=G3_BANDS, drought_s=(third, 2 * third))
    return {"replays_per_policy": replays, "spot": _case(run_study(spot)), "drought": _case(run_study(drought))}


def _case(result: dict) -> dict:
    per_policy = {name: p["simulated_hours_per_wall_s"] for name, p in result["policies"].items()}
    return {
        "deadline_s": result["deadline_s"],
        "drought_s": result["drought_s"],
        "simulated_hours": result["simulated_hours"],
        "wall_s": result["wall_s"],
        "simulated_hours_per_wall_s": result["simulated_hours_per_wall_s"],
        "simulated_hours_per_cpu_s": result["simulated_hours_per_cpu_s"],
        "per_policy_simulated_hours_per_wall_s": per_policy,
        "restart_vs_exact_speed_ratio": per_policy["restart-single"] / per_policy["exact"],
        "policies": {name: {k: p[k] for k in ("slo_attainment", "mean_cost_usd", "replans_solved", "replans_remembered")}
                     for name, p in result["policies"].items()},
        "offline_optimum_usd": (result["offline_optimum"] or {}).get("mean_cost_usd"),
    }


def format_table(result: dict) -> str:
    rows = []
    for label, case in (("spot market", result["spot"]), ("drought", result["drought"])):
        where = (f", no spot capacity {case['drought_s'][0]:g}-{case['drought_s'][1]:g} s" if case["drought_s"] else "")
        rows += [f"{label}: {result['replays_per_policy']} replays per policy, loss 0.8 by {case['deadline_s']:g} s{where}",
                 f"all policies    {case['simulated_hours_per_wall_s']:8.1f} simulated h / wall s "
                 f"({case['simulated_hours_per_cpu_s']:.1f} / CPU s)",
                 f"{'policy':<16}{'sim h / wall s':>15}{'SLO':>7}{'mean $':>8}{'solved':>8}{'remembered':>11}"]
        for name, rate in case["per_policy_simulated_hours_per_wall_s"].items():
            p = case["policies"][name]
            rows.append(f"{name:<16}{rate:15.1f}{p['slo_attainment']:7.3f}{p['mean_cost_usd']:8.3f}"
                        f"{p['replans_solved']:8d}{p['replans_remembered']:11d}")
        if case["offline_optimum_usd"] is not None:
            rows.append(f"{'offline optimum':<16}{'':>15}{'':>7}{case['offline_optimum_usd']:8.3f}")
        rows += [f"restart (no solver) vs exact (re-plans): {case['restart_vs_exact_speed_ratio']:.1f}x faster", ""]
    return "\n".join(rows[:-1])
