"""The driver's account of a process that exited: its log's last line, or, when it left none
because the disk under the run folder is full, that."""
from __future__ import annotations

import shutil
from collections import namedtuple

from tasks.runtime import driver

Usage = namedtuple("Usage", "total used free")


def test_a_process_that_left_no_log_on_a_full_disk_is_put_down_to_the_disk(tmp_path, monkeypatch):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "i-1.log").write_text("")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(400_000, 400_000, 0))
    assert driver.last_log_line(tmp_path, "i-1") == f"i-1 left no log: the disk holding {tmp_path} is full (0 bytes free)"
    assert driver.last_log_line(tmp_path, "i-2") == f"i-2 left no log: the disk holding {tmp_path} is full (0 bytes free)"


def test_a_log_or_room_to_write_one_says_nothing_of_the_disk(tmp_path, monkeypatch):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "i-1.log").write_text("spotfill worker: error: no data\n\n")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(400_000, 400_000, 0))
    assert driver.last_log_line(tmp_path, "i-1") == "i-1's log ends: spotfill worker: error: no data"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**9, 10**12 - 10**9))
    assert driver.last_log_line(tmp_path, "i-2") == "i-2 left no log"
