"""The run's report: a verdict in words, tables, and a timeline plot (predicted vs observed loss
and cost, revocations and re-plans marked), as files under artifacts/<run-id>/ and as Prefect
artifacts when a flow is running."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np

from tasks.core.atomic import atomic_write_json, atomic_write_text
from tasks.pipeline.session import TrainingSession


def inference_harvested(run_dir: Path) -> dict:
    """Totals of the workers' inference-filling metrics (<run>/filling/*.json), if any."""
    totals = {"offline_samples": 0, "online_requests": 0, "online_shed": 0, "workers": 0,
              "compute_slowdown_max": None}  # the most filling cost a worker's compute phase
    for path in sorted((run_dir / "filling").glob("*.json")):
        try:
            m = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        totals["workers"] += 1
        totals["offline_samples"] += int(m.get("offline_samples", 0))
        totals["online_requests"] += int(m.get("online_served", 0))
        totals["online_shed"] += sum(int(m.get(k, 0)) for k in ("online_shed_overflow", "online_shed_expired",
                                                                  "online_shed_paused"))
        if m.get("compute_slowdown") is not None:
            totals["compute_slowdown_max"] = max(m["compute_slowdown"], totals["compute_slowdown_max"] or -1.0)
    return totals


def predicted_curve(session: TrainingSession, t_max_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Loss over time as the plan training started with predicted it: loss(j) of Eq. 3 with
    j = t / Texp, from when the workers have joined."""
    curve, texp_s = session.loss_curve(session.started_plan.plan)
    start_s = session.request.overhead_s  # the plan allows this long for workers to start and join
    t = np.linspace(start_s, t_max_s, 200)
    return t, curve.loss_at((t - start_s) / texp_s)


def plot_timeline(session: TrainingSession, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    obs = [o for o in session.observations if o.loss is not None]
    slo = session.request.slo
    metric = slo.metric  # with one, its curve is plotted as the metric reads (as_reported)
    shown = np.vectorize(slo.as_reported, otypes=[float])
    fig, (ax_loss, ax_cost) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    if obs:
        ax_loss.plot([o.t_s for o in obs], shown([o.loss for o in obs]), color="tab:blue",
                     **({"label": "observed (smoothed)"} if metric is None else
                        {"label": "observed (evaluations)", "marker": "o", "ms": 3}))
        ax_cost.plot([o.t_s for o in session.observations], [o.spent_usd for o in session.observations],
                     label="observed spend (workers)", color="tab:blue")
    t_max = max(slo.deadline_s, obs[-1].t_s if obs else 0.0)
    first = session.started_plan
    if first is not None and first.plan and np.isfinite(first.predicted_time_s):
        t, loss = predicted_curve(session, t_max)
        ax_loss.plot(t, shown(loss), "--", label=f"predicted, plan launched ({first.predicted_time_s:.0f} s)",
                     color="tab:orange")
        start_s = session.request.overhead_s
        ax_cost.plot([start_s, start_s + first.predicted_time_s], [0, first.predicted_cost_usd], "--",
                     color="tab:orange", label="predicted spend, plan launched")
    target_label = f"target loss {slo.target_loss:g}" if metric is None else f"target {metric}"
    ax_loss.axhline(slo.as_reported(slo.curve_target), color="tab:green", lw=1, label=target_label)
    if obs:  # Eq. 3 grows without bound as j -> 0: show the losses the run went through
        seen = list(shown([o.loss for o in obs] + [slo.curve_target]))
        pad = 0.05 * (max(seen) - min(seen) or 1.0)
        ax_loss.set_ylim(min(seen) - pad, max(seen) + pad)
    for ax in (ax_loss, ax_cost):
        ax.axvline(slo.deadline_s, color="tab:red", lw=1, label="deadline")
        for entry in session.timeline:
            if entry.kind == "revocation" and entry.detail.get("kind") == "revocation_notice":
                ax.axvline(entry.t_s, color="black", ls=":", lw=1)
            elif entry.kind == "replan":
                ax.axvline(entry.t_s, color="tab:purple", ls="-.", lw=1)
            elif entry.kind == "capacity":
                ax.axvline(entry.t_s, color="tab:brown", ls="--", lw=1)
            elif entry.kind == "on-demand":
                ax.axvline(entry.t_s, color="tab:olive", ls="-", lw=1)
    ax_loss.plot([], [], ":", color="black", label="revocation notice")
    ax_loss.plot([], [], "-.", color="tab:purple", label="re-plan")
    ax_loss.plot([], [], "--", color="tab:brown", label="market refused a launch")
    if any(e.kind == "on-demand" for e in session.timeline):
        ax_loss.plot([], [], "-", color="tab:olive", label="on-demand workers launched / released")
    on_demand = [o.on_demand_spent_usd for o in session.observations]
    if any(on_demand):
        ax_cost.plot([o.t_s for o in session.observations], on_demand, label="of which on-demand workers",
                     color="tab:olive")
    ax_loss.set_ylabel("training loss" if metric is None else f"{metric.name} (held out)")
    ax_cost.set_ylabel("USD")
    ax_cost.set_xlabel("seconds since launch")
    ax_loss.set_title(f"{session.run_id}: {session.request.workload}, predicted vs observed")
    ax_loss.legend(fontsize=8)
    ax_cost.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def plan_text(plan: dict[str, int]) -> str:
    return " + ".join(f"{n} x {t}" for t, n in sorted(plan.items()) if n) or "no workers"


def stopped_report_markdown(summary: dict) -> str:
    """A cancelled or crashed run's report (tasks/pipeline/stages.py stop_and_report): the verdict,
    and the plan, revocations, re-plans, shortfalls and timeline its last progress on disk had reached."""
    lines = [f"# {summary['run_id']}", "", f"**{summary['verdict']}**", ""]
    if "plan" in summary:
        lines += [f"- plan in effect: {plan_text(summary['plan'])}",
                  f"- revocations: {summary.get('revocations', 0)}, re-plans: {summary.get('replans', 0)}"]
        lines += [f"- the market refused {s['missing']} x {s['type']}: {s['why']}" for s in summary.get("shortfalls", [])]
    if summary.get("timeline"):
        lines += ["", *timeline_lines(summary["timeline"])]
    return "\n".join(lines) + "\n"


def timeline_lines(timeline: list[dict]) -> list[str]:
    """The run's timeline as a markdown table, one row per entry."""
    lines = ["## Timeline", "", "| t (s) | event | detail |", "|---|---|---|"]
    for e in timeline:
        detail = {k: v for k, v in e.items() if k not in ("t_s", "kind")}
        lines.append(f"| {e['t_s']:.1f} | {e['kind']} | {json.dumps(detail)} |")
    return lines


STOP_CAUSES = {  # a PS stop reason the verdict spells out (others are shown as they are)
    "diverged": "the loss became NaN or infinite (diverged): lower the learning rate or check the workload",
}


def stop_cause(result: dict) -> str:
    """'; training stopped early: WHY' when the PS stopped before the run was done, else ''."""
    if result.get("ended") != "stopped" or not result.get("stopped"):
        return ""
    return f"; training stopped early: {STOP_CAUSES.get(result['stopped'], result['stopped'])}"


def verdict(session: TrainingSession, result: dict, harvested: dict) -> str:
    """One paragraph: met or missed, against the plan training started with; why training
    stopped, if it stopped early; the plan in effect at the end; the re-plans and what the
    market refused."""
    slo = session.request.slo
    first = session.started_plan
    word = "SLO met" if result["met"] else "SLO missed"
    start_s = session.request.overhead_s  # the start-up allowance (T_ohd), outside the predicted time
    predicted_t = "n/a"
    if first:
        predicted_t = f"{first.predicted_time_s:.1f} s" + (f" + {start_s:g} s to start" if start_s else "")
    predicted_c = f"${first.predicted_cost_usd:.4f}" if first else "n/a"
    refused = sum(s["missing"] for s in session.shortfalls)
    shortfall = (f"; the market refused {refused} instance(s) "
                 f"({', '.join(sorted({s['type'] for s in session.shortfalls}))})" if refused else "")
    on_demand = session.on_demand_workers
    fallback = (f"; {len(on_demand)} on-demand worker(s) ({', '.join(sorted({w['type'] for w in on_demand}))}) "
                f"cost ${result.get('on_demand_spent_usd', 0.0):.4f} of it" if on_demand else "")
    return (f"{word}: {slo.state_text(result['final_loss'])} after {result['observed_time_s']:.1f} s of "
            f"{slo.deadline_s:g} s (predicted {predicted_t}){stop_cause(result)}; cost ${result['spent_usd']:.4f} (predicted {predicted_c}, "
            f"plus ${result['ps_spent_usd']:.4f} for the on-demand PS); final plan "
            f"{plan_text(session.plans[-1].plan) if session.plans else 'n/a'}; "
            f"{session.revocations} revocation(s), {session.replans} re-plan(s){shortfall}{fallback}; "
            f"inference harvested: {harvested['offline_samples']} offline samples, "
            f"{harvested['online_requests']} online requests")


def metric_outcome(slo, result: dict) -> dict:
    """With a target metric, the summary's: the target, and the final value as the metric reads."""
    if slo.target_metric is None:
        return {}
    final = result["final_loss"]
    return {"target_metric": slo.target_metric, "final_metric": None if final is None else slo.as_reported(final)}


def finite_or_none(value):
    """JSON has no infinity: an unreachable prediction (an empty plan's time) is written as null."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value


def write_run_report(session: TrainingSession, result: dict, stage_seconds: dict[str, float]) -> dict:
    run_dir = session.run_dir
    harvested = inference_harvested(run_dir)
    timeline_png = plot_timeline(session, run_dir / "timeline.png")
    total_s = sum(stage_seconds.values())
    summary = {
        "run_id": session.run_id, "verdict": verdict(session, result, harvested), **result,
        "deadline_s": session.request.slo.deadline_s, "target_loss": session.request.slo.target_loss,
        **metric_outcome(session.request.slo, result),
        "predicted_time_s": session.started_plan.predicted_time_s if session.started_plan else None,
        "predicted_cost_usd": session.started_plan.predicted_cost_usd if session.started_plan else None,
        "final_plan": session.plans[-1].plan if session.plans else {}, "shortfalls": session.shortfalls,
        "plans": [{"plan": p.plan, "solver": p.solver, "predicted_time_s": p.predicted_time_s,
                   "predicted_cost_usd": p.predicted_cost_usd} for p in session.plans],
        "alternatives": session.alternatives,
        "revocations": session.revocations, "replans": session.replans, "ps_restarts": session.ps_restarts,
        "on_demand_workers": session.on_demand_workers,
        "spot_spent_usd": result["spent_usd"] - result.get("on_demand_spent_usd", 0.0),
        "inference": harvested, "stage_seconds": stage_seconds,
        "orchestration_overhead_s": total_s - stage_seconds.get("train", 0.0),
        "timeline": [{"t_s": e.t_s, "kind": e.kind, **e.detail} for e in session.timeline],
        "report_dir": str(run_dir), "timeline_png": str(timeline_png),
        "trained_workers": trained_workers(session),
    }
    summary = finite_or_none(summary)
    atomic_write_json(run_dir / "summary.json", summary)
    atomic_write_text(run_dir / "report.md", report_markdown(summary))
    _prefect_artifacts(summary)
    return summary


def instance_inference(run_dir: Path, instance_id: str) -> int | None:
    """The inference samples an instance's fillers served, every replica's summed (the worker's
    metrics file, <run>/filling/<instance id>.json); None when it filled nothing or left no file."""
    if not instance_id:
        return None
    try:
        m = json.loads((run_dir / "filling" / f"{instance_id}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return int(m["inference_samples"]) if m.get("inference_samples") is not None else None


def trained_workers(session: TrainingSession) -> list[dict]:
    """Each worker as the PS saw it (one per instance) with its GPUs: a multi-GPU instance trains
    one replica per GPU and fills each GPU's bubbles (docs/runtime.md); `inference_samples` is the
    instance's, summed over its replicas."""
    if session.run is None:
        return []
    return [{"worker": w, "instance_type": s.instance_type, "gpus": s.gpus, "updates": s.updates,
             "samples": s.samples, "inference_samples": instance_inference(session.run_dir, s.instance_id),
             "left": s.left} for w, s in sorted(session.run.progress().workers.items())]


def workers_markdown(summary: dict) -> list[str]:
    workers = summary.get("trained_workers") or []
    if not workers:
        return []
    lines = ["", "## Workers (one per instance; a replica per GPU)", "",
             "| worker | type | GPUs (replicas) | updates | samples | inference samples (all GPUs) | left |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {w['worker']} | {w['instance_type']} | {w['gpus']} | {w['updates']} | {w['samples']} | "
              f"{'-' if w.get('inference_samples') is None else w['inference_samples']} | {w['left'] or '-'} |"
              for w in workers]
    return lines


def report_markdown(summary: dict, image_src: str | None = None) -> str:
    """The report as markdown; the timeline picture by file name (next to report.md) unless
    `image_src` says otherwise (a data URI, for the Prefect UI, which cannot read local files)."""
    lines = [f"# {summary['run_id']}", "", f"**{summary['verdict']}**", "",
             "## Plans (predicted)", "", "| plan | instances | time (s) | cost ($) | status |", "|---|---|---|---|---|"]
    for r in summary["alternatives"]:
        inst = ", ".join(f"{n} x {t}" for t, n in sorted(r["plan"].items())) or "-"
        t = "-" if r["predicted_time_s"] is None else f"{r['predicted_time_s']:.1f}"
        c = "-" if r["predicted_cost_usd"] is None else f"{r['predicted_cost_usd']:.4f}"
        lines.append(f"| {r['name']} | {inst} | {t} | {c} | {r['status']} |")
    lines += on_demand_markdown(summary)
    lines += workers_markdown(summary)
    lines += ["", *timeline_lines(summary["timeline"])]
    lines += ["", "## Stages (wall seconds)", "", "| stage | s |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in summary["stage_seconds"].items()]
    lines += [f"| orchestration overhead (all but training) | {summary['orchestration_overhead_s']:.2f} |", "",
              f"![timeline]({image_src or Path(summary['timeline_png']).name})", ""]
    return "\n".join(lines)


def on_demand_markdown(summary: dict) -> list[str]:
    """The on-demand workers (when, why, until when) and the workers' cost split by market; no
    section when the run used none."""
    workers = summary.get("on_demand_workers") or []
    if not workers:
        return []
    lines = ["", "## On-demand workers", "",
             f"Workers cost ${summary['spent_usd']:.4f}: ${summary['spot_spent_usd']:.4f} spot, "
             f"${summary['on_demand_spent_usd']:.4f} on-demand.", "",
             "| instance | type | launched (s) | released (s) | why |", "|---|---|---|---|---|"]
    for w in workers:
        released = "at the end" if w["released_t_s"] is None else f"{w['released_t_s']:.1f}"
        lines.append(f"| {w['instance_id']} | {w['type']} | {w['launched_t_s']:.1f} | {released} | {w['why']} |")
    return lines


def artifact_key(owner: str, kind: str) -> str:
    """A key that stays the same from run to run of one deployment (`train-with-slo-report`), so
    each run's artifact is the next version of it; the run id is in the artifact itself. Prefect
    keys take lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{owner}-{kind}".lower())


def artifact_owner() -> str:
    """Inside a flow run: its deployment's name, or its flow's name when run without one (the
    main flow's outside any run: a stage called on its own)."""
    from prefect.runtime import deployment, flow_run

    return deployment.name or flow_run.flow_name or "train-with-slo"


def _prefect_artifacts(summary: dict) -> None:
    """Mirror the report as Prefect artifacts when running inside a flow."""
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    owner = artifact_owner()
    png = base64.b64encode(Path(summary["timeline_png"]).read_bytes()).decode()
    create_markdown_artifact(report_markdown(summary, f"data:image/png;base64,{png}"),
                             key=artifact_key(owner, "report"), description=f"{summary['verdict']} (files: {summary['report_dir']})")
    create_table_artifact([{"t_s": round(e["t_s"], 1), "event": e["kind"],
                            "detail": json.dumps({k: v for k, v in e.items() if k not in ("t_s", "kind")})}
                           for e in summary["timeline"]], key=artifact_key(owner, "timeline"),
                          description=f"{summary['run_id']}: what happened when")
