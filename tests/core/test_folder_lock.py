"""One owner per folder: a second holder is refused in one line naming the first's pid; the lock
goes with its holder; a lock file that is not a regular file is refused, never followed or
waited on."""
import os

import pytest

from tasks.core.errors import UserInputError
from tasks.core.folder_lock import LOCK_FILE, FolderLock


def test_a_second_owner_is_refused_until_the_first_lets_go(tmp_path):
    with FolderLock(tmp_path / "run", "run r") as first:
        assert first.path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(UserInputError, match=rf"^run r is in use by another command \(pid {os.getpid()}\)"):
            with FolderLock(tmp_path / "run", "run r"):
                pass
    with FolderLock(tmp_path / "run", "run r"):  # released: taken again
        pass


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_file_that_is_not_regular_is_refused(tmp_path, kind):
    (os.mkfifo if kind == "fifo" else os.mkdir)(tmp_path / LOCK_FILE)
    with pytest.raises((UserInputError, IsADirectoryError), match="not a regular file|Is a directory"):
        with FolderLock(tmp_path, "run r"):
            pass


def test_a_link_in_the_lock_files_place_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILE).symlink_to(target)
    with pytest.raises(OSError):
        with FolderLock(tmp_path / "run", "run r"):
            pass
    assert target.read_text() == "keep"
