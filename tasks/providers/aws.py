"""The `aws` provider: EC2 spot workers and an on-demand parameter server, driven through boto3.

Every instance carries the tags spotfill:run-id, spotfill:plan-id, spotfill:role, spotfill:type,
so a retried launch finds what the first attempt started (and a deterministic ClientToken covers
the case where EC2 got the call but the reply was lost), and cleanup finds all a run started.
Revocations are seen two ways: the on-instance watcher (imds_watcher) tags its own instance when
IMDS posts the 2-minute spot/instance-action notice or a rebalance recommendation, and each poll
reads those tags together with instance states and their reasons (Server.SpotInstanceTermination).
Credentials come only from boto3's default chain (or a named profile of it); nothing here reads,
logs or repeats a secret.
"""
from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import re
import shlex
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import boto3
import botocore.config
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, field_validator

from tasks.core.errors import UserInputError
from tasks.core.profile import format_validation_error
from tasks.providers import aws_catalog
from tasks.providers.aws_catalog import Catalog, TypeFacts
from tasks.providers.base import (
    Instance,
    InstanceType,
    LaunchResult,
    Market,
    Provider,
    ProviderEvent,
    QuotaError,
    Refusal,
    Role,
    Startup,
)
from tasks.providers.imds_watcher import TAG_NOTICE, TAG_REBALANCE

log = logging.getLogger(__name__)

TAG_RUN = "spotfill:run-id"
TAG_PLAN = "spotfill:plan-id"
TAG_ROLE = "spotfill:role"
TAG_TYPE = "spotfill:type"

ALIVE_STATES = ["pending", "running"]
BILLED_STATES = ["pending", "running", "stopping", "stopped"]  # what cleanup must terminate
SPOT_REVOCATION_CODES = ("Server.SpotInstanceTermination", "Server.SpotInstanceShutdown")
# EC2's ways of saying "the market has none for you now": returned as a Refusal, never raised.
CAPACITY_CODES = ("InsufficientInstanceCapacity", "InsufficientCapacity", "Unsupported")
PRICE_CODES = ("SpotMaxPriceTooLow",)
QUOTA_CODES = ("InstanceLimitExceeded", "MaxSpotInstanceCountExceeded", "VcpuLimitExceeded", "SpotInstanceLimitExceeded")
AUTH_CODES = ("AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch", "ExpiredToken")
_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
USER_DATA_MAX_BYTES = 16384


class AwsConfig(BaseModel):
    """Where and how to launch; no credentials here (boto3's default chain supplies them)."""

    # numbers strictly (strict=True, Strict*): `true` is no price of $1.00, nor "3" a count
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    region: str = "us-east-1"
    endpoint_url: str | None = None  # another EC2 endpoint (moto in tests); None: AWS's own
    profile_name: str | None = None  # a named profile of the default chain
    ami_ids: dict[str, str] = Field(default_factory=dict)  # architecture (x86_64, arm64) -> AMI
    subnet_id: str | None = None
    key_name: str | None = None
    ssh_cidr: str | None = None  # SSH admitted from here only; None: no SSH at all
    instance_profile: str | None = None  # lets the watcher tag its own instance
    metadata_url: str = "http://169.254.169.254"  # IMDS base URL the watcher polls
    watcher_poll_s: float = Field(default=5.0, gt=0, strict=True)
    max_instances: int = Field(default=16, ge=1, strict=True)  # guard: instances alive in the run at once
    max_usd_per_hour: float = Field(default=50.0, gt=0, strict=True)  # guard: the run's hourly spend
    quotas: dict[str, StrictInt] = Field(default_factory=dict)  # per type, when Service Quotas is silent
    on_demand_usd_per_h: dict[str, StrictFloat] = Field(default_factory=dict)  # adds to / overrides the table
    candidate_types: list[str] | None = None  # limit the catalog to these (None: every GPU type)
    spot_advisor_path: Path = aws_catalog.DEFAULT_SPOT_ADVISOR_PATH
    instance_catalog_path: Path = aws_catalog.DEFAULT_INSTANCE_CATALOG_PATH
    spot_price_archive: Path | None = None  # a price archive TSV instead of the live price API
    price_window_s: float = Field(default=7 * 86400.0, gt=0, strict=True)
    # the PS copies its checkpoints to s3://BUCKET/<run-id>/ and a restarted PS starts from them
    # (tasks/runtime/durable.py); None: they stay on the PS's disk only
    checkpoint_bucket: str | None = None

    @field_validator("region")
    @classmethod
    def _known_region(cls, region: str) -> str:
        known = known_ec2_regions()
        if region not in known:
            raise ValueError(f"unknown AWS region {region!r} (EC2 regions boto3 knows: {', '.join(sorted(known)[:6])}, ...)")
        return region

    @field_validator("ssh_cidr")
    @classmethod
    def _cidr(cls, cidr: str | None) -> str | None:
        if cidr is not None:
            ipaddress.ip_network(cidr, strict=True)
        return cidr


