"""`spotfill cleanup --provider local`: the instances of a run whose process crashed (no atexit,
no cleanup) are found in the run's table and terminated."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tasks.cli.main import main
from tasks.providers.local import LocalProvider
from tests.helpers import REPO

CRASHING_RUN = textwrap.dedent("""
    import os, sys
    from tasks.providers.base import Startup
    from tasks.providers.local import LocalProvider
    provider = LocalProvider(artifacts_dir=sys.argv[1])
    provider.launch("crashed-run", "p0", "p3.2xlarge", 1, startup=Startup(("python", "-c", "import time; time.sleep(60)")))
    os._exit(1)  # a crash: no atexit, no cleanup
""")


@pytest.mark.integration
def test_cleanup_command_terminates_a_crashed_local_run(tmp_path, capsys):
    subprocess.run([sys.executable, "-c", CRASHING_RUN, str(tmp_path)], cwd=REPO, timeout=300, check=False)
    assert len(LocalProvider(artifacts_dir=tmp_path).describe("crashed-run")) == 1
    assert main(["cleanup", "--run-id", "crashed-run", "--provider", "local", "--artifacts", str(tmp_path), "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert (reply["provider"], reply["terminated"]) == ("local", 1)
    assert LocalProvider(artifacts_dir=tmp_path).describe("crashed-run") == []


def test_an_instance_table_of_the_wrong_shape_is_one_line_naming_it(tmp_path, capsys):
    from tasks.core.errors import UserInputError

    table = tmp_path / "r1" / "instances.json"
    table.parent.mkdir()
    for text, fragment in (("{}", "is not one spotfill wrote"), ("[]", "is not one spotfill wrote"),
                           ('{"instances": [{"pid": 1}], "events": [], "next_id": 0}', "is not one spotfill wrote"),
                           ("", "not valid JSON")):
        table.write_text(text)
        assert main(["cleanup", "--run-id", "r1", "--provider", "local", "--artifacts", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(table) in err and fragment in err, err
    table.write_text("{}")
    with pytest.raises(UserInputError, match="is not one spotfill wrote"):
        LocalProvider(tmp_path).describe("r1")



def _crashed_run_without_start_ticks(tmp_path) -> int:
    subprocess.run([sys.executable, "-c", CRASHING_RUN, str(tmp_path)], cwd=REPO, timeout=300, check=False)
    table = tmp_path / "crashed-run" / "instances.json"
    data = json.loads(table.read_text())
    data["instances"][0]["start_ticks"] = None  # as launch records a child that had already exited
    table.write_text(json.dumps(data))
    return data["instances"][0]["pid"]


def _cleanup_terminated(tmp_path, capsys) -> int:
    assert main(["cleanup", "--run-id", "crashed-run", "--provider", "local", "--artifacts", str(tmp_path),
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)["terminated"]


@pytest.mark.integration
def test_a_row_whose_start_was_not_recorded_is_not_alive_and_its_pid_is_left_alone(tmp_path, capsys):
    """Such a child had exited when launch recorded it: its pid, gone, is no sign of life, and if
    the pid is another process's by now (the sleeper stands in for it) nothing is sent to it."""
    import os
    import signal

    pid = _crashed_run_without_start_ticks(tmp_path)
    try:
        assert _cleanup_terminated(tmp_path, capsys) == 0
        os.kill(pid, 0)  # still there: no signal went to a process the table cannot vouch for
    finally:
        os.killpg(pid, signal.SIGKILL)
    gone = tmp_path / "gone"
    pid = _crashed_run_without_start_ticks(gone)
    os.killpg(pid, signal.SIGKILL)
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]:
        os.sched_yield()
    assert _cleanup_terminated(gone, capsys) == 0  # not "1 terminated" for a process that is not there
    assert LocalProvider(artifacts_dir=gone).describe("crashed-run") == []


@pytest.mark.integration
def test_a_hand_edited_table_of_another_run_does_not_stop_this_runs_cleanup(tmp_path, capsys):
    subprocess.run([sys.executable, "-c", CRASHING_RUN, str(tmp_path)], cwd=REPO, timeout=300, check=False)
    good = json.loads((tmp_path / "crashed-run" / "instances.json").read_text())
    for run_id, change in (("deadline-text", {"notice_deadline_s": "soon"}), ("id-list", {"instance_id": ["i-1"]}),
                           ("pid-bool", {"pid": True})):
        (tmp_path / run_id).mkdir()
        row = {**good["instances"][0], "run_id": run_id, **change}
        (tmp_path / run_id / "instances.json").write_text(json.dumps({**good, "instances": [row]}))
        assert main(["cleanup", "--run-id", run_id, "--provider", "local", "--artifacts", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not one spotfill wrote" in err and run_id in err
    assert _cleanup_terminated(tmp_path, capsys) == 1
    assert LocalProvider(artifacts_dir=tmp_path).describe("crashed-run") == []


def test_an_option_of_the_other_provider_is_refused_and_artifacts_mean_local(tmp_path, capsys):
    """Ignored, `--region` on a local clean-up or `--artifacts` on AWS would hide what the user meant;
    `--artifacts DIR` alone looks for the run there, not on AWS."""
    for argv, fragment in ((["--provider", "local", "--region", "us-east-1"], "--region is for the aws provider"),
                           (["--provider", "local", "--wait"], "--wait is for the aws provider"),
                           (["--provider", "aws", "--artifacts", str(tmp_path)], "--artifacts is for the local provider"),
                           (["--artifacts", str(tmp_path), "--endpoint-url", "http://127.0.0.1:1"],
                            "--endpoint-url is for the aws provider, but run nope is cleaned up on local")):
        assert main(["cleanup", "--run-id", "nope", "--missing-ok", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, err
    assert main(["cleanup", "--run-id", "nope", "--artifacts", str(tmp_path), "--missing-ok", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["provider"] == "local"
