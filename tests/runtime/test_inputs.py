"""Bad input to the runtime: one clear line on stderr and exit status 2, nothing started."""
from __future__ import annotations

import pytest
import torch

from tasks.core.errors import UserInputError
from tasks.providers.local import LocalProvider
from tasks.runtime import driver, ps, worker


@pytest.mark.parametrize("entry,argv,message", [
    (worker.main, ["--ps", "127.0.0.1:1", "--workload", "resnet20", "--batch-size", "0"],
     "--batch-size: must be a positive integer"),
    (worker.main, ["--ps", "127.0.0.1:1", "--workload", "resnet21", "--batch-size", "8"], "unknown workload 'resnet21'"),
    (worker.main, ["--ps", "localhost", "--workload", "resnet20", "--batch-size", "8"], "PS address must be HOST:PORT"),
    (worker.main, ["--ps", "127.0.0.1:1", "--workload", "resnet20", "--batch-size", "8", "--workload-opt", "w"],
     "workload option must be key=value"),
    (worker.main, ["--ps", "127.0.0.1:1", "--workload", "resnet20", "--batch-size", "8", "--workload-opt", "width=-1",
                   "--workload-opt", "width=2"], "workload option width given twice"),
    (worker.main, ["--ps", "127.0.0.1:1", "--workload", "resnet20", "--batch-size", "8", "--piece-mb", "0"],
     "--piece-mb: must be a positive number"),
    (worker.main, ["--ps", "127.0.0.1:1", "--workload", "resnet20", "--batch-size", "8", "--device", "gpu0"],
     "--device: must be auto, cpu, cuda or cuda:N, got 'gpu0'"),
    pytest.param(worker.main, ["--ps", "127.0.0.1:1", "--workload", "resnet20", "--batch-size", "8", "--device", "cuda:0"],
                 "--device cuda:0: torch sees no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")),
    (worker.main, ["--ps", "127.0.0.1:1", "--workload", "resnet20", "--batch-size", "8", "--nic-mbps", "1e-300"],
     "--nic-mbps: a bandwidth of 1e-300 Mbps is outside 0.001..1e+09 Mbps"),
    (worker.main, ["--ps", "127.0.0.1:1", "--workload", "resnet20", "--batch-size", "8", "--reference-compute-s", "1e300"],
     "--reference-compute-s: 1e300 s is more than ten years"),
    (ps.main, ["--run-dir", "RUN_DIR", "--port", "1", "--workload", "nope"], "unknown workload 'nope'"),
    (ps.main, ["--run-dir", "RUN_DIR", "--port", "1", "--workload", "resnet20", "--ps-mbps", "1e-300"],
     "--ps-mbps: a bandwidth of 1e-300 Mbps is outside 0.001..1e+09 Mbps"),
])
def test_bad_command_lines_exit_2_with_one_line(entry, argv, message, tmp_path, capsys):
    argv = [str(tmp_path) if a == "RUN_DIR" else a for a in argv]
    try:
        status = entry(argv)
    except SystemExit as exit_:  # argparse's usage errors
        status = exit_.code
    out, err = capsys.readouterr()
    assert status == 2 and message in err and out == ""
    assert len(err.strip().splitlines()) == 1


def test_unreachable_ps_is_one_line_and_exit_2(capfd):
    dead_port = driver.free_port()  # nothing listens there
    status = worker.main(["--ps", f"127.0.0.1:{dead_port}", "--workload", "resnet20", "--workload-opt", "width=2",
                          "--batch-size", "8", "--connect-timeout-s", "1"])
    out, err = capfd.readouterr()  # file descriptors: torch's C++ logging would show here too
    assert status == 2 and out == ""
    assert err == (f"spotfill worker: error: cannot reach the parameter server at 127.0.0.1:{dead_port} "
                   f"within 1 s (nothing listens at 127.0.0.1:{dead_port}: Connection refused)\n")


