"""`spotfill plan --on-demand-quota` and `spotfill predict` with on-demand workers (docs/cli.md),
run in-process: plan keys are the profile's types, and `TYPE:on-demand` keys appear only when
on-demand offers are allowed."""
import json

import pytest

from tasks.cli.main import main
from tests.helpers import SHIPPED_PROFILE

PROFILE = str(SHIPPED_PROFILE)
# spot quotas too small for the deadline: on-demand workers make up the rest
SHORT = "p3.2xlarge=1,g4dn.4xlarge=1,g3.8xlarge=0,g3.16xlarge=0,p2.8xlarge=0"
PLAN = ["plan", PROFILE, "--loss", "0.8", "--deadline", "2500", "--quota", SHORT]


def run(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_on_demand_workers_are_named_and_split_by_market(capsys):
    rc, out, err = run(capsys, *PLAN, "--on-demand-quota", "p3.2xlarge=2,g4dn.4xlarge=3", "--json")
    assert rc == 0, err
    result = json.loads(out)
    spot_types = {"p3.2xlarge", "g4dn.4xlarge", "g3.8xlarge", "g3.16xlarge", "p2.8xlarge"}
    assert set(result["plan"]) <= spot_types | {f"{t}:on-demand" for t in spot_types}
    assert any(name.endswith(":on-demand") for name in result["plan"])
    by_market = result["markets"]
    assert set(by_market) == {"spot", "on-demand"}
    for market, counts in by_market.items():
        for t, n in counts.items():
            assert result["plan"][t if market == "spot" else f"{t}:on-demand"] == n
    assert result["predicted_time_s"] <= 2500


def test_without_on_demand_offers_the_plan_and_its_keys_are_as_before(capsys):
    rc, out, err = run(capsys, *PLAN, "--json")
    assert rc == 2 and "no plan meets the deadline" in err  # the spot quotas alone are too small
    rc, out, _ = run(capsys, "plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--json")
    assert rc == 0 and "markets" not in json.loads(out)
    assert not any(":" in name for name in json.loads(out)["plan"])


def test_the_table_prices_on_demand_workers_at_the_on_demand_price(capsys):
    rc, out, err = run(capsys, *PLAN, "--on-demand-quota", "p3.2xlarge=2")
    assert rc == 0, err
    row = next(line.split() for line in out.splitlines() if line.startswith("p3.2xlarge:on-demand"))
    count, price = int(row[1]), float(row[3])
    assert count >= 1 and price == pytest.approx(3.06)  # the profile's on_demand_price
    assert f"markets          1 spot, {count} on-demand" in out


def test_the_profile_field_allows_on_demand_workers_and_the_flag_overrides_it(tmp_path, capsys):
    data = json.loads(SHIPPED_PROFILE.read_text())
    data["instances"][0]["on_demand_quota"] = 2  # p3.2xlarge
    path = tmp_path / "with-on-demand.json"
    path.write_text(json.dumps(data))
    rc, out, err = run(capsys, "plan", str(path), *PLAN[2:], "--json")
    assert rc == 0 and json.loads(out)["markets"]["on-demand"], err
    rc, out, err = run(capsys, "plan", str(path), *PLAN[2:], "--on-demand-quota", "p3.2xlarge=0", "--json")
    assert rc == 2 and "no plan meets the deadline" in err
    rc, out, err = run(capsys, "predict", str(path), "--cluster", "p3.2xlarge=1,p3.2xlarge:on-demand=1",
                       "--loss", "0.8", "--json")
    assert rc == 0, err


def test_predict_prices_a_twin_at_the_on_demand_price(capsys):
    args = ["predict", PROFILE, "--loss", "0.8", "--json"]
    rc, out, err = run(capsys, *args, "--cluster", "p3.2xlarge=2")
    assert rc == 0, err
    spot = json.loads(out)
    rc, out, err = run(capsys, *args, "--cluster", "p3.2xlarge=1,p3.2xlarge:on-demand=1", "--on-demand-quota",
                       "p3.2xlarge=1")
    assert rc == 0, err
    mixed = json.loads(out)
    assert mixed["predicted_time_s"] == pytest.approx(spot["predicted_time_s"], rel=1e-12)  # the same hardware
    hours = spot["predicted_time_s"] / 3600
    assert mixed["predicted_cost_usd"] == pytest.approx(hours * (0.918 + 3.06), rel=1e-9)


@pytest.mark.parametrize("args, message", [
    (["predict", PROFILE, "--loss", "0.8", "--cluster", "p3.2xlarge:on-demand=1"],
     "'p3.2xlarge:on-demand' is an on-demand worker, and p3.2xlarge has no on-demand quota: give it one"),
    (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--existing", "g3.8xlarge:on-demand=1"],
     "'g3.8xlarge:on-demand' is an on-demand worker, and g3.8xlarge has no on-demand quota"),
    (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--on-demand-quota", "zz.big=1"],
     "unknown instance type 'zz.big'"),
    (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--on-demand-quota", "p3.2xlarge:on-demand=1"],
     "on-demand quota for 'p3.2xlarge:on-demand': name the spot type (p3.2xlarge)"),
    (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--on-demand-quota", "p3.2xlarge=-1"],
     "count for p3.2xlarge is negative"),
    (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--on-demand-quota", "p3.2xlarge"], "expected TYPE=N"),
])
def test_bad_on_demand_input_is_one_line_and_exit_2(capsys, args, message):
    rc, out, err = run(capsys, *args)
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1 and "Traceback" not in err
