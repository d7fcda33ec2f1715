"""`spotfill bench filling --online-rate`: parsed, validated before any slow work (one line, exit
2), passed to the bench, recorded in its output; a list of rates runs one bench per rate."""
from __future__ import annotations

import argparse
import json

import pytest

from tasks.bench import filling as bench
from tasks.cli.args import positive_floats
from tasks.cli.main import main
from tests.helpers import fake_result


def exit_status(argv: list[str]) -> int:
    """main's status, whether argparse exits (a malformed value) or main returns it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


def test_positive_floats_parses_one_rate_or_a_list():
    assert positive_floats("20") == [20.0]
    assert positive_floats("2, 5,10,20") == [2.0, 5.0, 10.0, 20.0]
    for bad in ("0", "-1", "abc", "nan", "inf", "5,5", "5,", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_floats(bad)


@pytest.fixture
def fake_bench(monkeypatch):
    """Record the rates and training shapes a bench would run at, instead of running it (seconds,
    not minutes)."""
    calls = []

    def run_one(quick, online_rate, artifact, device, shape, max_s):
        calls.append((quick, online_rate, artifact, shape))
        return fake_result(online_rate)

    monkeypatch.setattr(bench, "_run_one", run_one)
    return calls


@pytest.mark.parametrize("argv,fragment", [
    (["bench", "filling", "--online-rate", "0"], "must be a positive number, got 0"),
    (["bench", "filling", "--online-rate=-3"], "must be a positive number, got -3"),
    (["bench", "filling", "--online-rate", "fast"], "not a number: 'fast'"),
    (["bench", "filling", "--online-rate", "2,2"], "2 given twice"),
    (["bench", "filling", "--online-rate", "10,5000"], "at most 1000 requests/s, got 5000"),
    (["bench", "planner", "--online-rate", "5"], "applies only to `bench filling`"),
    (["bench", "filling", "--instance-type", "z9.huge"], "unknown instance type 'z9.huge'"),
    (["bench", "filling", "--bubble-scale", "0"], "must be a positive number, got 0"),
    (["bench", "runtime", "--bubble-scale", "2"], "applies only to `bench filling`"),
    (["bench", "filling", "--training-batch", "0"], "must be a positive integer"),
    (["bench", "filling", "--training-batch", "5000"], "--training-batch must be > 0 and at most 4096"),
    (["bench", "planner", "--training-batch", "64"], "applies only to `bench filling`"),
])
def test_bad_online_rate_is_one_line_and_exit_2(argv, fragment, capsys, fake_bench):
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err
    assert fake_bench == []  # refused before any bench started


def test_one_rate_keeps_the_issue_keys_at_top_level_and_records_the_rate(capsys, fake_bench):
    assert main(["bench", "filling", "--quick", "--json", "--online-rate", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [call[:3] for call in fake_bench] == [(True, 5.0, bench.ARTIFACT)]
    assert out["online_rate_per_s"] == 5.0
    for key in ("training_retained", "naive_training_retained", "fill_efficiency", "spill_fraction",
                "offline_samples_per_s", "offline_share_of_solo", "online_p95_s",
                "naive_online_p95_s"):
        assert key in out


def test_without_the_option_the_bench_runs_at_the_default_rate(capsys, fake_bench):
    assert main(["bench", "filling", "--quick"]) == 0
    assert [rate for _q, rate, _a, _s in fake_bench] == [bench.DEFAULT_ONLINE_RATE]
    assert fake_bench[0][3]["training_batch"] is None  # the device's default batch
    assert "online arrivals 20/s" in capsys.readouterr().out


def test_the_training_batch_option_reaches_the_bench(capsys, fake_bench):
    assert main(["bench", "filling", "--quick", "--training-batch", "64"]) == 0
    assert [shape for *_call, shape in fake_bench] == [
        {"instance_type": "p3.2xlarge", "bubble_scale": 1.0, "training_batch": 64}]


def test_the_cpu_training_job_takes_its_default_batch_or_the_one_given():
    default = bench.training_job("cpu")
    assert default.batch == bench.TRAINING["cpu"][2] and default.name == "small-cnn"
    wide = bench.training_job("cpu", 64)
    assert wide.batch == 64 and wide.batches[0][0].shape[0] == 64
    assert wide.param_mb == default.param_mb  # the batch changes the compute phase, not the bubble


def test_a_list_of_rates_runs_one_bench_per_rate_in_order(capsys, fake_bench):
    assert main(["bench", "filling", "--online-rate", "10,2"]) == 0
    assert [(q, rate) for q, rate, _a, _s in fake_bench] == [(False, 10.0), (False, 2.0)]
    assert len({artifact for _q, _r, artifact, _s in fake_bench}) == 2  # one plot per rate
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines()[1:3]]
    assert [row[0] for row in rows] == ["10", "2"]
    assert rows[0][-4] == "0.50"  # gated p95 / naive p95
    assert rows[0][-2:] == ["+8.0%", "met"]  # the worst round's p99 slowdown; all targets met
    assert table.count("online arrivals") == 2  # then each rate's own table

    assert main(["bench", "filling", "--json", "--online-rate", "10,2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["online_rates_per_s"] == [10.0, 2.0]
    assert [run["online_rate_per_s"] for run in out["runs"]] == [10.0, 2.0]


def test_bench_config_takes_the_rate():
    assert bench.bench_config().online_rate_per_s == bench.DEFAULT_ONLINE_RATE
    assert bench.bench_config("cpu", 2.5).online_rate_per_s == 2.5


def test_rounds_go_on_past_the_planned_count_until_enough_requests_were_served():
    s = {"rounds": 12, "max_rounds": 40, "min_rounds": 3, "min_online_served": 100, "max_s": 75.0}
    assert bench._another_round(0, 0.0, 0, s)
    assert bench._another_round(11, 10.0, 500, s)  # the planned rounds run regardless
    assert not bench._another_round(12, 10.0, 100, s)  # enough served: stop
    assert bench._another_round(12, 10.0, 99, s)  # too few for a p95 yet: go on
    assert not bench._another_round(12, 76.0, 0, s)  # ... but never past max_s
    assert not bench._another_round(40, 10.0, 0, s)  # nor past max_rounds
    assert bench._another_round(2, 500.0, 0, s)  # the minimum rounds run even when slow
    assert not bench._another_round(3, 500.0, 0, s)
