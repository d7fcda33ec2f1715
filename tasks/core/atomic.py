"""Atomic file writes: a reader sees the old file or the new one, never half of one."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes, *, fsync: bool = True, mode: int = 0o644) -> Path:
    """fsync=False: the data may still be in the page cache at a power cut (a file rewritten at
    every poll, worth nothing after one, need not wait for the disk). mode: the file's permissions
    (0o600 for what only its owner may read, a checkpoint's parameters)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = True) -> Path:
    return atomic_write_bytes(path, text.encode(), fsync=fsync)


def atomic_write_json(path: str | Path, obj: object) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def fsync_dir(directory: str | Path) -> None:
    """Make the renames into `directory` durable: call it before deleting what a new file
    replaces (a checkpoint's predecessors), or a power cut may leave neither."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
