"""Shared fixtures. Flow tests ask for `prefect_harness` (one ephemeral Prefect per session, in a
temporary PREFECT_HOME); unit tests never start Prefect."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Before anything imports prefect: keep its home (database, settings) out of the user's.
_PREFECT_HOME = tempfile.mkdtemp(prefix="spotfill-prefect-home-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

REPO = Path(__file__).resolve().parents[1]
SHIPPED_PROFILE = REPO / "profiles" / "resnet110-cifar100.json"


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture()
def shipped_profile_path() -> Path:
    return SHIPPED_PROFILE
