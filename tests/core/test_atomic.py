"""Atomic writes (tasks/core/atomic.py): the one writer every module uses."""
import os

import pytest

from tasks.core.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text, fsync_dir


@pytest.mark.parametrize("fsync", [True, False])
def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path, fsync):
    path = tmp_path / "new" / "table.json"
    atomic_write_text(path, "old", fsync=fsync)
    atomic_write_text(path, "new", fsync=fsync)
    assert path.read_text() == "new" and os.listdir(path.parent) == ["table.json"]
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = atomic_write_json(tmp_path / "plan.json", {"a": 1})
    with pytest.raises(ValueError):  # NaN is not JSON
        atomic_write_json(path, {"a": float("nan")})
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")
    assert path.read_text() == '{\n  "a": 1\n}\n' and os.listdir(tmp_path) == ["plan.json"]
    fsync_dir(tmp_path)
