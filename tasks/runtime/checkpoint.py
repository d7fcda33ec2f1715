"""PS checkpoints: written atomically, verified on load, the previous good one always kept.

A checkpoint is one file `ckpt-<version>.pt`: a magic line, the SHA-256 of the payload, a newline,
then the payload (torch.save of a dict). It is written atomically and fsynced (tasks.core.atomic),
and the folder is fsynced before older files are pruned, so a crash leaves either the old set or
the new one. The newest `KEEP` files are kept. Loading takes the newest file that verifies; one
that does not is renamed to `*.corrupt` and reported, and the one before it is used. When none
verifies, or only `*.corrupt` files are left, loading is an error the user sees: a run never
silently starts afresh over a checkpoint it could not read.

The payload is read with torch.load(weights_only=True): tensors and plain data only. A checksum
proves only that the file is intact, not who wrote it; a payload that would need a pickle global
(a crafted file whose __reduce__ runs a command) is refused outright, with no fallback.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Callable

import torch

from tasks.core.atomic import atomic_write_bytes, fsync_dir
from tasks.core.errors import UserInputError

MAGIC = b"SPOTFILL-CHECKPOINT-1\n"
KEEP = 2
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_PARTIAL = re.compile(r"^\.ckpt-\d+\.pt\..+\.tmp$")  # tasks.core.atomic's temporary name for one


class CheckpointError(UserInputError):
    """A checkpoint that cannot be used: truncated, altered, or not a checkpoint."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint whose payload holds more than tensors and plain data (it could run code)."""


def path_of(directory: Path, version: int) -> Path:
    return directory / f"ckpt-{version:09d}.pt"


def number_of(path: Path) -> int:
    """The version (or, for a sharded PS, the epoch) a checkpoint file is named after."""
    return int(_NAME.match(path.name).group(1))


def number_in(name: str) -> int | None:
    """The number in a checkpoint file name, or None for any other name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def save_checkpoint(directory: Path, version: int, state: dict, keep: int = KEEP) -> Path:
    """Write `state` as the checkpoint of `version`; prune all but the newest `keep`."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest().encode()
    path = atomic_write_bytes(path_of(directory, version), MAGIC + digest + b"\n" + payload, mode=0o600)
    fsync_dir(directory)
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files, oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def remove_partial_writes(directory: Path) -> list[Path]:
    """Delete the temporary files of checkpoint writes that never finished (a PS killed while
    writing: the rename never came); the one writer of the folder calls it before it resumes."""
    if not directory.is_dir():
        return []
    partial = [p for p in directory.iterdir() if _PARTIAL.match(p.name)]
    for path in partial:
        path.unlink(missing_ok=True)
    return partial


def read_regular(path: Path) -> bytes:
    """A file's bytes, when it is a regular file: a FIFO is neither waited on (O_NONBLOCK) nor read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"checkpoint {path} is not a regular file")
        return f.read()


def load_checkpoint(path: Path) -> dict:
    """The state in `path`, or CheckpointError naming what is wrong with it."""
    data = read_regular(path)
    if not data.startswith(MAGIC):
        raise CheckpointError(f"checkpoint {path} is not a spotfill checkpoint (bad header)")
    header_end = data.find(b"\n", len(MAGIC))
    digest = data[len(MAGIC):header_end]
    payload = data[header_end + 1:]
    if header_end < 0 or hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupted (SHA-256 mismatch: truncated or altered)")
    try:
        return torch.load(io.BytesIO(payload), weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).splitlines()[-1].strip()[:160] if str(err) else "unsupported global"
        raise UnsafeCheckpointError(
            f"checkpoint {path} refused: it holds more than tensors and plain data ({reason})") from None
    except (RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} cannot be read ({str(err).splitlines()[0][:160]})") from None


def load_latest(directory: Path, on_corrupt: Callable[[Path, str], None] | None = None, *,
                quarantine: bool = True) -> dict | None:
    """The newest checkpoint that verifies (None when the folder holds no checkpoint at all).

    A corrupted one before a good one is renamed to *.corrupt (quarantine=False: left as it is)
    and reported through `on_corrupt`. CheckpointError when none verifies or only *.corrupt files
    are left; UnsafeCheckpointError at once for a payload that is not tensors and plain data."""
    failed: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(directory)):
        try:
            state = load_checkpoint(path)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as err:
            failed.append((path, str(err)))
            continue
        for bad, error in failed:
            if quarantine:
                os.replace(bad, bad.with_name(bad.name + ".corrupt"))
            if on_corrupt:
                on_corrupt(bad, error)
        return state
    if failed:
        raise CheckpointError(f"no usable checkpoint in {directory}: {failed[0][1]} (and {len(failed) - 1} more); "
                              "move the folder away to start afresh")
    corrupt = sorted(directory.glob("ckpt-*.pt.corrupt")) if directory.is_dir() else []
    if corrupt:
        raise CheckpointError(f"no usable checkpoint in {directory}: only {len(corrupt)} corrupted one(s) "
                              f"such as {corrupt[-1].name}; move the folder away to start afresh")
    return None