def known_ec2_regions() -> set[str]:
    session = boto3.session.Session()
    regions: set[str] = set()
    for partition in session.get_available_partitions():
        regions.update(session.get_available_regions("ec2", partition_name=partition))
    return regions


def load_aws_config(data: dict[str, Any]) -> AwsConfig:
    """AwsConfig from a dict; a bad field is one UserInputError line naming it."""
    from pydantic import ValidationError

    try:
        return AwsConfig.model_validate(data)
    except ValidationError as err:
        raise UserInputError(format_validation_error(err, "aws config")) from None


class ApiCallCounter:
    """Counts AWS API calls by operation (botocore's before-call event: one per call, retries of
    the same call not counted), so tests and docs can say what a launch or a poll costs."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, model: Any = None, **_: Any) -> None:
        with self._lock:
            self.calls[model.name] += 1

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.calls)


NO_CREDENTIALS = ("no AWS credentials found: boto3's default chain (environment, ~/.aws config and "
                  "credentials files, SSO, instance profile) gave none; configure one, e.g. AWS_PROFILE")


@contextlib.contextmanager
def aws_errors(region: str) -> Iterator[None]:
    """Turn credential and permission failures into one line for a person (no secret in it)."""
    try:
        yield
    except (NoCredentialsError, PartialCredentialsError):
        raise UserInputError(NO_CREDENTIALS) from None
    except EndpointConnectionError as err:
        raise UserInputError(f"cannot reach the AWS endpoint {err.kwargs.get('endpoint_url')} ({region}): check the network or endpoint_url") from None
    except ProfileNotFound as err:
        raise UserInputError(f"AWS profile {err.kwargs.get('profile')!r} not found in the shared config files") from None
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        if code in AUTH_CODES:
            op = err.operation_name
            raise UserInputError(f"AWS refused {op} in {region} ({code}): check the credentials and the IAM policy in docs/aws-iam-policy.json") from None
        raise


def refusal_kind(code: str) -> str | None:
    """The Refusal kind of an EC2 error code, or None for an error that is not the market's no."""
    for kind, codes in (("capacity", CAPACITY_CODES), ("price", PRICE_CODES), ("quota", QUOTA_CODES)):
        if code in codes:
            return kind
    return None


def check_id(kind: str, value: str) -> str:
    if not _ID_PATTERN.match(value):
        raise UserInputError(f"{kind} {value!r} must be 1-64 characters of letters, digits, '.', '_' or '-'")
    return value


def client_token(run_id: str, plan_id: str, instance_type: str, role: str, market: str, count: int, found: int) -> str:
    """The same step asking for the same remainder gets the same token (EC2 then answers with the
    first call's instances instead of starting more); a different remainder gets another."""
    key = f"{run_id}|{plan_id}|{instance_type}|{role}|{market}|{count}|{found}"
    return hashlib.sha256(key.encode()).hexdigest()[:64]


