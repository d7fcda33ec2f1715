"""The CLI contract (docs/cli.md), run as a real subprocess."""
import json
import math
import subprocess
import sys
from statistics import NormalDist

import pytest

from tests.helpers import REPO, SHIPPED_PROFILE, spotfill

PROFILE = str(SHIPPED_PROFILE)


@pytest.mark.integration
def test_predict_json():
    r = spotfill("predict", PROFILE, "--cluster", "g3.8xlarge=5,g3.16xlarge=3", "--loss", "0.8", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"workers", "iterations", "expected_iteration_time_s", "speed", "wa_batch", "cc",
                        "predicted_time_s", "predicted_cost_usd"}
    assert out["workers"] == 8
    assert out["predicted_time_s"] == pytest.approx(2549.02, abs=0.05)


@pytest.mark.integration
def test_plan_json_and_human():
    r = spotfill("plan", PROFILE, "--loss", "0.8", "--deadline", "2000", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["solver"] == "exact" and out["predicted_time_s"] <= 2000
    assert r.stdout.count("\n") == 1  # one JSON object, nothing else on stdout
    human = spotfill("plan", PROFILE, "--loss", "0.8", "--deadline", "2000", "--solver", "heuristic")
    assert human.returncode == 0 and "predicted cost" in human.stdout and "heuristic" in human.stdout


@pytest.mark.integration
def test_plan_out_file_is_written(tmp_path):
    target = tmp_path / "plans" / "plan.json"
    r = spotfill("plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--out", str(target), "--json")
    assert r.returncode == 0
    assert json.loads(target.read_text()) == json.loads(r.stdout) | {"solve_seconds": json.loads(target.read_text())["solve_seconds"]}


@pytest.mark.integration
@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "missing.json", "--loss", "0.8", "--deadline", "100"], "profile not found"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "0"], "--deadline: must be a positive"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "-3"], "--deadline: must be a positive"),
        (["plan", PROFILE, "--loss", "0.5", "--deadline", "3000"], "unreachable"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--existing", "zz.big=1"], "unknown instance type"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--quota", "p3.2xlarge=1", "--existing",
          "p3.2xlarge=2"], "below its existing count"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "500"], "fastest plan within the quotas takes"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--quota", "p3.2xlarge"], "expected TYPE=N"),
        (["plan", PROFILE, "--loss", "abc", "--deadline", "3000"], "not a number"),
        (["predict", PROFILE, "--cluster", "p3.2xlarge=0", "--loss", "0.8"], "names no instance"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--min-workers", "0"], "--min-workers: must be"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--min-workers", "30"],
         "min_workers 30 is more than the quotas allow"),
        (["plan", PROFILE, "--deadline", "3000"], "required: --loss"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--confidence", "1.5"], "confidence must be in (0, 1)"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--confidence", "0"], "confidence must be in (0, 1)"),
        (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--confidence", "0.9"], "no uncertainty.time_log_sd"),
        (["predict", PROFILE, "--cluster", "p3.2xlarge=1", "--loss", "0.8", "--level", "1"], "--level must be in (0, 1)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    r = spotfill(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.integration
def test_malformed_profile_field_is_named(tmp_path):
    data = json.loads(SHIPPED_PROFILE.read_text())
    del data["instances"][1]["compute_time_s"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    r = spotfill("plan", str(bad), "--loss", "0.8", "--deadline", "3000")
    assert r.returncode == 2 and "instances.1.compute_time_s: missing field" in r.stderr


@pytest.mark.integration
def test_cli_start_up_imports_neither_torch_nor_prefect():
    code = ("import sys; from tasks.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'prefect', 'boto3') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


@pytest.mark.integration
@pytest.mark.parametrize("field, value, message", [
    ("kappa", 0.1, "loss.kappa: Input should be greater than or equal to 0.25"),
    ("kappa", 1.01, "loss.kappa: Input should be less than or equal to 1"),
    ("by", "nodes", "contention.by: Input should be 'workers' or 'load'"),
])
def test_bad_model_form_is_named(tmp_path, field, value, message):
    data = json.loads(SHIPPED_PROFILE.read_text())
    data["loss" if field == "kappa" else "contention"][field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    for args in (["plan", str(bad), "--loss", "0.8", "--deadline", "3000"],
                 ["predict", str(bad), "--cluster", "p3.2xlarge=1", "--loss", "0.8"]):
        r = spotfill(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


@pytest.mark.integration
def test_interval_and_plan_at_the_upper_end(tmp_path):
    """A profile with a measured spread: predict gives [T / f, T * f]; plan --confidence meets the
    deadline at T * f and says what that costs over the plan for the centre."""
    data = json.loads(SHIPPED_PROFILE.read_text())
    data["uncertainty"] = {"time_log_sd": 0.05}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    factor = math.exp(NormalDist().inv_cdf(0.95) * 0.05)
    out = json.loads(spotfill("predict", str(path), "--cluster", "p3.2xlarge=2", "--loss", "0.8", "--json").stdout)
    assert out["interval"]["level"] == 0.9
    assert out["interval"]["time_s"] == pytest.approx([out["predicted_time_s"] / factor, out["predicted_time_s"] * factor])
    text = spotfill("predict", str(path), "--cluster", "p3.2xlarge=2", "--loss", "0.8")  # the default level, in words
    low, high = out["interval"]["time_s"]
    assert text.returncode == 0 and f"90% interval     {low:.1f} - {high:.1f} s" in text.stdout, text.stderr
    central = json.loads(spotfill("plan", str(path), "--loss", "0.8", "--deadline", "2600", "--json").stdout)
    assert central["predicted_time_s"] * factor > 2600  # the central plan would miss at the upper end
    r = spotfill("plan", str(path), "--loss", "0.8", "--deadline", "2600", "--confidence", "0.9", "--json")
    sure = json.loads(r.stdout)["confidence"]
    assert sure["upper_time_s"] == pytest.approx(json.loads(r.stdout)["predicted_time_s"] * factor)
    assert sure["upper_time_s"] <= 2600 and sure["central_cost_usd"] == pytest.approx(central["predicted_cost_usd"])
    assert sure["extra_cost_usd"] == pytest.approx(json.loads(r.stdout)["predicted_cost_usd"] - central["predicted_cost_usd"])
    assert sure["extra_cost_usd"] > 0
    human = spotfill("plan", str(path), "--loss", "0.8", "--deadline", "2600", "--confidence", "0.9")
    assert "confidence       90%: upper end" in human.stdout


@pytest.mark.integration
def test_a_fitted_profile_flags_extrapolation_and_plans_within_its_fitted_sizes(tmp_path):
    data = json.loads(SHIPPED_PROFILE.read_text()) | {"fit_quality": {"loss-curve": {"workers": [2, 6]}}}
    path = tmp_path / "fitted.json"
    path.write_text(json.dumps(data))
    one = json.loads(spotfill("predict", str(path), "--cluster", "p3.2xlarge=1", "--loss", "0.8", "--json").stdout)
    assert one["fitted_workers"] == [2, 6] and one["extrapolated"] is True
    two = json.loads(spotfill("predict", str(path), "--cluster", "p3.2xlarge=2", "--loss", "0.8", "--json").stdout)
    assert two["extrapolated"] is False
    human = spotfill("predict", str(path), "--cluster", "p3.2xlarge=1", "--loss", "0.8")
    assert "extrapolated     the loss curve was fitted on 2 to 6 workers" in human.stdout
    plan = json.loads(spotfill("plan", str(path), "--loss", "0.8", "--deadline", "1e6", "--json").stdout)
    assert sum(plan["plan"].values()) >= 2 and plan["min_workers"] == 2
    shipped = json.loads(spotfill("plan", PROFILE, "--loss", "0.8", "--deadline", "1e6", "--json").stdout)
    assert sum(shipped["plan"].values()) == 1 and "min_workers" not in shipped


@pytest.mark.integration
@pytest.mark.parametrize("field, value, fragment", [
    ("param_mb", 1e308, "iterations = inf; check the magnitudes of its fields"),
    ("uncertainty", {"time_log_sd": 1e308}, "gives an interval beyond any number"),
])
def test_profile_numbers_too_large_to_compute_with_are_an_error_not_an_infinite_answer(tmp_path, field, value, fragment):
    data = json.loads(SHIPPED_PROFILE.read_text()) | {field: value}
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(data))
    r = spotfill("predict", str(path), "--cluster", "g3.8xlarge=1", "--loss", "0.8", "--json")
    assert r.returncode == 2 and r.stdout == "" and fragment in r.stderr and r.stderr.count("\n") == 1
    if field == "param_mb":
        r = spotfill("plan", str(path), "--loss", "0.8", "--deadline", "3000")
        assert r.returncode == 2 and "no cluster a finite time" in r.stderr


def test_an_absurd_fastest_time_is_printed_in_three_digits_not_hundreds(tmp_path, capsys):
    import json

    from tasks.cli.main import main

    data = json.loads(SHIPPED_PROFILE.read_text())
    data["loss"]["gamma2"] = 1e150  # a typo's magnitude: every cluster takes about 1e150 s
    path = tmp_path / "absurd.json"
    path.write_text(json.dumps(data))
    assert main(["plan", str(path), "--loss", "1", "--deadline", "36000"]) == 2
    err = capsys.readouterr().err
    assert "no plan meets the deadline" in err and "e+" in err and len(err) < 300, err
