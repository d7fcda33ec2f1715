"""The aws provider against moto's EC2 server over real HTTP: catalog, launch, idempotency,
guard and quotas, rollback, revocation detection, cleanup, bad input, secrets."""
from __future__ import annotations

import json
import logging
import threading
import uuid

import boto3
import pytest
from botocore.exceptions import ClientError, ReadTimeoutError

from tasks.core.errors import UserInputError
from tasks.providers.aws import AwsConfig, AwsProvider, TAG_RUN
from tasks.providers.aws_sandbox import ImdsStub, revoke
from tasks.providers.base import QuotaError, Startup
from tasks.providers.imds_watcher import Imds, check, tag_relay, watch
from tasks.providers.plan_step import launch_step, takeover_counts
from tests.helpers import PRICE_ARCHIVE

pytestmark = pytest.mark.integration
TYPES = ["g4dn.2xlarge", "g5.xlarge", "g5.2xlarge", "g5g.xlarge"]
REGION = "us-east-1"


@pytest.fixture(scope="module")
def shared_session(moto_endpoint):
    """One boto3 session for the providers of this module: it loads EC2's service model once."""
    return boto3.session.Session(region_name=REGION)


@pytest.fixture()
def make_provider(moto_endpoint, moto_amis, shared_session):
    def make(fresh_session: bool = False, **overrides) -> AwsProvider:
        fields = {
            "endpoint_url": moto_endpoint,
            "ami_ids": {"x86_64": moto_amis["x86_64"], "arm64": moto_amis["arm64"]},
            "spot_price_archive": PRICE_ARCHIVE,
            "candidate_types": TYPES,
            "ssh_cidr": "203.0.113.0/24",
            **overrides,
        }
        return AwsProvider(AwsConfig(**fields), session=None if fresh_session else shared_session)

    return make


@pytest.fixture()
def ec2(moto_endpoint, shared_session):
    """A plain client to look at what really exists, apart from the provider under test."""
    return shared_session.client("ec2", endpoint_url=moto_endpoint)


@pytest.fixture()
def run_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def running(ec2, run_id: str) -> list[dict]:
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[{"Name": f"tag:{TAG_RUN}", "Values": [run_id]}, {"Name": "instance-state-name", "Values": ["pending", "running"]}]
    )
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


def test_catalog_joins_hardware_archive_prices_on_demand_and_bands(make_provider):
    provider = make_provider()
    types = {t.name: t for t in provider.list_types()}
    assert set(types) == set(TYPES)
    g5 = types["g5.xlarge"]
    assert (g5.gpus, g5.gpu_model) == (1, "NVIDIA A10G")
    assert g5.spot_usd_per_h == 0.3382  # the cheapest us-east-1 AZ of the 2022-05-31 archive
    assert g5.on_demand_usd_per_h == 1.006
    assert g5.interruption_band in range(5)
    assert provider.catalog().cheapest_zone["g5.xlarge"] == "us-east-1f"  # moto maps use1-az5 there
    assert provider.api_calls.snapshot() == {
        "DescribeInstanceTypeOfferings": 1,
        "DescribeInstanceTypes": 1,
        "DescribeAvailabilityZones": 1,
    }


def test_the_catalog_is_read_once_per_provider_and_again_on_refresh(make_provider):
    """A run's stages (setup, profiling, launches) list the types many times: one read of EC2."""
    provider = make_provider()
    for _ in range(3):
        provider.list_types()
    assert provider.api_calls.snapshot()["DescribeInstanceTypes"] == 1
    provider.refresh_catalog()
    assert provider.api_calls.snapshot()["DescribeInstanceTypes"] == 2


def test_catalog_from_the_live_price_api(make_provider):
    provider = make_provider(spot_price_archive=None)
    types = {t.name: t for t in provider.list_types()}
    assert set(types) == set(TYPES)
    assert all(t.spot_usd_per_h > 0 for t in types.values())  # moto's placeholder, but parsed
    assert provider.api_calls.snapshot()["DescribeSpotPriceHistory"] == 1


