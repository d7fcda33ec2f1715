"""Shared fixtures. Flow tests ask for `prefect_harness` (one ephemeral Prefect per session, in a
temporary PREFECT_HOME); unit tests never start Prefect, nor any other process or server (the
lanes: tests/README.md). Shared constants and helpers are in tests/helpers.py."""
from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import pytest

# Before anything imports prefect: keep its home (database, settings) out of the user's.
_PREFECT_HOME = tempfile.mkdtemp(prefix="spotfill-prefect-home-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ["SPOTFILL_STATE_DIR"] = tempfile.mkdtemp(prefix="spotfill-state-")  # the run registry: not ~

from tests.helpers import SHIPPED_PROFILE, prefect_servers_tied_to_this_process  # after PREFECT_HOME is set

# How a process starts: subprocess (and asyncio's, os.popen), fork and spawn, multiprocessing.
PROCESS_STARTS = ["subprocess.Popen.__init__", "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp",
                  "multiprocessing.process.BaseProcess.start"]
# Session fixtures that start a server (a Prefect API in a process, moto in a thread).
SERVER_FIXTURES = {"prefect_harness", "moto_endpoint"}


@pytest.fixture(scope="session", autouse=True)
def matplotlib_font_cache():
    """Matplotlib lists the system's fonts with `fc-list` (a process) the first time it draws on a
    machine, then caches them: done here, once, before any unit test refuses processes, so that a
    unit test that plots passes on a fresh machine as on one that has plotted before."""
    from matplotlib import font_manager  # noqa: F401 (loads the cache at import, building it if absent)

    yield


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request, monkeypatch):
    """A test marked neither integration nor slow is a unit test: starting a process fails it, and
    so does asking for a server fixture (fixtures wider than a test are set up before this one:
    they are known by name). Marked tests, and what they set up, are left alone."""
    if request.node.get_closest_marker("integration") or request.node.get_closest_marker("slow"):
        yield
        return
    servers = sorted(SERVER_FIXTURES & set(request.fixturenames))
    if servers:
        pytest.fail(f"unit test started a server: mark it integration ({', '.join(servers)})", pytrace=False)
    elsewhere = []  # attempts from other threads, where a failure would not reach the test

    def refuse(what):
        def refused(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                elsewhere.append(what)
            pytest.fail(f"unit test started a process: mark it integration ({what})", pytrace=False)
        return refused

    for target in PROCESS_STARTS:
        monkeypatch.setattr(target, refuse(target))
    yield
    if elsewhere:
        pytest.fail(f"unit test started a process: mark it integration ({', '.join(elsewhere)})", pytrace=False)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_servers_tied_to_this_process(), prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture()
def shipped_profile_path() -> Path:
    return SHIPPED_PROFILE


@pytest.fixture(scope="session")
def moto_endpoint():
    """moto's EC2 over real HTTP on 127.0.0.1 (strict AMI and type validation), for the whole
    session; boto3 finds moto's fake keys through its default chain (the environment). Tests
    keep apart by run id rather than by resetting moto (a reset reloads its AMI catalog)."""
    from tasks.providers.aws_sandbox import fake_credentials, moto_server

    with fake_credentials(), moto_server() as url:
        yield url


@pytest.fixture(scope="session")
def moto_amis(moto_endpoint) -> dict[str, str]:
    import boto3

    from tasks.providers.aws_sandbox import stock_amis

    return stock_amis(boto3.client("ec2", endpoint_url=moto_endpoint, region_name="us-east-1"))
