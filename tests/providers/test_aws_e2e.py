"""End to end on moto over HTTP: plan -> launch -> spot notice on one worker (seen by the real
watcher process through IMDSv2) -> detection -> re-plan with the survivors -> takeover launch ->
revocation -> cleanup, which leaves nothing running.

The workload is the shipped ResNet-110 profile moved onto T4 types that moto and the price
archive both know: g4dn.2xlarge takes the measured g4dn.4xlarge compute time (same single T4;
the larger size adds only CPUs), g4dn.12xlarge has four T4s at the same per-GPU batch and time.
Prices come from the provider's catalog (the 2022-05-31 us-east-1 archive), quotas from its config.
"""
from __future__ import annotations

import uuid

import boto3
import pytest

from tasks.planner import PlanRequest, solve
from tasks.providers.aws import TAG_RUN, AwsConfig, AwsProvider
from tasks.providers.aws_sandbox import revoke, wait_for_event, watched_instance
from tasks.providers.base import Startup
from tasks.providers.plan_step import launch_step, takeover_counts
from tests.helpers import PRICE_ARCHIVE, t4_profile

pytestmark = pytest.mark.integration
REGION = "us-east-1"
LOSS_TARGET = 0.8
DEADLINE_S = 6000.0
NOTICE_AT_S, LOSS_AT_NOTICE = 2500.0, 1.5  # the scenario: where training stands when the notice comes
POLL_S = 0.25  # orchestrator and watcher poll periods in this test (production default: 5 s)


def worker_counts(instances) -> dict[str, int]:
    counts: dict[str, int] = {}
    for i in instances:
        if i.role == "worker":
            counts[i.type] = counts.get(i.type, 0) + 1
    return counts


def test_plan_launch_notice_replan_takeover_cleanup(moto_endpoint, moto_amis):
    config = AwsConfig(
        endpoint_url=moto_endpoint,
        ami_ids=moto_amis,
        spot_price_archive=PRICE_ARCHIVE,
        candidate_types=["g4dn.2xlarge", "g4dn.12xlarge"],
        quotas={"g4dn.2xlarge": 4, "g4dn.12xlarge": 1},
        on_demand_usd_per_h={"c5.xlarge": 0.17},
        watcher_poll_s=POLL_S,
    )
    provider = AwsProvider(config)
    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    types = {t.name: t for t in provider.list_types()}
    quotas = provider.type_quotas(list(types))
    profile = t4_profile(types, quotas)
    startup = Startup(("python3", "-m", "tasks.worker"), {"SPOTFILL_PS": "ps:29500"})

    try:
        # Plan and launch: the PS on demand, the workers as spot.
        first = solve(PlanRequest(profile=profile, loss_target=LOSS_TARGET, deadline_s=DEADLINE_S, overhead_s=30, solver="exact"))
        assert first.plan == {"g4dn.2xlarge": 3}
        provider.launch(run_id, "plan-1", "c5.xlarge", 1, role="ps", market="on-demand", startup=startup)
        calls = provider.api_calls.snapshot()
        step = launch_step(provider, run_id, "plan-1", first.plan, startup=startup)
        launch_calls = provider.api_calls.snapshot() - calls
        assert not step.refused and worker_counts(step.instances) == first.plan
        victim = step.instances[0]

        # The notice reaches the victim's IMDS; its watcher tags it; a poll sees it.
        with watched_instance(victim.instance_id, REGION, moto_endpoint, POLL_S) as imds:
            noticed_at_s = imds.post_notice(lead_s=120)
            notice, seen_at_s = wait_for_event(provider, run_id, "revocation_notice", victim.instance_id, POLL_S)
        latency_s = seen_at_s - noticed_at_s
        assert notice.deadline_s == pytest.approx(noticed_at_s + 120, abs=1.0)
        calls = provider.api_calls.snapshot()
        provider.poll_events(run_id)
        poll_calls = provider.api_calls.snapshot() - calls

        # Re-plan at once with the survivors (the noticed worker counts as gone), start the takeover.
        survivors = [i for i in provider.describe(run_id) if i.role == "worker" and i.state != "notice"]
        replan = solve(PlanRequest(
            profile=profile, loss_target=LOSS_TARGET, deadline_s=DEADLINE_S - NOTICE_AT_S,
            existing=worker_counts(survivors), current_loss=LOSS_AT_NOTICE, overhead_s=30, solver="exact",
        ))
        takeover = takeover_counts(replan.plan, survivors)
        assert takeover == {"g4dn.12xlarge": 1, "g4dn.2xlarge": 1}
        launch_step(provider, run_id, "plan-2", takeover, startup=startup)

        # Two minutes later EC2 takes the victim; the next poll reports it.
        revoke(REGION, victim.instance_id)
        wait_for_event(provider, run_id, "revoked", victim.instance_id, POLL_S)
        alive = provider.describe(run_id)
        assert worker_counts(alive) == replan.plan
        assert [i.market for i in alive if i.role == "ps"] == ["on-demand"]
        print(f"\nAWS e2e: detection latency {latency_s:.2f} s (polls every {POLL_S} s); "
              f"launch step {launch_calls.total()} API calls {dict(launch_calls)}; "
              f"poll {poll_calls.total()} API calls {dict(poll_calls)}; takeover {takeover}")
    finally:
        provider.cleanup(run_id)

    ec2 = boto3.client("ec2", endpoint_url=moto_endpoint, region_name=REGION)
    left = ec2.describe_instances(Filters=[
        {"Name": f"tag:{TAG_RUN}", "Values": [run_id]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]},
    ])["Reservations"]
    assert left == []
