"""Planning over offers (type, region): tasks/planner/offers.py and `spotfill plan --regions`."""
import json

import pytest

from tasks.core.errors import UserInputError
from tasks.core.profile import load_profile
from tasks.planner import PlanRequest, solve
from tasks.planner.offers import az_prefix, market_profile
from tests.helpers import SHIPPED_PROFILE, spotfill

PROFILE = str(SHIPPED_PROFILE)


@pytest.fixture(scope="module")
def shipped():
    return load_profile(SHIPPED_PROFILE)


def test_region_codes_of_the_price_archive():
    assert [az_prefix(r) for r in ("us-east-1", "ap-northeast-2", "ap-south-1", "eu-central-1", "sa-east-1")] == \
        ["use1", "apne2", "aps1", "euc1", "sae1"]
    assert az_prefix("us-east-1-atl-1") is None


def test_offers_name_type_and_region_and_estimate_same_gpu_types(shipped):
    market, offers = market_profile(shipped, ("us-east-1",), {})
    assert "p3.2xlarge@us-east-1" in offers and offers["p3.2xlarge@us-east-1"].estimated_from is None
    # p3.8xlarge has 4 V100s: each computes like the measured p3.2xlarge's one
    big = market.instance("p3.8xlarge@us-east-1")
    ref = shipped.instance("p3.2xlarge")
    assert offers[big.type].estimated_from == "p3.2xlarge"
    assert (big.gpus, big.batch_per_gpu, big.compute_time_s, big.quota) == (4, ref.batch_per_gpu, ref.compute_time_s, ref.quota)
    # retired g3 types are priced from the region's zones in the price history
    assert offers["g3.8xlarge@us-east-1"].price_source == "history"


def test_quota_by_type_applies_in_every_region_and_by_offer_in_one(shipped):
    market, _ = market_profile(shipped, ("us-east-1", "us-east-2"), {"p3.2xlarge": 7, "p3.2xlarge@us-east-2": 1,
                                                                  "g3.16xlarge": 0})
    assert market.instance("p3.2xlarge@us-east-1").quota == 7
    assert market.instance("p3.2xlarge@us-east-2").quota == 1


@pytest.mark.parametrize("deadline", [1800, 2600, 4000])
def test_all_regions_never_cost_more_than_one(shipped, deadline):
    everywhere = solve(PlanRequest(shipped, 0.8, deadline, regions=("all",)))
    for region in ("us-east-1", "ap-northeast-1"):
        one = solve(PlanRequest(shipped, 0.8, deadline, regions=(region,)))
        assert everywhere.predicted_cost_usd <= one.predicted_cost_usd * (1 + 1e-9)
    assert all(offer["region"] == name.split("@")[1] for name, offer in everywhere.offers.items())


def test_existing_instances_name_offers(shipped):
    r = solve(PlanRequest(shipped, 0.8, 2600, regions=("us-east-1",), existing={"g3.8xlarge@us-east-1": 2}))
    assert r.plan["g3.8xlarge@us-east-1"] >= 2
    with pytest.raises(UserInputError, match="unknown instance type 'g3.8xlarge'"):
        solve(PlanRequest(shipped, 0.8, 2600, regions=("us-east-1",), existing={"g3.8xlarge": 2}))


@pytest.mark.integration
def test_plan_regions_all_cli_never_costs_more_than_single_region():
    args = ["plan", PROFILE, "--loss", "0.8", "--deadline", "2600", "--json", "--regions"]
    everywhere, one = spotfill(*args, "all"), spotfill(*args, "us-east-1")
    assert everywhere.returncode == 0 and one.returncode == 0, everywhere.stderr + one.stderr
    a, b = json.loads(everywhere.stdout), json.loads(one.stdout)
    assert a["predicted_cost_usd"] <= b["predicted_cost_usd"] * (1 + 1e-9)
    assert set(a["offers"]) == set(a["plan"]) and all("@" in name for name in a["plan"])
    assert {"estimated", "region", "spot_usd_per_h"} <= set(next(iter(a["offers"].values())))


@pytest.mark.integration
@pytest.mark.parametrize("regions, message", [
    ("mars-north-1", "unknown region 'mars-north-1'"),
    ("us-west-2", "no spot price for p2.8xlarge in us-west-2"),
    ("us-east-1,us-east-1", "named twice"),
    (",", "names no region"),
])
def test_bad_regions_exit_2_with_one_line(regions, message):
    r = spotfill("plan", PROFILE, "--loss", "0.8", "--deadline", "2600", "--regions", regions)
    assert r.returncode == 2
    assert message in r.stderr and r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
