"""`spotfill cleanup --provider local`: the instances of a run whose process crashed (no atexit,
no cleanup) are found in the run's table and terminated."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tasks.cli import main
from tasks.providers.local import LocalProvider

REPO = Path(__file__).resolve().parents[1]

CRASHING_RUN = textwrap.dedent("""
    import os, sys
    from tasks.providers.base import Startup
    from tasks.providers.local import LocalProvider
    provider = LocalProvider(artifacts_dir=sys.argv[1])
    provider.launch("crashed-run", "p0", "p3.2xlarge", 1, startup=Startup(("python", "-c", "import time; time.sleep(60)")))
    os._exit(1)  # a crash: no atexit, no cleanup
""")


def test_cleanup_command_terminates_a_crashed_local_run(tmp_path, capsys):
    subprocess.run([sys.executable, "-c", CRASHING_RUN, str(tmp_path)], cwd=REPO, timeout=300, check=False)
    assert len(LocalProvider(artifacts_dir=tmp_path).describe("crashed-run")) == 1
    assert main(["cleanup", "--run-id", "crashed-run", "--provider", "local", "--artifacts", str(tmp_path), "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert (reply["provider"], reply["terminated"]) == ("local", 1)
    assert LocalProvider(artifacts_dir=tmp_path).describe("crashed-run") == []


def test_an_instance_table_of_the_wrong_shape_is_one_line_naming_it(tmp_path, capsys):
    import pytest

    from tasks.errors import UserInputError

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
