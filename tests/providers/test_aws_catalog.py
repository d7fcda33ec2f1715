"""The AWS catalog's plain functions: price statistics, type facts, reference tables, and the
provider's pure helpers (config validation, client token, user data)."""
from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest

from tasks.core.catalog import network_mbps
from tasks.core.errors import UserInputError
from tasks.providers import aws_catalog
from tasks.providers.aws import AwsConfig, client_token, load_aws_config, user_data_script
from tasks.providers.aws_catalog import PriceRecord, price_stats
from tasks.providers.base import Startup
from tests.helpers import PRICE_ARCHIVE

T0 = datetime(2022, 5, 31, tzinfo=timezone.utc)


def test_price_stats_weigh_each_price_by_how_long_it_held():
    records = [
        PriceRecord("g5.xlarge", "us-east-1a", 0.30, T0),
        PriceRecord("g5.xlarge", "us-east-1a", 0.60, T0 + timedelta(hours=3)),
    ]
    (stats,) = price_stats(records, window_end=T0 + timedelta(hours=4))
    assert stats.current_usd_per_h == 0.60
    assert stats.mean_usd_per_h == pytest.approx((3 * 0.30 + 1 * 0.60) / 4)
    # mean 0.375: 0.30 sits 0.075 below it for 3 h, 0.60 sits 0.225 above it for 1 h
    assert stats.std_usd_per_h == pytest.approx(math.sqrt((3 * 0.075**2 + 1 * 0.225**2) / 4))
    assert (stats.min_usd_per_h, stats.max_usd_per_h, stats.changes) == (0.30, 0.60, 2)


def test_price_stats_keep_types_and_zones_apart():
    records = [
        PriceRecord("g5.xlarge", "us-east-1b", 0.40, T0),
        PriceRecord("g5.xlarge", "us-east-1a", 0.30, T0),
        PriceRecord("g4dn.xlarge", "us-east-1a", 0.20, T0),
    ]
    stats = price_stats(records, window_end=T0)
    assert [(s.instance_type, s.zone, s.current_usd_per_h, s.std_usd_per_h) for s in stats] == [
        ("g4dn.xlarge", "us-east-1a", 0.20, 0.0),
        ("g5.xlarge", "us-east-1a", 0.30, 0.0),
        ("g5.xlarge", "us-east-1b", 0.40, 0.0),
    ]


def test_price_archive_rows_map_az_ids_to_this_accounts_zone_names():
    # The archive's us-east-1 rows for g5.xlarge: use1-az4 0.3477, use1-az2 0.3387, use1-az5 0.3382,
    # use1-az6 0.3701; an account that maps use1-az5 to us-east-1f sees the 0.3382 there.
    names = {"use1-az4": "us-east-1d", "use1-az2": "us-east-1c", "use1-az5": "us-east-1f", "use1-az6": "us-east-1a"}
    records = aws_catalog.read_price_archive(PRICE_ARCHIVE, names)
    g5 = {r.zone: r.price_usd_per_h for r in records if r.instance_type == "g5.xlarge"}
    assert g5 == {"us-east-1d": 0.3477, "us-east-1c": 0.3387, "us-east-1f": 0.3382, "us-east-1a": 0.3701}
    assert {r.zone for r in records} <= set(names.values())


@pytest.mark.parametrize("price, message", [
    ("1_000", "not a number: '1_000'"),  # not $1000
    ("\u0661\u0662", "not a number"),  # not $12
    ("true", "not a number: 'true'"),  # not $1.00
    ("1e999", "must be a positive number"),
])
def test_a_price_archive_price_is_read_strictly_naming_file_and_line(tmp_path, price, message):
    archive = tmp_path / "prices.tsv"
    archive.write_text(f"# comment\nuse1-az4\tg5.xlarge\tLinux/UNIX\t{price}\t2022-05-31T00:00:00+00:00\n")
    with pytest.raises(UserInputError, match=f"prices.tsv:2: price {message}"):
        aws_catalog.read_price_archive(archive, {"use1-az4": "us-east-1d"})


@pytest.mark.parametrize("band", ["true", "2.7", "\"1\"", "9"])
def test_an_interruption_band_is_a_whole_number_0_to_4(tmp_path, band):
    feed = tmp_path / "advisor.json"
    feed.write_text('{"spot_advisor": {"us-east-1": {"Linux": {"g5.xlarge": {"r": %s}}}}}' % band)
    with pytest.raises(UserInputError, match="g5.xlarge in us-east-1 has interruption band .*, not one of 0..4"):
        aws_catalog.load_interruption_bands(feed, "us-east-1")