def user_data_script(startup: Startup, env: dict[str, str], watcher_argv: list[str] | None) -> str:
    """The boot script: the run's environment, the IMDS watcher in the background (spot only),
    then the worker or PS command in the foreground; when that command ends, for any reason (the
    PS stopped at its lease's end, a worker heard the stop or lost its PS), the instance shuts
    down, which its InstanceInitiatedShutdownBehavior turns into terminate: nothing of a run
    bills on once its processes are done. Never put a secret in Startup.env: user data is
    readable by anyone who can describe the instance."""
    lines = ["#!/bin/bash", "set -euo pipefail"]
    for key, value in {**env, **startup.env}.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise UserInputError(f"startup environment variable name {key!r} is not a valid name")
        lines.append(f"export {key}={shlex.quote(value)}")
    if watcher_argv:
        lines.append(f"nohup {shlex.join(watcher_argv)} >/var/log/spotfill-watcher.log 2>&1 &")
    lines.append("trap 'shutdown -h now' EXIT")  # also when the command fails (set -e)
    lines.append(shlex.join(startup.argv))
    script = "\n".join(lines) + "\n"
    if len(script.encode()) > USER_DATA_MAX_BYTES:
        raise UserInputError(f"startup command and environment take {len(script.encode())} bytes; EC2 user data holds {USER_DATA_MAX_BYTES}")
    return script


def _tags(described: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in described.get("Tags", [])}


def _is_step_instance(described: dict[str, Any], plan_id: str, role: str, instance_type: str) -> bool:
    tags = _tags(described)
    return tags.get(TAG_PLAN) == plan_id and tags.get(TAG_ROLE) == role and described["InstanceType"] == instance_type


def _instance(described: dict[str, Any]) -> Instance:
    tags = _tags(described)
    ec2_state = described["State"]["Name"]
    if ec2_state in ALIVE_STATES:
        state = "notice" if TAG_NOTICE in tags and ec2_state == "running" else ec2_state
    else:
        state = "terminated"
    return Instance(
        instance_id=described["InstanceId"],
        type=described["InstanceType"],
        role=tags.get(TAG_ROLE, "worker"),  # type: ignore[arg-type]
        market="spot" if described.get("InstanceLifecycle") == "spot" else "on-demand",
        state=state,  # type: ignore[arg-type]
        run_id=tags.get(TAG_RUN, ""),
        plan_id=tags.get(TAG_PLAN, ""),
        address=described.get("PrivateIpAddress"),
        launched_at_s=described["LaunchTime"].timestamp() if "LaunchTime" in described else 0.0,
    )


