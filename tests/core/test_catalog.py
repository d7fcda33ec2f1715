import json

import pytest

from tasks.core.catalog import CATALOG, SOURCES, build_catalog, network_mbps
from tasks.core.errors import UserInputError
from tasks.providers.base import catalog_instance_types


@pytest.mark.parametrize("label, mbps", [("Up to 10 Gigabit", 1250.0), ("25 Gigabit", 3125.0),
                                         ("4x 100 Gigabit", 50000.0), ("Up to 12.5 Gigabit", 1562.5),
                                         ("High", None), ("Moderate", None)])
def test_network_labels(label, mbps):
    assert network_mbps(label) == mbps


def test_committed_catalog_is_what_the_sources_build():
    assert build_catalog(SOURCES) == json.loads(CATALOG.read_text())


def test_catalog_has_real_prices_and_bands():
    types = {t.name: t for t in catalog_instance_types("us-east-1")}
    p3 = types["p3.2xlarge"]
    assert p3.gpus == 1 and "V100" in p3.gpu_model and p3.on_demand_usd_per_h == pytest.approx(3.06)
    assert p3.spot_usd_per_h < p3.on_demand_usd_per_h
    assert p3.interruption_band == 4  # the Spot Advisor's >20% band


def test_unknown_region_is_a_clear_error():
    with pytest.raises(UserInputError, match="no priced GPU type in region 'mars-1'"):
        catalog_instance_types("mars-1")


def _sources(tmp_path, name: str, text: str):
    import shutil

    folder = tmp_path / "sources"
    shutil.copytree(SOURCES, folder)
    (folder / name).write_text(text)
    return folder


TSV = "spot-prices-gpu-2022-05-31.tsv"


@pytest.mark.parametrize("name, text, message", [
    (TSV, "us-east-1a\tp3.2xlarge\tLinux/UNIX\t-0.49\t2022-05-31T00:00:00\n", ":1: price '-0.49' is not a price"),
    (TSV, "us-east-1a\tp3.2xlarge\tLinux/UNIX\tnan\t2022-05-31T00:00:00\n", ":1: price 'nan' is not a price"),
    (TSV, "us-east-1a\tp3.2xlarge\tLinux/UNIX\t1e308\t2022-05-31T00:00:00\n", ":1: price '1e308' is not a price"),
    # a digit separator or another script's digits is no price (not $1000, not $12)
    (TSV, "us-east-1a\tp3.2xlarge\tLinux/UNIX\t1_000\t2022-05-31T00:00:00\n", ":1: price '1_000' is not a price"),
    (TSV, "us-east-1a\tp3.2xlarge\tLinux/UNIX\t\u0661\u0662\t2022-05-31T00:00:00\n", ":1: price '\u0661\u0662' is not"),
    (TSV, "us-east-1a\tp3.2xlarge\tLinux/UNIX\t1,000\t2022-05-31T00:00:00\n", ":1: price '1,000' is not a price"),
    (TSV, "us-east-1a\tp3.2xlarge\n", "has no Linux/UNIX price row of 5 tab-separated columns"),
    (TSV, "", "has no Linux/UNIX price row"),
    ("ec2-gpu-instances.json", "{}", "lists no instance type"),
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge", "GPU": "lots"}]', "GPU count is 'lots', not a number"),
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge", "GPU": 5000}]', "GPU count is 5000, not a number of GPUs"),
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge", "GPU": 1}, {"instance_type": "p3.2xlarge", "GPU": 1}]',
     "instance type p3.2xlarge is listed twice"),
    ("ec2-gpu-instances.json", '[{"instance_type": "", "GPU": 1}]', "instance type '' is not a type name"),
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge", "GPU": 1, "GPU_model": 5}]', "GPU model is 5, not a name"),
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge", "GPU": 1, "pricing": {"us-east-1": {"linux": '
                               '{"ondemand": "-3"}}}}]', "p3.2xlarge in us-east-1: ondemand is '-3', not a price"),
    # `true` is no price of $1.00, whichever price it stands for
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge", "GPU": 1, "pricing": {"us-east-1": {"linux": '
                               '{"ondemand": true}}}}]', "p3.2xlarge in us-east-1: ondemand is True, not a price"),
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge", "GPU": 1, "pricing": {"us-east-1": {"linux": '
                               '{"spot_avg": false}}}}]', "p3.2xlarge in us-east-1: spot_avg is False, not a price"),
    # a number past float range is named by file, line and column, wherever it stands
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge",\n  "GPU_memory": 1e999}]',
     "ec2-gpu-instances.json: line 2, column 17: number 1e999 is past the range of a float"),
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge", "GPU": -2.5e400}]',
     "ec2-gpu-instances.json: line 1, column 41: number -2.5e400 is past the range of a float"),
    ("ec2-gpu-instances.json", '[{"instance_type": "p3.2xlarge",\n\n "vCPU": 123456789012345678901}]',
     "ec2-gpu-instances.json: line 3, column 10: integer 123456789012345678901 is beyond int64"),
])
def test_sources_that_parse_but_are_wrong_build_no_catalog(tmp_path, name, text, message):
    with pytest.raises(UserInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_catalog(_sources(tmp_path, name, text))


def test_an_interruption_band_outside_the_advisor_ranges_builds_no_catalog(tmp_path):
    import json

    advisor = json.loads((SOURCES / "spot-advisor-data.json").read_text())
    region, name = "us-east-1", "p3.2xlarge"
    for band in (9, -1, 2.5, "x"):
        advisor["spot_advisor"][region]["Linux"][name]["r"] = band
        with pytest.raises(UserInputError, match=f"{name} in {region} has interruption band"):
            build_catalog(_sources(tmp_path / str(band), "spot-advisor-data.json", json.dumps(advisor)))


def test_catalog_build_does_not_write_into_its_own_sources(tmp_path, capsys):
    import shutil

    from tasks.cli.main import main

    folder = tmp_path / "sources"
    shutil.copytree(SOURCES, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert main(["catalog", "build", "--sources", str(folder), "--out", str(folder / "ec2-gpu-instances.json")]) == 2
    assert "is inside --sources" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
