"""The provider interface: what the flows may ask of a cloud, whichever cloud it is.

Every call is idempotent and tagged with the run id (and, for launches, the plan id), so a retried
step finds what it already started instead of starting more, and cleanup can find everything a run
ever started. Modelled on SkyPilot's managed jobs: the recovery logic lives in the flows, the
provider only does one cloud call's worth of work per method.

When the cloud says no, one taxonomy, whichever provider:
- the market refuses (no spot capacity now, the account's instance quota, a price over the cap):
  `launch` returns what it did start and a `Refusal` per type in its `LaunchResult`; never raised,
  because a shortfall is an input to the planner (lower that type's quota, re-plan with what runs);
- the run's own guard (max instances, max spend per hour, configured or vCPU quotas read before
  the call) refuses a whole step before anything starts: `QuotaError`, raised;
- bad input: `tasks.core.errors.UserInputError`; anything else is a failure and the step is rolled back.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tasks.core.catalog import CATALOG, load_catalog
from tasks.core.errors import UserInputError

Role = Literal["ps", "worker"]
Market = Literal["spot", "on-demand"]
InstanceState = Literal["pending", "running", "notice", "terminated"]
EventKind = Literal["revocation_notice", "revoked", "rebalance"]
RefusalKind = Literal["capacity", "quota", "price"]


@dataclass(frozen=True)
class InstanceType:
    """One offer of the cloud: what an instance of this type has and costs."""

    name: str
    gpus: int
    gpu_model: str
    gpu_memory_gb: float
    network_mbytes_per_s: float  # NIC baseline bandwidth, megabytes per second (AWS publishes Gbit/s)
    on_demand_usd_per_h: float
    spot_usd_per_h: float
    interruption_band: int | None = None  # Spot Advisor band 0..4 (<5% .. >20% a month)


@dataclass(frozen=True)
class Startup:
    """What an instance runs once it is up: the same argv and environment on every provider."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    # outlives the process that launched it (its run's lease ends it, tasks/runtime/lease.py):
    # the local provider then gives it no SPOTFILL_WATCH_PID; cloud instances are detached anyway
    detached: bool = False


@dataclass
class Instance:
    instance_id: str
    type: str
    role: Role
    market: Market
    state: InstanceState
    run_id: str
    plan_id: str
    address: str | None = None  # host or host:port the run's other instances can reach
    launched_at_s: float = 0.0  # provider clock (epoch seconds)


@dataclass(frozen=True)
class ProviderEvent:
    kind: EventKind
    instance_id: str
    at_s: float  # when the provider says it happened (epoch seconds)
    deadline_s: float | None = None  # for notices: when the instance will be taken


@dataclass(frozen=True)
class Refusal:
    """The market's "no" to part of a launch: how many of a type did not start, and why."""

    instance_type: str
    kind: RefusalKind  # capacity: none free now; quota: the account's limit; price: over the max price
    missing: int  # instances asked for and not started
    message: str  # the cloud's reason, for the report


@dataclass
class LaunchResult:
    """What a launch (one type, or a whole plan step) got, and what the market refused, by type."""

    instances: list[Instance]
    refused: dict[str, Refusal] = field(default_factory=dict)

    def merge(self, other: "LaunchResult") -> None:
        self.instances.extend(other.instances)
        self.refused.update(other.refused)


class QuotaError(RuntimeError):
    """The run's guard, or a quota known before the call, does not admit the step; nothing was
    started. (A quota the cloud reports while launching is a `Refusal` instead.)"""


class Provider(abc.ABC):
    name: str

    @abc.abstractmethod
    def list_types(self) -> list[InstanceType]:
        """The instance types this provider offers, with their prices (on AWS, as of the provider's
        catalog read: listing again costs no API call)."""

    @abc.abstractmethod
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
        """Start `count` instances for this (run, plan step, type, role); idempotent: a retry
        returns the instances the first call started rather than starting more. What the market
        refuses is in the result's `refused`, never raised."""

    @abc.abstractmethod
    def terminate(self, instance_ids: list[str]) -> None:
        """Terminate these instances; terminating one already gone is not an error."""

    @abc.abstractmethod
    def describe(self, run_id: str) -> list[Instance]:
        """Every instance of the run that is not yet terminated."""

    @abc.abstractmethod
    def poll_events(self, run_id: str) -> list[ProviderEvent]:
        """Revocation notices, revocations and rebalance hints since the last poll."""

    def check_step(
        self, run_id: str, plan_id: str, counts: dict[str, int], *, role: Role = "worker", market: Market = "spot"
    ) -> None:
        """Raise QuotaError if starting counts[type] instances for this plan step would break a
        quota or the run's guard, before any of it starts. Default: no up-front check (launch
        still checks each type)."""

    def cleanup(self, run_id: str) -> int:
        """Terminate everything the run started; returns how many were still alive."""
        alive = [i.instance_id for i in self.describe(run_id) if i.state != "terminated"]
        if alive:
            self.terminate(alive)
        return len(alive)


def catalog_instance_types(region: str = "us-east-1", path: Path = CATALOG):
    """The catalog's types priced in one region, as provider InstanceType records (types with no
    GPU, no price or no known bandwidth in that region are left out)."""
    catalog = load_catalog(path)
    out = []
    for t in catalog["types"]:
        r = t["regions"].get(region)
        if not r or not t["gpus"] or not r["on_demand_usd_per_h"] or not t["network_mbps"]:
            continue
        spot = r["spot_avg_usd_per_h"] or r["on_demand_usd_per_h"]
        out.append(InstanceType(t["type"], t["gpus"], t["gpu_model"] or "", float(t["gpu_memory_gb"] or 0),
                                t["network_mbps"], r["on_demand_usd_per_h"], spot, r["interruption_band"]))
    if not out:
        raise UserInputError(f"no priced GPU type in region {region!r} in the catalog")
    return out
