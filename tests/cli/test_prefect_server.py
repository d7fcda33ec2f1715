"""Prefect servers die with whoever started them: `spotfill run`'s temporary server and the test
harness's, even when their starter is killed outright (a test run killed part way, its shell gone)."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO, children_of, process_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STARTERS = {
    "spotfill's temporary server": """
import sys, time
from pathlib import Path
from tasks.cli.prefect_server import temporary_server
with temporary_server(Path(sys.argv[1]) / "server.log"):
    print("ready", flush=True)
    time.sleep(600)
""",
    "the test harness's server": """
import time
from prefect.testing.utilities import prefect_test_harness
from tests.helpers import prefect_servers_tied_to_this_process
with prefect_servers_tied_to_this_process(), prefect_test_harness(server_startup_timeout=180):
    print("ready", flush=True)
    time.sleep(600)
""",
}


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The starter's next line, or "" when it says nothing in time (or exits)."""
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    return process.stdout.readline() if ready else ""


@pytest.mark.parametrize("starter", sorted(STARTERS))
def test_a_prefect_server_dies_with_a_starter_killed_outright(starter, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")} | {
        "PREFECT_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", STARTERS[starter], str(tmp_path)], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=open(tmp_path / "starter.log", "wb"), text=True,
                               start_new_session=True)
    servers: list[int] = []
    try:
        assert _read_line(process, 240) == "ready\n", (tmp_path / "starter.log").read_text()[-2000:]
        servers = children_of(process.pid)
        assert servers, "the starter runs no server process"
        exits = [os.pidfd_open(pid) for pid in servers]  # readable once the process has exited
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        for pid, exit_ in zip(servers, exits):
            ready, _, _ = select.select([exit_], [], [], 30)
            os.close(exit_)
            assert ready and not process_alive(pid), f"{starter} (pid {pid}) outlived its starter"
    finally:
        for pid in [process.pid, *servers]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