def test_launch_tags_spot_imdsv2_and_a_run_only_security_group(make_provider, ec2, run_id):
    provider = make_provider()
    startup = Startup(("python3", "-m", "tasks.worker"), {"SPOTFILL_PS": "10.0.0.5:29500"})
    workers = provider.launch(run_id, "p0", "g5.xlarge", 2, startup=startup).instances
    ps = provider.launch(run_id, "p0", "g4dn.2xlarge", 1, role="ps", market="on-demand").instances
    described = {i["InstanceId"]: i for i in running(ec2, run_id)}
    assert set(described) == {i.instance_id for i in workers + ps}
    for worker in workers:
        d = described[worker.instance_id]
        tags = {t["Key"]: t["Value"] for t in d["Tags"]}
        assert tags["spotfill:plan-id"] == "p0" and tags["spotfill:role"] == "worker" and tags["spotfill:type"] == "g5.xlarge"
        assert d["InstanceLifecycle"] == "spot" and worker.market == "spot"
        assert d["MetadataOptions"]["HttpTokens"] == "required"
        assert d["Placement"]["AvailabilityZone"] == "us-east-1f"
    assert described[ps[0].instance_id].get("InstanceLifecycle") is None and ps[0].role == "ps"
    group_id = described[workers[0].instance_id]["SecurityGroups"][0]["GroupId"]
    (group,) = ec2.describe_security_groups(GroupIds=[group_id])["SecurityGroups"]
    rules = {(p["IpProtocol"], p.get("FromPort")): p for p in group["IpPermissions"]}
    assert rules[("-1", None)]["UserIdGroupPairs"][0]["GroupId"] == group_id
    assert [r["CidrIp"] for r in rules[("tcp", 22)]["IpRanges"]] == ["203.0.113.0/24"]
    assert len(rules) == 2
    user_data = ec2.describe_instance_attribute(InstanceId=workers[0].instance_id, Attribute="userData")
    import base64

    script = base64.b64decode(user_data["UserData"]["Value"]).decode()
    assert "tasks.providers.imds_watcher" in script
    # the worker's end is the instance's: it shuts down, and the launch made shutdown terminate it
    assert script.endswith("trap 'shutdown -h now' EXIT\npython3 -m tasks.worker\n")
    for instance in workers + ps:
        behaviour = ec2.describe_instance_attribute(InstanceId=instance.instance_id,
                                                    Attribute="instanceInitiatedShutdownBehavior")
        assert behaviour["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    assert provider.cleanup(run_id) == 3
    assert running(ec2, run_id) == []
    assert ec2.describe_security_groups(Filters=[{"Name": f"tag:{TAG_RUN}", "Values": [run_id]}])["SecurityGroups"] == []


def test_a_retried_launch_starts_no_duplicate(make_provider, ec2, run_id):
    provider = make_provider()
    first = provider.launch(run_id, "p0", "g5.xlarge", 2)
    before = provider.api_calls.snapshot()
    again = provider.launch(run_id, "p0", "g5.xlarge", 2)
    assert {i.instance_id for i in again.instances} == {i.instance_id for i in first.instances}
    assert provider.api_calls.snapshot() - before == {"DescribeInstances": 1}
    assert len(running(ec2, run_id)) == 2
    provider.cleanup(run_id)


def test_a_launch_whose_reply_was_lost_is_found_by_its_tags(make_provider, ec2, run_id):
    provider = make_provider()
    lost = {"left": 1}

    def lose_reply(**_):  # EC2 did the work; the reply never reached us
        if lost["left"]:
            lost["left"] -= 1
            raise ReadTimeoutError(endpoint_url="moto")

    provider.ec2.meta.events.register("after-call.ec2.RunInstances", lose_reply)
    with pytest.raises(ReadTimeoutError):
        provider.launch(run_id, "p0", "g5.xlarge", 2)
    retried = provider.launch(run_id, "p0", "g5.xlarge", 2)
    assert len(retried.instances) == 2
    assert {i["InstanceId"] for i in running(ec2, run_id)} == {i.instance_id for i in retried.instances}
    assert provider.api_calls.snapshot()["RunInstances"] == 1
    provider.cleanup(run_id)


def test_a_failure_mid_step_leaves_nothing_running(make_provider, ec2, run_id):
    # g5.xlarge starts, then g5g.xlarge (arm64) fails on an AMI that does not exist.
    provider = make_provider(ami_ids={"x86_64": make_provider().config.ami_ids["x86_64"], "arm64": "ami-0000000000000dead"})
    with pytest.raises(ClientError, match="InvalidAMIID"):
        launch_step(provider, run_id, "p0", {"g5.xlarge": 2, "g5g.xlarge": 1})
    assert provider.api_calls.snapshot()["RunInstances"] == 2
    assert running(ec2, run_id) == []


def test_ctrl_c_mid_step_leaves_nothing_running(make_provider, ec2, run_id):
    provider = make_provider()
    calls = {"n": 0}

    def interrupt_second_launch(**_):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    provider.ec2.meta.events.register("before-call.ec2.RunInstances", interrupt_second_launch)
    with pytest.raises(KeyboardInterrupt):
        launch_step(provider, run_id, "p0", {"g5.xlarge": 1, "g5.2xlarge": 1})
    assert running(ec2, run_id) == []


def test_guard_and_quotas_refuse_before_anything_starts(make_provider, ec2, run_id):
    cases = [
        ({"max_instances": 2}, "max_instances is 2"),
        ({"max_usd_per_hour": 1.0}, "max_usd_per_hour is 1.00"),
        ({"quotas": {"g5.xlarge": 2}}, "configured quota is 2"),
    ]
    for overrides, message in cases:
        provider = make_provider(**overrides)
        with pytest.raises(QuotaError, match=message):
            provider.launch(run_id, "p0", "g5.xlarge", 3)
        assert "RunInstances" not in provider.api_calls.snapshot()
    # A step over quota in its second type starts nothing of its first either.
    provider = make_provider(quotas={"g5.2xlarge": 1})
    with pytest.raises(QuotaError, match="2 x g5.2xlarge asked, the configured quota is 1"):
        launch_step(provider, run_id, "p0", {"g5.xlarge": 2, "g5.2xlarge": 2})
    assert "RunInstances" not in provider.api_calls.snapshot()
    assert running(ec2, run_id) == []
    assert make_provider(quotas={"g5.xlarge": 2}).type_quotas(["g5.xlarge", "g5.2xlarge"]) == {"g5.xlarge": 2, "g5.2xlarge": 16}


def test_capacity_errors_are_reported_back_not_raised(make_provider, ec2, run_id):
    provider = make_provider()

    def no_capacity(model=None, **_):  # what EC2 answers when the pool is empty
        raise ClientError({"Error": {"Code": "InsufficientInstanceCapacity", "Message": "none"}}, model.name)

    provider.ec2.meta.events.register("before-call.ec2.RunInstances", no_capacity)
    refusal = provider.launch(run_id, "p0", "g5.xlarge", 2).refused["g5.xlarge"]
    assert (refusal.kind, refusal.missing) == ("capacity", 2) and "InsufficientInstanceCapacity" in refusal.message
    step = launch_step(provider, run_id, "p0", {"g5.xlarge": 1})
    assert step.instances == [] and step.refused["g5.xlarge"].kind == "capacity"


def test_bad_input_is_one_clear_error_and_launches_nothing(make_provider, ec2, run_id, monkeypatch):
    provider = make_provider()
    with pytest.raises(UserInputError, match="unknown instance type 'g9.huge'"):
        provider.launch(run_id, "p0", "g9.huge", 1)
    with pytest.raises(UserInputError, match="not offered in us-east-1: p3.2xlarge"):
        make_provider(candidate_types=["g5.xlarge", "p3.2xlarge"]).list_types()
    with pytest.raises(UserInputError, match="run id"):
        provider.launch("bad run id!", "p0", "g5.xlarge", 1)
    with pytest.raises(UserInputError, match="no AMI configured for g5g.xlarge"):
        make_provider(ami_ids={"x86_64": "ami-1"}).launch(run_id, "p0", "g5g.xlarge", 1)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(UserInputError, match="no AWS credentials found") as err:
        make_provider(fresh_session=True).launch(run_id, "p0", "g5.xlarge", 1)
    assert "\n" not in str(err.value)
    monkeypatch.undo()
    assert running(ec2, run_id) == []


def test_no_secret_in_logs_errors_or_user_data(make_provider, ec2, run_id, monkeypatch, caplog):
    secret = "wJalrXUtnFEMI-sentinel-secret-key"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)  # moto takes any key
    caplog.set_level(logging.DEBUG)
    provider = make_provider(fresh_session=True, max_instances=1)
    instances = provider.launch(run_id, "p0", "g5.xlarge", 1, startup=Startup(("python3", "-m", "w"))).instances
    with pytest.raises(QuotaError) as err:
        provider.launch(run_id, "p1", "g5.xlarge", 1)
    provider.poll_events(run_id)
    user_data = ec2.describe_instance_attribute(InstanceId=instances[0].instance_id, Attribute="userData")
    provider.cleanup(run_id)
    assert secret not in caplog.text and secret not in str(err.value)
    assert secret not in json.dumps(user_data, default=str)
    assert "botocore" in caplog.text  # the debug log did run, through the signing code


