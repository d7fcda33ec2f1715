"""PS checkpoints: written atomically, verified on load, the previous good one always kept.

A checkpoint is one file `ckpt-<version>.pt`: a magic line, the SHA-256 of the payload, a newline,
then the payload (torch.save of a dict). It is written to a temporary file in the same folder,
fsynced, and renamed into place (os.replace), so a crash leaves either the old set or the new one.
The newest `KEEP` files are kept. Loading takes the newest file that verifies; one that does not
is renamed to `*.corrupt` and reported, and the one before it is used.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from pathlib import Path
from typing import Callable

import torch

from tasks.errors import UserInputError

MAGIC = b"SPOTFILL-CHECKPOINT-1\n"
KEEP = 2
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


class CheckpointError(UserInputError):
    """A checkpoint that cannot be used: truncated, altered, or not a checkpoint."""


def path_of(directory: Path, version: int) -> Path:
    return directory / f"ckpt-{version:09d}.pt"


def number_of(path: Path) -> int:
    """The version (or, for a sharded PS, the epoch) a checkpoint file is named after."""
    return int(_NAME.match(path.name).group(1))


def save_checkpoint(directory: Path, version: int, state: dict, keep: int = KEEP) -> Path:
    """Write `state` as the checkpoint of `version`; prune all but the newest `keep`."""
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest().encode()
    path = path_of(directory, version)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".ckpt-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + digest + b"\n" + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path) -> dict:
    """The state in `path`, or CheckpointError naming what is wrong with it."""
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise CheckpointError(f"checkpoint {path} is not a spotfill checkpoint (bad header)")
    header_end = data.find(b"\n", len(MAGIC))
    digest = data[len(MAGIC):header_end]
    payload = data[header_end + 1:]
    if header_end < 0 or hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupted (SHA-256 mismatch: truncated or altered)")
    return torch.load(io.BytesIO(payload), weights_only=False)


def load_latest(directory: Path, on_corrupt: Callable[[Path, str], None] | None = None) -> dict | None:
    """The newest checkpoint that verifies (None when there is none). Corrupted ones are renamed
    to *.corrupt and reported through `on_corrupt`; if every one is corrupted, CheckpointError."""
    candidates = list_checkpoints(directory)
    errors: list[str] = []
    for path in reversed(candidates):
        try:
            return load_checkpoint(path)
        except CheckpointError as err:
            errors.append(str(err))
            os.replace(path, path.with_name(path.name + ".corrupt"))
            if on_corrupt:
                on_corrupt(path, str(err))
    if errors:
        raise CheckpointError(f"no usable checkpoint in {directory}: " + "; ".join(errors))
    return None