def test_driver_rejects_bad_input_before_starting_anything(tmp_path):
    provider = LocalProvider(tmp_path)
    with pytest.raises(UserInputError, match="unknown workload"):
        driver.start_run(provider, "bad", "resnet21")
    with pytest.raises(UserInputError, match="max_updates must be positive"):
        driver.start_run(provider, "bad", "resnet20", workload_options={"width": 2}, max_updates=0)
    assert provider.describe("bad") == []
    run = driver.TrainingRun("bad", tmp_path, provider, "127.0.0.1:1", None, "resnet20")
    with pytest.raises(UserInputError, match="batch size must be positive"):
        driver.add_workers(run, "p3.2xlarge", 1, batch_size=0)


@pytest.mark.parametrize("address", ["not-an-address", "300.1.1.1", "127.0.0.1:80", "127.0.0.1\nx", "h" * 4000])
def test_a_ps_bind_address_that_is_no_address_is_refused_before_anything_starts(tmp_path, monkeypatch, address):
    monkeypatch.setenv("SPOTFILL_PS_BIND", address)
    provider = LocalProvider(tmp_path)
    with pytest.raises(UserInputError, match="^SPOTFILL_PS_BIND='.*' is not an IP address") as err:
        driver.start_run(provider, "bad", "tests.plugins.regression:build")
    assert provider.describe("bad") == [] and "\n" not in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "127.0.0.1"])
def test_ip_addresses_are_bind_addresses(monkeypatch, address):
    from tasks.core.limits import ps_bind_address

    monkeypatch.setenv("SPOTFILL_PS_BIND", address)
    assert ps_bind_address() == address


def _train_cli(argv):
    """`spotfill train ...` through the project's parser conventions (the subcommand alone)."""
    from tasks.cli.main import OneLineParser
    from tasks.cli import train as commands

    parser = OneLineParser(prog="spotfill")
    commands.register(parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser))
    args = parser.parse_args(["train", *argv])
    return args.handler(args)


@pytest.mark.parametrize("argv,message", [
    (["--workload", "resnet20", "--workers", "p3.2xlarge=1", "--batch-size", "0"], "must be a positive integer"),
    (["--workload", "resnet20", "--workers", "p3.2xlarge", "--batch-size", "8"], "expected TYPE=N"),
    # the shaper's waits would overflow a sleep (too slow) or mean nothing (too fast): refused before launch
    (["--workload", "resnet20", "--workers", "p3.2xlarge=1", "--batch-size", "8", "--ps-mbps", "1e-300"],
     "a bandwidth of 1e-300 Mbps is outside 0.001..1e+09 Mbps"),
    (["--workload", "resnet20", "--workers", "p3.2xlarge=1", "--batch-size", "8", "--ps-mbps", "1e12"],
     "a bandwidth of 1e+12 Mbps is outside"),
    (["--workload", "resnet20", "--workers", "p3.2xlarge=1", "--batch-size", "8", "--reference-compute-s", "1e300"],
     "1e300 s is more than ten years"),
])
def test_train_usage_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        _train_cli(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--workload", "resnet20", "--workers", "p3.2xlarge=0", "--batch-size", "8"], "launches no worker"),
    (["--workload", "resnet20", "--workers", "z1.tiny=1", "--batch-size", "8"], "unknown instance type 'z1.tiny'"),
    (["--workload", "resnet21", "--workers", "p3.2xlarge=1", "--batch-size", "8", "--run-id", "x"], "unknown workload"),
    (["--workload", "resnet20", "--workers", "p3.2xlarge=1,g4dn.4xlarge=1", "--batch-size", "8",
      "--bandwidth-scale", "1e-300"], r"p3.2xlarge's link \(its NIC times --bandwidth-scale 1e-300\) of .* is outside"),
    (["--workload", "resnet20", "--workers", "g4dn.4xlarge=1", "--batch-size", "8", "--bandwidth-scale", "1e300"],
     r"g4dn.4xlarge's link .* outside 0.001..1e\+09 Mbps"),
])
def test_train_bad_values_are_user_errors(argv, message):
    with pytest.raises(UserInputError, match=message):
        _train_cli(argv)
