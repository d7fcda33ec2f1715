"""The simulation report for people: a table and a cost-vs-SLO-attainment PNG."""
from __future__ import annotations

from pathlib import Path


def format_table(result: dict) -> str:
    rows = [
        f"{result['workload']}: loss {result['loss_target']} by {result['deadline_s']:g} s, "
        f"{result['replays']} replays per policy, T_ohd {result['overhead_s']:g} s, "
        f"risk-aware target {result['target_level']:g}",
        "",
        f"{'policy':<18}{'SLO met':>8}{'mean $':>9}{'p95 $':>9}{'mean s':>9}{'p95 s':>9}{'revoked':>8}"
        f"{'re-plans':>9}{'saves vs OD':>12}{'vs offline':>11}",
    ]
    for name, p in result["policies"].items():
        gap = f"{p['gap_to_offline_pct']:>+10.1f}%" if "gap_to_offline_pct" in p else f"{'-':>11}"
        rows.append(f"{name:<18}{p['slo_attainment']:>8.3f}{p['mean_cost_usd']:>9.3f}{p['p95_cost_usd']:>9.3f}"
                    f"{p['mean_time_s']:>9.0f}{p['p95_time_s']:>9.0f}{p['mean_revocations']:>8.2f}"
                    f"{p['mean_replans']:>9.2f}{p.get('savings_vs_on_demand_pct', 0.0):>11.1f}%{gap}")
    offline = result.get("offline_optimum")
    if offline:
        rows.append(f"{'offline optimum':<18}{'':>8}{offline['mean_cost_usd']:>9.3f}{offline['p95_cost_usd']:>9.3f}"
                    f"{'':>43}{offline['savings_vs_on_demand_pct']:>11.1f}%  (knows the market; a floor, not a run)")
    on_demand = {t: n for t, n in result.get("on_demand_quota", {}).items() if n}
    if on_demand:
        rows += ["", "on-demand workers allowed (greedy, uniform-progress, deadline-safe): "
                 + ", ".join(f"{t}={n}" for t, n in on_demand.items())]
    if result.get("drought_s"):
        start_s, end_s = result["drought_s"]
        rows.append(f"spot capacity: none of any type from {start_s:g} s to {end_s:g} s of training (--drought)")
    elif result.get("capacity"):
        rows.append("spot capacity: " + "; ".join(f"{t} from {', '.join(names)}" for t, names in result["capacity"].items()))
    est = result.get("risk_estimate")
    if est:
        rows += ["", f"risk-aware plan  {est['plan']}: estimated P(meet) {est['meet_probability']:.3f}"
                     + (f" ({est['message']})" if est["message"] else "")]
    replayed = "all as Poisson processes (--synthetic)" if result.get("synthetic") else "trace windows where mapped"
    rows += ["", f"revocation hazards (per instance-hour), replayed {replayed}:"]
    for name, h in result["hazards_per_h"].items():
        where = {"trace": f"{len(h['traces'])} real trace(s) of its family",
                 "band": f"interruption band x stress {result['band_stress_factor']:.0f}",
                 "unused": "not used (quota 0)"}[h["source"]]
        rows.append(f"  {name:<16}{h['rate']:>8.4f}  {where}")
    rows += ["", f"replay speed     {result['simulated_hours_per_wall_s']:.1f} simulated hours per wall second "
                 f"({result['simulated_hours']:.1f} h in {result['wall_s']:.1f} s; "
                 f"{result['simulated_hours_per_cpu_s']:.1f} per CPU second)"]
    if "plot" in result:
        rows.append(f"plot             {result['plot']}")
    return "\n".join(rows)


def write_plot(result: dict, path: Path) -> Path:
    """Mean cost against SLO attainment, one point per policy, the target level as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points: dict[tuple[float, float], list[str]] = {}  # policies landing on one point share a label
    for name, p in result["policies"].items():
        points.setdefault((round(p["slo_attainment"], 3), round(p["mean_cost_usd"], 2)), []).append(name)
    for (slo, cost), names in points.items():
        ax.scatter(slo, cost, s=40)
        ax.annotate(" = ".join(names), (slo, cost), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axvline(result["target_level"], color="grey", linestyle="--", linewidth=1, label="risk-aware target")
    if result.get("offline_optimum"):
        ax.axhline(result["offline_optimum"]["mean_cost_usd"], color="tab:green", linestyle=":", linewidth=1,
                   label="offline optimum (knows the market)")
    ax.set_xlabel("SLO attainment (share of replays meeting the deadline)")
    ax.set_ylabel("mean cost (USD)")
    ax.set_xlim(-0.05, 1.1)
    ax.set_title(f"{result['workload']}: loss {result['loss_target']} by {result['deadline_s']:g} s, "
                 f"T_ohd {result['overhead_s']:g} s, {result['replays']} replays", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path