def test_type_facts_from_a_describe_instance_types_entry():
    described = {
        "InstanceType": "g5.12xlarge",
        "VCpuInfo": {"DefaultVCpus": 48},
        "ProcessorInfo": {"SupportedArchitectures": ["x86_64"]},
        "GpuInfo": {"Gpus": [{"Count": 4, "Manufacturer": "NVIDIA", "Name": "A10G"}], "TotalGpuMemoryInMiB": 98304},
        "NetworkInfo": {"NetworkPerformance": "40 Gigabit", "NetworkCards": [{"BaselineBandwidthInGbps": 40.0}]},
    }
    facts = aws_catalog.type_facts(described)
    assert (facts.gpus, facts.gpu_model, facts.gpu_memory_gb, facts.vcpus) == (4, "NVIDIA A10G", 96.0, 48)
    assert facts.network_mbytes_per_s == 5000.0  # 40 Gbit/s in MB/s
    cpu = aws_catalog.type_facts({**described, "GpuInfo": None, "NetworkInfo": {"NetworkPerformance": "Up to 10 Gigabit"}})
    assert (cpu.gpus, cpu.gpu_model, cpu.network_mbytes_per_s) == (0, "none", 1250.0)


@pytest.mark.parametrize("label, mbytes_per_s", [("4x 100 Gigabit", 50000.0), ("Up to 25 Gigabit", 3125.0), ("High", 0.0)])
def test_a_label_without_card_baselines_is_read_as_the_catalog_reads_it(label, mbytes_per_s):
    """Four 100 Gbit/s links are 400 Gbit/s, as in the shipped catalog (tasks.core.catalog)."""
    described = {"InstanceType": "p4d.24xlarge", "VCpuInfo": {"DefaultVCpus": 96},
                 "NetworkInfo": {"NetworkPerformance": label, "NetworkCards": [{"NetworkCardIndex": 0}]}}
    assert aws_catalog.type_facts(described).network_mbytes_per_s == mbytes_per_s == (network_mbps(label) or 0.0)


def test_the_projects_reference_data_covers_the_gpu_types():
    bands = aws_catalog.load_interruption_bands(aws_catalog.DEFAULT_SPOT_ADVISOR_PATH, "us-east-1")
    on_demand = aws_catalog.load_on_demand_prices(aws_catalog.DEFAULT_INSTANCE_CATALOG_PATH, "us-east-1")
    assert set(bands.values()) <= {0, 1, 2, 3, 4}
    assert on_demand["g4dn.xlarge"] == 0.526  # ec2instances.info, us-east-1 Linux
    assert {"g4dn.xlarge", "g5.xlarge", "p3.2xlarge"} <= set(on_demand) & set(bands)


def test_quota_groups_follow_the_service_quotas_families():
    assert [aws_catalog.quota_group(t) for t in ("g5.xlarge", "vt1.3xlarge", "p3.2xlarge", "c5.xlarge")] == ["g", "g", "p", "standard"]


def test_config_rejects_unknown_region_bad_cidr_and_secret_fields():
    with pytest.raises(UserInputError, match="region.*mars-north-1"):
        load_aws_config({"region": "mars-north-1"})
    with pytest.raises(UserInputError, match="ssh_cidr"):
        load_aws_config({"ssh_cidr": "10.0.0.1/8"})
    with pytest.raises(UserInputError, match="aws_secret_access_key"):
        load_aws_config({"aws_secret_access_key": "x"})
    assert AwsConfig(region="eu-west-1").region == "eu-west-1"


def test_client_token_is_stable_per_step_and_remainder():
    token = client_token("run", "plan-1", "g5.xlarge", "worker", "spot", 3, 0)
    assert token == client_token("run", "plan-1", "g5.xlarge", "worker", "spot", 3, 0)
    assert token != client_token("run", "plan-1", "g5.xlarge", "worker", "spot", 3, 1)
    assert token != client_token("run", "plan-2", "g5.xlarge", "worker", "spot", 3, 0)
    assert len(token) <= 64


def test_user_data_quotes_the_command_starts_the_watcher_first_and_shuts_down_after():
    startup = Startup(("python3", "-m", "train", "--name", "a b; rm -rf /"), {"LR": "0.1 $(x)"})
    script = user_data_script(startup, {"SPOTFILL_RUN_ID": "r1"}, ["python3", "-m", "tasks.providers.imds_watcher"])
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "export LR='0.1 $(x)'" in lines
    assert lines[-3].startswith("nohup python3 -m tasks.providers.imds_watcher")
    assert lines[-2] == "trap 'shutdown -h now' EXIT"  # the instance ends with its command, however it ends
    assert lines[-1] == "python3 -m train --name 'a b; rm -rf /'"
    with pytest.raises(UserInputError, match="not a valid name"):
        user_data_script(Startup(("x",), {"BAD-NAME": "1"}), {}, None)
    with pytest.raises(UserInputError, match="user data holds"):
        user_data_script(Startup(("x",), {"BIG": "y" * 20000}), {}, None)


@pytest.mark.parametrize("field, value", [
    ("on_demand_usd_per_h", {"g5.xlarge": True}),  # read as a price of $1.00 before
    ("quotas", {"g5.xlarge": True}),
    ("quotas", {"g5.xlarge": "3"}),
    ("max_usd_per_hour", True),
    ("max_instances", 2.0),
    ("watcher_poll_s", "5"),
])
def test_aws_config_numbers_are_read_strictly(field, value):
    with pytest.raises(UserInputError, match=f"^aws config: {field}"):
        load_aws_config({field: value})
    assert load_aws_config({"on_demand_usd_per_h": {"g5.xlarge": 1}, "max_usd_per_hour": 20}).max_usd_per_hour == 20.0
