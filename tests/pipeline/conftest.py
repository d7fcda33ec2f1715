"""Fixtures of the pipeline's tests."""
from __future__ import annotations

import pytest

from tasks.providers.local import LocalProvider


@pytest.fixture()
def providers_built(monkeypatch) -> list[LocalProvider]:
    """Every LocalProvider constructed while the test runs (threads included): a run builds one."""
    built = []
    construct = LocalProvider.__init__

    def counting(self, *args, **kwargs):
        built.append(self)
        construct(self, *args, **kwargs)

    monkeypatch.setattr(LocalProvider, "__init__", counting)
    return built
