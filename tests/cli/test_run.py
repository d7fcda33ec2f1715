"""`spotfill run`'s market options (on-demand quota, capacity traces, droughts): bad input is one
line and exit 2 before a Prefect server or a process starts."""
import pytest

from tasks.cli.main import main
from tests.helpers import LOCAL_QUICK_PROFILE


def run_status(argv: list[str]) -> int:
    try:
        return main(["run", "--profile", str(LOCAL_QUICK_PROFILE), *argv])
    except SystemExit as stop:  # argparse's usage errors
        return stop.code


@pytest.mark.parametrize("argv, fragment", [
    (["--drought", "p3.2xlarge=0"], "argument --drought: must be a positive number, got 0"),
    (["--drought", "p3.2xlarge"], "expected TYPE=SECONDS"),
    (["--drought", "p3.2xlarge=20", "--drought", "p3.2xlarge=30"], "--drought: type p3.2xlarge given twice"),
    (["--drought", "g4dn.xlarge=20"], "provider.droughts_s given for a type that is not a candidate: g4dn.xlarge"),
    (["--on-demand-quota", "g4dn.xlarge=2"], "on_demand_quota given for a type that is not a candidate: g4dn.xlarge"),
    (["--capacity", "p3.2xlarge=CAPACITY"], "g3.csv:3: negative available count -1"),
    (["--capacity", "p3.2xlarge=/no/such/trace.csv"], "/no/such/trace.csv"),
    (["--provider", "aws", "--trace", "", "--drought", "p3.2xlarge=20"], "emulated on the local provider only"),
])
def test_bad_market_options_are_one_line_before_anything_starts(argv, fragment, tmp_path, capsys):
    trace = tmp_path / "g3.csv"
    trace.write_text("seconds,available\n0,2\n10,-1\n20,0\n")
    argv = [a.replace("CAPACITY", str(trace)) for a in argv]
    status = run_status([*argv, "--artifacts", str(tmp_path / "artifacts")])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and fragment in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "artifacts").exists()