def test_poll_sees_notices_rebalances_and_revocations_once(make_provider, moto_endpoint, run_id):
    provider = make_provider()
    a, b = provider.launch(run_id, "p0", "g5.xlarge", 2).instances
    stub = ImdsStub(a.instance_id)
    try:
        imds = Imds(stub.url)
        assert check(imds) == []
        stub.post_notice(lead_s=120)
        stub.post_rebalance()
        relay = tag_relay(provider.session.client("ec2", endpoint_url=moto_endpoint), a.instance_id)
        stop = threading.Event()
        watch(imds, relay, poll_s=0.05, stop=stop)  # returns once both kinds are relayed
    finally:
        stub.close()
    before = provider.api_calls.snapshot()
    events = provider.poll_events(run_id)
    assert provider.api_calls.snapshot() - before == {"DescribeInstances": 1, "DescribeInstanceStatus": 1}
    assert sorted((e.kind, e.instance_id) for e in events) == [("rebalance", a.instance_id), ("revocation_notice", a.instance_id)]
    notice = next(e for e in events if e.kind == "revocation_notice")
    assert notice.deadline_s == pytest.approx(stub.noticed_at_s + 120, abs=1.0)
    assert {i.instance_id: i.state for i in provider.describe(run_id)}[a.instance_id] == "notice"
    revoke(REGION, a.instance_id)
    events = provider.poll_events(run_id)
    assert [(e.kind, e.instance_id) for e in events] == [("revoked", a.instance_id)]
    assert provider.poll_events(run_id) == []
    assert [i.instance_id for i in provider.describe(run_id)] == [b.instance_id]
    provider.cleanup(run_id)


