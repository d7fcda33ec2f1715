"""One owner per folder: an exclusive lock (flock) on a file in it, held for a command's life.

Two commands on one run would each adopt the other's processes and delete the other's control
files; with the lock, the second is refused in one line naming the holder. The kernel drops the
lock when its holder exits, however it exits (SIGKILL included), so a crashed command never
leaves a run locked; the processes a command starts do not inherit it (close_fds)."""
from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from tasks.core.errors import UserInputError

LOCK_FILE = "owner.lock"  # holds the owner's pid, for the refusal's words


class FolderLock:
    def __init__(self, folder: Path, what: str):
        self.path = Path(folder) / LOCK_FILE
        self.what = what
        self._fd: int | None = None

    def __enter__(self) -> "FolderLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW and O_NONBLOCK: a link or a FIFO put in the lock's place is refused, never followed or waited on
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UserInputError(f"{self.path} is not a regular file; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 20, 0).decode(errors="replace").strip()
                raise UserInputError(f"{self.what} is in use by another command (pid {holder or 'unknown'}); "
                                     "wait for it to end, or stop it first") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (unlinking it would race a new owner)
            self._fd = None
