"""`spotfill simulate`: the --json contract, the report, and bad input as one-line errors."""
import json

import pytest

from tasks.cli.main import main
from tests.helpers import REPO, SHIPPED_PROFILE

PROFILE = str(SHIPPED_PROFILE)
G3_BANDS = "g3.8xlarge=4,g3.16xlarge=4"
POLICIES = {"heuristic", "exact", "homogeneous-fast", "homogeneous-slow", "on-demand", "restart-single", "risk-aware",
            "greedy", "uniform-progress", "deadline-safe"}


def simulate(capsys, *args):
    status = main(["simulate", PROFILE, "--loss", "0.8", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_simulate_json_has_every_policy_and_the_contract_keys(capsys, tmp_path):
    status, out, err = simulate(capsys, "--deadline", "2500", "--quick", "--replays", "3", "--band", G3_BANDS,
                                "--out-dir", str(tmp_path), "--json")
    assert status == 0, err
    assert out.count("\n") == 1
    result = json.loads(out)
    assert set(result["policies"]) == POLICIES
    for p in result["policies"].values():
        assert {"slo_attainment", "mean_cost_usd", "p95_time_s", "savings_vs_on_demand_pct"} <= set(p)
        assert 0.0 <= p["slo_attainment"] <= 1.0 and p["mean_cost_usd"] > 0
    assert result["target_level"] == 0.95 and result["replays"] == 3
    assert result["simulated_hours_per_wall_s"] > 0
    assert result["policies"]["on-demand"]["savings_vs_on_demand_pct"] == 0.0
    assert result["policies"]["on-demand"]["mean_revocations"] == 0.0
    # the offline optimum is the floor: no policy meeting the deadline on every draw costs less
    floor = result["offline_optimum"]["mean_cost_usd"]
    assert all(p["mean_cost_usd"] >= floor for p in result["policies"].values() if p["slo_attainment"] == 1.0)
    assert result["on_demand_quota"] == {"p3.2xlarge": 2, "g4dn.4xlarge": 5, "g3.8xlarge": 5, "g3.16xlarge": 8,
                                         "p2.8xlarge": 5}  # none in the profile: as many as its spot quota
    assert result["hazards_per_h"]["g3.8xlarge"]["source"] == "band"
    assert result["hazards_per_h"]["p3.2xlarge"]["traces"] == ["parcae_p3trace"]
    png = tmp_path / "simulate-resnet110-cifar100-2500s.png"
    assert result["plot"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_table_for_people(capsys, tmp_path):
    status, out, err = simulate(capsys, "--deadline", "3000", "--replays", "2", "--band", G3_BANDS,
                                "--out-dir", str(tmp_path))
    assert status == 0, err
    assert "SLO met" in out and "risk-aware" in out and "simulated hours per wall second" in out


@pytest.mark.parametrize("trace_text, message", [
    ("", "trace has no events"),
    ("0,3\n-10,2\n", ":2: negative timestamp -10"),
])
def test_simulate_rejects_bad_traces(capsys, tmp_path, trace_text, message):
    bad = tmp_path / "parcae_p3trace.csv"
    bad.write_text(trace_text)
    status, out, err = simulate(capsys, "--deadline", "3000", "--traces", str(bad), "--band", G3_BANDS)
    assert status == 2 and out == ""
    assert err.startswith("spotfill: error: ") and message in err and str(bad) in err
    assert err.count("\n") == 1


def test_simulate_rejects_a_type_without_trace_or_band(capsys):
    status, _, err = simulate(capsys, "--deadline", "3000", "--replays", "1")
    assert status == 2
    assert "g3.8xlarge has no trace of its family (g3) and no interruption band: pass --band" in err
    assert err.count("\n") == 1


def test_simulate_rejects_a_trace_of_a_family_the_profile_lacks(capsys, tmp_path):
    trace = tmp_path / "g5-mine.csv"
    trace.write_text("0,4\n100,3\n")
    status, _, err = simulate(capsys, "--deadline", "3000", "--traces", str(trace), "--band", G3_BANDS)
    assert status == 2 and "trace g5-mine is of family g5, which no type of the profile has" in err


@pytest.mark.parametrize("args, message", [
    (["--deadline", "3000", "--level", "1.5", "--band", G3_BANDS], "--level must be a probability"),
    (["--deadline", "3000", "--replays", "0", "--band", G3_BANDS], "--replays: must be a positive integer"),
    (["--deadline", "3000", "--band", "g3.8xlarge=7,g3.16xlarge=4"], "band for g3.8xlarge must be 0..4"),
    (["--deadline", "3000", "--band", G3_BANDS, "--traces", str(REPO / "nope.csv")], "trace not found"),
    (["--deadline", "3000", "--band", G3_BANDS, "--band-stress", "1e9"], "--band-stress: must be at most 100000"),
    (["--deadline", "1", "--band", G3_BANDS], "no plan meets the deadline: the fastest plan within the quotas takes"),
])
def test_simulate_bad_options(capsys, args, message):
    status, _, err = simulate(capsys, *args)
    assert status == 2 and message in err


def test_simulate_synthetic_replays_poisson_at_the_same_hazards(capsys, tmp_path):
    status, out, err = simulate(capsys, "--deadline", "2500", "--replays", "1", "--synthetic", "--band", G3_BANDS,
                                "--out-dir", str(tmp_path), "--json")
    assert status == 0, err
    result = json.loads(out)
    assert result["synthetic"] is True
    assert result["hazards_per_h"]["p3.2xlarge"]["source"] == "trace"  # its rate still comes from the trace
    assert set(result["policies"]) == POLICIES


def test_traces_without_a_revocation_ask_for_a_band_stress_instead_of_naming_an_option_not_given(capsys, tmp_path):
    quiet = tmp_path / "parcae_p3trace.csv"
    quiet.write_text("0,5\n10,5\n")
    status, out, err = simulate(capsys, "--deadline", "3000", "--traces", str(quiet), "--band", G3_BANDS)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert "the traces loaded show no revocation" in err and "give --band-stress X" in err


def test_a_type_with_quota_0_is_left_out_of_the_baselines_not_taken_for_every_quota(capsys, tmp_path):
    status, out, err = simulate(capsys, "--deadline", "2500", "--quick", "--replays", "2", "--band", G3_BANDS,
                                "--quota", "p2.8xlarge=0", "--out-dir", str(tmp_path), "--json")
    assert status == 0, err
    policies = json.loads(out)["policies"]
    assert set(policies) == POLICIES


@pytest.mark.slow  # about 11 s
def test_traces_that_revoke_without_end_stop_the_replay_with_one_line(capsys, tmp_path):
    """Two instances, one revoked every 10 s: each revocation re-plans, and the replay would run on."""
    trace = tmp_path / "p3-flood.csv"
    trace.write_text("0,2\n10,1\n")
    status, out, err = simulate(capsys, "--deadline", "3600", "--replays", "1", "--band", G3_BANDS,
                                "--traces", str(trace), "--out-dir", str(tmp_path))
    assert status == 2 and out == ""
    assert "revocations within" in err and "revoke far faster than a spot market does" in err
    assert len(err.strip().splitlines()) == 1


def test_capacity_records_limit_spot_and_name_what_limited_it(capsys, tmp_path):
    east = tmp_path / "p3-east.json"
    east.write_text(json.dumps({"metadata": {"gap_seconds": 600, "zone": "us-east-1a"}, "data": [2, 0, 0, 1]}))
    status, out, err = simulate(capsys, "--deadline", "4000", "--replays", "2", "--band", G3_BANDS,
                                "--capacity", str(east), f"g4dn.4xlarge={east}", "--out-dir", str(tmp_path), "--json")
    assert status == 0, err
    result = json.loads(out)
    assert result["capacity"] == {"p3.2xlarge": ["p3-east"], "g4dn.4xlarge": ["p3-east"]}
    assert set(result["policies"]) == POLICIES and result["offline_optimum"]["mean_cost_usd"] > 0
    status, out, err = simulate(capsys, "--deadline", "4000", "--replays", "2", "--band", G3_BANDS,
                                "--drought", "1333,2667", "--out-dir", str(tmp_path))
    assert status == 0, err
    assert "none of any type from 1333 s to 2667 s" in out and "offline optimum" in out


@pytest.mark.parametrize("args, message", [
    (["--drought", "2667,1333"], "the window's start (2667) must come before its end (1333)"),
    (["--drought", "100"], "expected START,END in seconds"),
    (["--drought", "0,100", "--capacity", "x.csv"], "--drought is a synthetic market of its own"),
    (["--capacity", "nofamily.csv"], "nofamily.csv"),
    (["--on-demand-quota", "p3.2xlarge=-1"], "count for p3.2xlarge is negative"),
    (["--on-demand-quota", "nosuch=1"], "unknown instance type 'nosuch'"),
])
def test_bad_capacity_and_on_demand_options_are_one_line(capsys, args, message):
    status, out, err = simulate(capsys, "--deadline", "3000", "--band", G3_BANDS, *args)
    assert status == 2 and out == "" and message in err and err.count("\n") == 1


def test_a_capacity_record_from_a_zone_outside_the_region_names_the_file_and_line(capsys, tmp_path):
    west = tmp_path / "p3-west.csv"
    west.write_text("# zone: us-west-2b\nseconds,available\n0,2\n600,0\n")
    status, out, err = simulate(capsys, "--deadline", "3000", "--band", G3_BANDS, "--capacity", str(west))
    assert status == 2 and f"{west}:1: zone us-west-2b is not in region us-east-1" in err