def test_imds_token_is_fetched_again_when_refused():
    stub = ImdsStub("i-0123")
    try:
        imds = Imds(stub.url)
        assert imds.get("instance-id") == "i-0123"
        stub.token = "rotated"  # the old token is now refused with 401
        assert imds.get("instance-id") == "i-0123"
    finally:
        stub.close()


def test_takeover_counts_are_the_plan_minus_survivors(make_provider, run_id):
    provider = make_provider()
    alive = provider.launch(run_id, "p0", "g5.xlarge", 2).instances
    assert takeover_counts({"g5.xlarge": 3, "g5.2xlarge": 1, "g4dn.2xlarge": 0}, alive) == {"g5.2xlarge": 1, "g5.xlarge": 1}
    provider.cleanup(run_id)


def test_cleanup_command_terminates_the_run_and_explains_bad_input(make_provider, moto_endpoint, ec2, run_id, capsys, monkeypatch):
    from tasks.cli.main import main

    make_provider().launch(run_id, "p0", "g5.xlarge", 2)
    assert main(["cleanup", "--run-id", run_id, "--endpoint-url", moto_endpoint, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"provider": "aws", "run_id": run_id, "where": REGION, "terminated": 2}
    assert running(ec2, run_id) == []

    assert main(["cleanup", "--run-id", run_id, "--region", "mars-north-1"]) == 2
    err = capsys.readouterr().err
    assert "unknown region 'mars-north-1'" in err and err.count("\n") == 1
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert main(["cleanup", "--run-id", run_id, "--endpoint-url", moto_endpoint]) == 2
    assert capsys.readouterr().err.startswith("spotfill: error: no AWS credentials found")


def test_cleanup_of_an_unknown_run_id_is_exit_2_unless_missing_ok(make_provider, moto_endpoint, ec2, run_id, capsys):
    from tasks.cli.main import main

    base = ["cleanup", "--run-id", run_id, "--provider", "aws", "--endpoint-url", moto_endpoint]
    assert main(base) == 2  # nothing ever carried this tag: a typo
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"spotfill: error: no instance or security group tagged spotfill:run-id={run_id}")
    assert main([*base, "--missing-ok", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["terminated"] == 0

    make_provider().launch(run_id, "p0", "g5.xlarge", 1)
    assert main([*base, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["terminated"] == 1
    assert main([*base, "--json"]) == 0  # cleaned up already: EC2 still lists the terminated instance
    assert json.loads(capsys.readouterr().out)["terminated"] == 0


def test_a_configured_subnet_sets_the_vpc_the_zone_and_the_price(make_provider, ec2, run_id):
    vpc_id = ec2.create_vpc(CidrBlock="10.20.0.0/16")["Vpc"]["VpcId"]
    subnet_id = ec2.create_subnet(VpcId=vpc_id, CidrBlock="10.20.1.0/24", AvailabilityZone="us-east-1c")["Subnet"]["SubnetId"]
    provider = make_provider(subnet_id=subnet_id)
    assert provider.catalog().get("g5.xlarge").spot_usd_per_h == 0.3387  # use1-az2, moto's us-east-1c
    (worker,) = provider.launch(run_id, "p0", "g5.xlarge", 1).instances
    (described,) = running(ec2, run_id)
    assert (described["SubnetId"], described["VpcId"]) == (subnet_id, vpc_id)
    group_id = described["SecurityGroups"][0]["GroupId"]
    assert ec2.describe_security_groups(GroupIds=[group_id])["SecurityGroups"][0]["VpcId"] == vpc_id
    provider.cleanup(run_id)
    with pytest.raises(UserInputError, match="subnet subnet-0000dead not found"):
        make_provider(subnet_id="subnet-0000dead").list_types()
