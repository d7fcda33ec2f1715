"""Where the run registry lives: never in whatever folder a command starts from."""
from pathlib import Path

import pytest

from tasks.providers import run_registry


@pytest.mark.parametrize("xdg, expected", [
    ("/srv/state", Path("/srv/state/spotfill")),
    ("state", None),  # relative: ignored, as the XDG spec asks
    ("./", None),
    ("", None),
])
def test_state_dir_takes_only_an_absolute_xdg_state_home(monkeypatch, tmp_path, xdg, expected):
    monkeypatch.delenv("SPOTFILL_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", xdg)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert run_registry.state_dir() == (expected or tmp_path / ".local" / "state" / "spotfill")
    assert run_registry.state_dir().is_absolute()
