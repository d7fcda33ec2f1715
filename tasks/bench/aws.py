"""`spotfill bench aws`: what the aws provider costs in API calls, and how fast a spot notice
reaches the orchestrator, measured on moto's EC2 over HTTP (needs the dev extra, moto[server]).

Latency is from the moment IMDS posts spot/instance-action to the moment the orchestrator's
poll returns the revocation_notice event: the real watcher process polls IMDS (a local stub),
tags its instance through the EC2 API, and the orchestrator's DescribeInstances sees the tag.
It is bounded by the two poll periods (at most about twice the period), so each setting is
measured separately; the watcher's loop, the orchestrator's loop and the notice come at random
moments relative to each other (seeded), as they would in life.
"""
from __future__ import annotations

import random
import statistics
import threading
import time
import uuid
from pathlib import Path

from tasks.core.catalog import SOURCES
from tasks.providers.aws_sandbox import fake_credentials, moto_server, stock_amis, wait_for_event, watched_instance
from tasks.providers.base import Startup

REGION = "us-east-1"
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
TYPES = ["g4dn.2xlarge", "g5.xlarge"]


def run_bench(quick: bool) -> dict:
    import boto3

    from tasks.providers.aws import AwsConfig, AwsProvider  # deferred: boto3 (start-up cost)

    poll_periods_s = [1.0] if quick else [5.0, 1.0, 0.25]
    trials = 2 if quick else 4
    with fake_credentials(), moto_server() as url:
        amis = stock_amis(boto3.client("ec2", endpoint_url=url, region_name=REGION))
        config = dict(endpoint_url=url, ami_ids=amis, candidate_types=TYPES,
                      spot_price_archive=SOURCES / "spot-prices-gpu-2022-05-31.tsv")
        provider = AwsProvider(AwsConfig(**config))
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        startup = Startup(("python3", "-m", "tasks.worker"))

        def calls(action) -> dict[str, int]:
            before = provider.api_calls.snapshot()
            action()
            return dict(provider.api_calls.snapshot() - before)

        cost = {
            "catalog_refresh": calls(provider.refresh_catalog),
            "first_launch_of_run": calls(lambda: provider.launch(run_id, "p1", "g5.xlarge", 2, startup=startup)),
            "next_launch": calls(lambda: provider.launch(run_id, "p1", "g4dn.2xlarge", 1, startup=startup)),
            "retried_launch": calls(lambda: provider.launch(run_id, "p1", "g5.xlarge", 2, startup=startup)),
            "poll": calls(lambda: provider.poll_events(run_id)),
            "cleanup": calls(lambda: provider.cleanup(run_id)),
        }
        latency = []
        phase = random.Random(6)
        for poll_s in poll_periods_s:
            samples = []
            for trial in range(trials):
                (victim,) = provider.launch(run_id, f"lat-{poll_s:g}-{trial}", "g5.xlarge", 1).instances
                with watched_instance(victim.instance_id, REGION, url, poll_s) as imds:
                    seen: dict = {}
                    orchestrator = threading.Thread(target=lambda: seen.update(
                        event=wait_for_event(provider, run_id, "revocation_notice", victim.instance_id, poll_s)))
                    time.sleep(phase.uniform(0.0, poll_s))  # the two loops out of step, as in life
                    orchestrator.start()
                    time.sleep(phase.uniform(0.0, poll_s))
                    noticed_at_s = imds.post_notice()
                    orchestrator.join(timeout=120)
                samples.append(seen["event"][1] - noticed_at_s)
                provider.terminate([victim.instance_id])
            latency.append({
                "poll_s": poll_s,
                "trials": trials,
                "mean_s": statistics.fmean(samples),
                "max_s": max(samples),
                "samples_s": samples,
            })
        provider.cleanup(run_id)
    plot_path = plot_latency(latency, ARTIFACTS / "aws-detection-latency.png")
    return {
        "api_calls": {k: {"total": sum(v.values()), "by_operation": v} for k, v in cost.items()},
        "detection_latency": latency,
        "plot": str(plot_path),
    }


def plot_latency(latency: list[dict], path: Path) -> Path:
    """Each notice's latency against the poll period, with the two-period bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    periods = [row["poll_s"] for row in latency]
    for row in latency:
        ax.scatter([row["poll_s"]] * len(row["samples_s"]), row["samples_s"], color="tab:blue", s=18)
    ax.plot(sorted(periods), [2 * p for p in sorted(periods)], "--", color="gray", label="2 x poll period")
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(sorted(periods), [f"{p:g}" for p in sorted(periods)])
    ax.set_xlabel("watcher and orchestrator poll period (s)")
    ax.set_ylabel("notice -> orchestrator event (s)")
    ax.set_title("Spot notice detection on moto")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path


def format_table(result: dict) -> str:
    lines = ["AWS provider on moto: API calls", f"{'action':<22}{'calls':>6}  by operation"]
    for action, c in result["api_calls"].items():
        ops = ", ".join(f"{op} {n}" for op, n in sorted(c["by_operation"].items()))
        lines.append(f"{action:<22}{c['total']:>6}  {ops}")
    lines += ["", "notice -> orchestrator event (watcher and orchestrator poll every poll_s)",
              f"{'poll_s':>8}{'trials':>8}{'mean s':>9}{'max s':>9}"]
    for row in result["detection_latency"]:
        lines.append(f"{row['poll_s']:>8g}{row['trials']:>8}{row['mean_s']:>9.2f}{row['max_s']:>9.2f}")
    lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)