class AwsProvider(Provider):
    name = "aws"

    def __init__(self, config: AwsConfig, session: boto3.session.Session | None = None):
        self.config = config
        with aws_errors(config.region):
            self.session = session or boto3.session.Session(profile_name=config.profile_name, region_name=config.region)
        self.api_calls = ApiCallCounter()
        client_config = botocore.config.Config(
            connect_timeout=5, read_timeout=30, retries={"max_attempts": 4, "mode": "standard"}
        )
        self.ec2 = self.session.client("ec2", region_name=config.region, endpoint_url=config.endpoint_url, config=client_config)
        self.service_quotas = self.session.client(
            "service-quotas", region_name=config.region, endpoint_url=config.endpoint_url, config=client_config
        )
        for client in (self.ec2, self.service_quotas):  # per client: a shared session stays unaffected
            client.meta.events.register("before-call.*.*", self.api_calls)
        self._catalog: Catalog | None = None
        self._extra_facts: dict[str, TypeFacts] = {}
        self._on_demand: dict[str, float] | None = None
        self._vcpu_quotas: dict[str, dict[str, float]] = {}
        self._security_groups: dict[str, str] = {}
        self._reported: set[tuple[str, str]] = set()

    # ---- catalog -------------------------------------------------------------------------
    def refresh_catalog(self) -> Catalog:
        """DescribeInstanceTypeOfferings + DescribeInstanceTypes + spot prices, joined with the
        on-demand table and the Spot Advisor bands."""
        cfg = self.config
        now = aws_catalog.now_utc()
        with aws_errors(cfg.region):
            names = aws_catalog.offered_types(self.ec2, cfg.candidate_types)
            if cfg.candidate_types:
                missing = sorted(set(cfg.candidate_types) - set(names))
                if missing:
                    raise UserInputError(f"instance type(s) not offered in {cfg.region}: {', '.join(missing)}")
            facts = aws_catalog.describe_types(self.ec2, names)
            gpu_names = sorted(n for n, f in facts.items() if f.gpus > 0)
            if cfg.spot_price_archive is not None:
                records = aws_catalog.read_price_archive(cfg.spot_price_archive, aws_catalog.zone_names_by_id(self.ec2))
            else:
                records = aws_catalog.fetch_price_history(self.ec2, gpu_names, cfg.price_window_s, now) if gpu_names else []
            zone = self._subnet_zone()
        bands = aws_catalog.load_interruption_bands(cfg.spot_advisor_path, cfg.region)
        self._catalog = aws_catalog.build_catalog(cfg.region, facts, records, self._on_demand_prices(), bands, now, zone)
        return self._catalog

    def _on_demand_prices(self) -> dict[str, float]:
        """The instance catalog's on-demand prices, with the config's added or overriding."""
        if self._on_demand is None:
            self._on_demand = {
                **aws_catalog.load_on_demand_prices(self.config.instance_catalog_path, self.config.region),
                **self.config.on_demand_usd_per_h,
            }
        return self._on_demand

    def catalog(self) -> Catalog:
        return self._catalog or self.refresh_catalog()

    def list_types(self) -> list[InstanceType]:
        """The catalog as first read (one refresh per provider, however many stages ask):
        `refresh_catalog()` reads current prices again."""
        return self.catalog().types

    def _subnet_zone(self) -> str | None:
        if self.config.subnet_id is None:
            return None
        return self._subnet()["AvailabilityZone"]

    def _subnet(self) -> dict[str, Any]:
        try:
            return self.ec2.describe_subnets(SubnetIds=[self.config.subnet_id])["Subnets"][0]
        except ClientError as err:
            if err.response["Error"]["Code"].startswith("InvalidSubnet"):
                raise UserInputError(f"subnet {self.config.subnet_id} not found in {self.config.region}") from None
            raise

    def _facts(self, instance_type: str) -> TypeFacts:
        """Hardware of a type: from the catalog, or looked up once (a CPU type for the PS)."""
        known = self.catalog().facts.get(instance_type) or self._extra_facts.get(instance_type)
        if known is not None:
            return known
        if instance_type not in aws_catalog.offered_types(self.ec2, [instance_type]):
            raise UserInputError(f"unknown instance type {instance_type!r}: EC2 does not offer it in {self.config.region}")
        self._extra_facts.update(aws_catalog.describe_types(self.ec2, [instance_type]))
        return self._extra_facts[instance_type]

    def price_usd_per_h(self, instance_type: str, market: Market) -> float:
        """The catalog's price; for a type outside it (a CPU PS), the on-demand price, which is
        also what a spot instance may cost at most."""
        offer = self.catalog().get(instance_type)
        if offer is not None:
            return offer.spot_usd_per_h if market == "spot" else offer.on_demand_usd_per_h
        if instance_type in self._on_demand_prices():
            return self._on_demand_prices()[instance_type]
        raise UserInputError(
            f"no {market} price known for {instance_type} in {self.config.region}: add it to on_demand_usd_per_h in the AWS config"
        )

    # ---- launch --------------------------------------------------------------------------
    def launch(
        self,
        run_id: str,
        plan_id: str,
        instance_type: str,
        count: int,
        *,
        role: Role = "worker",
        market: Market = "spot",
        startup: Startup | None = None,
    ) -> LaunchResult:
        check_id("run id", run_id)
        check_id("plan id", plan_id)
        if count < 1:
            raise UserInputError(f"launch count must be at least 1, got {count}")
        cfg = self.config
        with aws_errors(cfg.region):
            facts = self._facts(instance_type)
            alive = self._described(run_id, ALIVE_STATES)
            mine = [d for d in alive if _is_step_instance(d, plan_id, role, instance_type)]
            if len(mine) >= count:
                return LaunchResult([_instance(d) for d in mine])
            need = count - len(mine)
            self._check_guard(alive, {instance_type: need}, market)
            params = self._run_params(run_id, plan_id, facts, role, market, startup, need, len(mine), count)
            try:
                reply = self.ec2.run_instances(**params)
            except ClientError as err:
                kind = refusal_kind(err.response["Error"]["Code"])
                if kind is None:
                    raise
                message = f"EC2 refused {need} x {instance_type} in {cfg.region} now ({err.response['Error']['Code']})"
                log.info("%s for run %s plan %s", message, run_id, plan_id)
                return LaunchResult([_instance(d) for d in mine], {instance_type: Refusal(instance_type, kind, need, message)})
        started = [_instance(d) for d in reply["Instances"]]
        log.info("launched %d x %s (%s, %s) for run %s plan %s", len(started), instance_type, role, market, run_id, plan_id)
        return LaunchResult([_instance(d) for d in mine] + started)

    def _run_params(
        self, run_id: str, plan_id: str, facts: TypeFacts, role: Role, market: Market,
        startup: Startup | None, need: int, found: int, count: int,
    ) -> dict[str, Any]:
        cfg = self.config
        arch = next((a for a in facts.architectures if a in cfg.ami_ids), None)
        if arch is None:
            raise UserInputError(
                f"no AMI configured for {facts.name} ({'/'.join(facts.architectures) or 'unknown'}): set ami_ids in the AWS config"
            )
        tags = [
            {"Key": TAG_RUN, "Value": run_id},
            {"Key": TAG_PLAN, "Value": plan_id},
            {"Key": TAG_ROLE, "Value": role},
            {"Key": TAG_TYPE, "Value": facts.name},
            {"Key": "Name", "Value": f"spotfill-{run_id}-{role}"},
        ]
        params: dict[str, Any] = {
            "ImageId": cfg.ami_ids[arch],
            "InstanceType": facts.name,
            "MinCount": need,  # all or nothing: a partial type is re-planned, not half-launched
            "MaxCount": need,
            "ClientToken": client_token(run_id, plan_id, facts.name, role, market, count, found),
            "SecurityGroupIds": [self._security_group(run_id)],
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1},
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tags}, {"ResourceType": "volume", "Tags": tags}],
            "InstanceInitiatedShutdownBehavior": "terminate",
        }
        if cfg.subnet_id:
            params["SubnetId"] = cfg.subnet_id
        elif market == "spot" and facts.name in self.catalog().cheapest_zone:
            params["Placement"] = {"AvailabilityZone": self.catalog().cheapest_zone[facts.name]}
        if market == "spot":
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        if cfg.key_name:
            params["KeyName"] = cfg.key_name
        if cfg.instance_profile:
            params["IamInstanceProfile"] = {"Name": cfg.instance_profile}
        if startup is not None:
            env = {"SPOTFILL_RUN_ID": run_id, "SPOTFILL_PLAN_ID": plan_id, "SPOTFILL_ROLE": role, "AWS_DEFAULT_REGION": cfg.region,
                   "SPOTFILL_PS_BIND": "0.0.0.0"}  # workers are other instances; the security group admits only the run's
            params["UserData"] = user_data_script(startup, env, self.watcher_argv() if market == "spot" else None)
        return params

    def watcher_argv(self) -> list[str]:
        """How an instance starts its IMDS watcher (the AMI has spotfill installed)."""
        argv = [
            "python3", "-m", "tasks.providers.imds_watcher",
            "--region", self.config.region,
            "--metadata-url", self.config.metadata_url,
            "--poll-s", str(self.config.watcher_poll_s),
        ]
        if self.config.endpoint_url:
            argv += ["--endpoint-url", self.config.endpoint_url]
        return argv

    def check_step(self, run_id: str, plan_id: str, counts: dict[str, int], *, role: Role = "worker", market: Market = "spot") -> None:
        """Refuse a whole plan step before any of it starts (the step's instances already
        running are not counted twice)."""
        check_id("run id", run_id)
        with aws_errors(self.config.region):
            alive = self._described(run_id, ALIVE_STATES)
            new = {}
            for instance_type, count in counts.items():
                found = sum(1 for d in alive if _is_step_instance(d, plan_id, role, instance_type))
                if count > found:
                    new[instance_type] = count - found
            self._check_guard(alive, new, market)

    def _check_guard(self, alive: list[dict[str, Any]], new: dict[str, int], market: Market) -> None:
        """Refuse, before anything starts, new instances the run's guard or the account's quota
        does not admit."""
        cfg = self.config
        facts = {name: self._facts(name) for name in new}
        total = len(alive) + sum(new.values())
        if total > cfg.max_instances:
            raise QuotaError(f"guard: the run would have {total} instances alive; max_instances is {cfg.max_instances}")
        usd = sum(
            self.price_usd_per_h(d["InstanceType"], "spot" if d.get("InstanceLifecycle") == "spot" else "on-demand")
            for d in alive
        ) + sum(n * self.price_usd_per_h(name, market) for name, n in new.items())
        if usd > cfg.max_usd_per_hour:
            raise QuotaError(f"guard: the run would cost {usd:.2f} USD/h; max_usd_per_hour is {cfg.max_usd_per_hour:.2f}")
        for name, n in new.items():
            asked = n + sum(1 for d in alive if d["InstanceType"] == name)
            if name in cfg.quotas and asked > cfg.quotas[name]:
                raise QuotaError(f"quota: {asked} x {name} asked, the configured quota is {cfg.quotas[name]}")
        same_market = [d for d in alive if (d.get("InstanceLifecycle") == "spot") == (market == "spot")]
        for group in sorted({aws_catalog.quota_group(name) for name in new}):
            limit = self.vcpu_quotas(market).get(group)
            if limit is None:
                continue
            asked = sum(n * facts[name].vcpus for name, n in new.items() if aws_catalog.quota_group(name) == group)
            asked += sum(self._facts(d["InstanceType"]).vcpus for d in same_market if aws_catalog.quota_group(d["InstanceType"]) == group)
            if asked > limit:
                raise QuotaError(
                    f"quota: {asked} vCPUs of {market} {group.upper()}-family instances asked; "
                    f"the account's Service Quotas limit is {limit:g}"
                )

    def vcpu_quotas(self, market: Market) -> dict[str, float]:
        if market not in self._vcpu_quotas:
            with aws_errors(self.config.region):
                self._vcpu_quotas[market] = aws_catalog.fetch_vcpu_quotas(self.service_quotas, market)
        return self._vcpu_quotas[market]

    def type_quotas(self, types: list[str], market: Market = "spot") -> dict[str, int]:
        """Per-type instance counts for the planner: the configured quota, capped by the
        family's vCPU quota (shared by the family's types, so each is an upper bound)."""
        result = {}
        for name in types:
            limits = [self.config.quotas[name]] if name in self.config.quotas else []
            vcpu_limit = self.vcpu_quotas(market).get(aws_catalog.quota_group(name))
            if vcpu_limit is not None:
                limits.append(int(vcpu_limit // self._facts(name).vcpus))
            result[name] = min(limits) if limits else self.config.max_instances
        return result

    def _security_group(self, run_id: str) -> str:
        """The run's own group: all traffic between the run's instances, SSH from ssh_cidr only."""
        if run_id in self._security_groups:
            return self._security_groups[run_id]
        if self.config.subnet_id:
            vpc_id = self._subnet()["VpcId"]
        else:
            vpcs = self.ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
            if not vpcs:
                raise UserInputError(f"no default VPC in {self.config.region}: set subnet_id in the AWS config")
            vpc_id = vpcs[0]["VpcId"]
        name = f"spotfill-{run_id}"
        found = self.ec2.describe_security_groups(
            Filters=[{"Name": "group-name", "Values": [name]}, {"Name": "vpc-id", "Values": [vpc_id]}]
        )["SecurityGroups"]
        if found:
            group_id = found[0]["GroupId"]
        else:
            group_id = self.ec2.create_security_group(
                GroupName=name,
                Description=f"spotfill run {run_id}: its own instances only",
                VpcId=vpc_id,
                TagSpecifications=[{"ResourceType": "security-group", "Tags": [{"Key": TAG_RUN, "Value": run_id}]}],
            )["GroupId"]
            permissions: list[dict[str, Any]] = [{"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id}]}]
            if self.config.ssh_cidr:
                permissions.append(
                    {"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": self.config.ssh_cidr}]}
                )
            self.ec2.authorize_security_group_ingress(GroupId=group_id, IpPermissions=permissions)
        self._security_groups[run_id] = group_id
        return group_id

    # ---- describe, terminate, events -----------------------------------------------------
    def _described(self, run_id: str, states: list[str] | None) -> list[dict[str, Any]]:
        filters = [{"Name": f"tag:{TAG_RUN}", "Values": [run_id]}]
        if states:
            filters.append({"Name": "instance-state-name", "Values": states})
        found = []
        for page in self.ec2.get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page["Reservations"]:
                found.extend(reservation["Instances"])
        return found

    def describe(self, run_id: str) -> list[Instance]:
        with aws_errors(self.config.region):
            return [_instance(d) for d in self._described(run_id, ALIVE_STATES)]

    def terminate(self, instance_ids: list[str]) -> None:
        if not instance_ids:
            return
        with aws_errors(self.config.region):
            try:
                self.ec2.terminate_instances(InstanceIds=list(instance_ids))
            except ClientError as err:
                if err.response["Error"]["Code"] != "InvalidInstanceID.NotFound":
                    raise
                for instance_id in instance_ids:  # one was already gone: the others one by one
                    with contextlib.suppress(ClientError):
                        self.ec2.terminate_instances(InstanceIds=[instance_id])

    def poll_events(self, run_id: str) -> list[ProviderEvent]:
        """One DescribeInstances (states, state reasons, the watcher's notice tags) and, when
        instances are running, one DescribeInstanceStatus (scheduled events)."""
        with aws_errors(self.config.region):
            described = self._described(run_id, None)
            running = [d["InstanceId"] for d in described if d["State"]["Name"] == "running"]
            statuses = []
            if running:
                statuses = self.ec2.describe_instance_status(InstanceIds=running)["InstanceStatuses"]
        now_s = aws_catalog.now_utc().timestamp()
        events = []
        for d in described:
            events.extend(_instance_events(d, now_s))
        for status in statuses:
            for scheduled in status.get("Events", []):
                if scheduled.get("Code", "").startswith(("instance-retirement", "instance-stop", "system-maintenance")):
                    deadline = scheduled.get("NotBefore")
                    events.append(ProviderEvent("rebalance", status["InstanceId"], now_s, deadline.timestamp() if deadline else None))
        fresh = [e for e in events if (e.instance_id, e.kind) not in self._reported]
        self._reported.update((e.instance_id, e.kind) for e in fresh)
        return fresh

    # ---- cleanup -------------------------------------------------------------------------
    def knows_run(self, run_id: str) -> bool:
        """Whether any instance (in any state EC2 still lists) or security group carries the run's
        tag: `spotfill cleanup` of an id nothing carries is a typo, not a clean-up."""
        check_id("run id", run_id)
        with aws_errors(self.config.region):
            if self._described(run_id, None):
                return True
            tagged = [{"Name": f"tag:{TAG_RUN}", "Values": [run_id]}]
            return bool(self.ec2.describe_security_groups(Filters=tagged)["SecurityGroups"])

    def cleanup(self, run_id: str, wait: bool = False) -> int:
        """Terminate every instance tagged with the run (stopped ones too), then delete the run's
        security group once nothing uses it (`wait` waits for the terminations to finish)."""
        check_id("run id", run_id)
        with aws_errors(self.config.region):
            ids = [d["InstanceId"] for d in self._described(run_id, BILLED_STATES)]
            self.terminate(ids)
            if ids and wait:
                self.ec2.get_waiter("instance_terminated").wait(InstanceIds=ids, WaiterConfig={"Delay": 5, "MaxAttempts": 60})
            groups = self.ec2.describe_security_groups(Filters=[{"Name": f"tag:{TAG_RUN}", "Values": [run_id]}])["SecurityGroups"]
            for group in groups:
                try:
                    self.ec2.delete_security_group(GroupId=group["GroupId"])
                except ClientError as err:
                    if err.response["Error"]["Code"] != "DependencyViolation":
                        raise
                    log.info("security group %s still in use; run cleanup again once the instances are gone", group["GroupId"])
        self._security_groups.pop(run_id, None)
        return len(ids)


def _instance_events(described: dict[str, Any], now_s: float) -> list[ProviderEvent]:
    instance_id = described["InstanceId"]
    tags = _tags(described)
    events = []
    if TAG_NOTICE in tags:
        notice = json.loads(tags[TAG_NOTICE])
        events.append(ProviderEvent("revocation_notice", instance_id, float(notice["seen_s"]), float(notice["time_s"])))
    if TAG_REBALANCE in tags:
        rebalance = json.loads(tags[TAG_REBALANCE])
        events.append(ProviderEvent("rebalance", instance_id, float(rebalance["seen_s"])))
    reason = (described.get("StateReason") or {}).get("Code", "")
    if described["State"]["Name"] not in ALIVE_STATES and reason in SPOT_REVOCATION_CODES:
        events.append(ProviderEvent("revoked", instance_id, now_s))
    return events

