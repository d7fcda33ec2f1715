"""Checkpoints hold tensors and plain data only: a crafted one is refused with one line before
anything starts, and a run whose checkpoints cannot be read never silently starts afresh."""
import hashlib
import io
import os
import threading

import pytest
import torch

from tasks.cli.main import main
from tasks.runtime import checkpoint


class _RunsCommand:
    """What an attacker pickles: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _write_crafted(directory, version, marker):
    """A checkpoint file with a valid header and checksum whose payload runs a command."""
    buffer = io.BytesIO()
    torch.save({"version": version, "evil": _RunsCommand(marker)}, buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest().encode()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{version:09d}.pt"
    path.write_bytes(checkpoint.MAGIC + digest + b"\n" + payload)
    return path


def test_crafted_checkpoint_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    checkpoint.save_checkpoint(tmp_path / "ck", 1, {"version": 1, "w": torch.ones(2)})
    crafted = _write_crafted(tmp_path / "ck", 2, marker)
    with pytest.raises(checkpoint.UnsafeCheckpointError, match="refused"):
        checkpoint.load_checkpoint(crafted)
    with pytest.raises(checkpoint.UnsafeCheckpointError):  # no quiet fallback to version 1 either
        checkpoint.load_latest(tmp_path / "ck")
    assert not marker.exists()
    assert crafted.exists()  # left for the operator to look at


def test_plain_state_roundtrips_under_weights_only(tmp_path):
    state = {"version": 3, "params": torch.arange(6.0), "optimizer": {"state": {0: {"step": torch.tensor(2.0)}},
             "param_groups": [{"lr": 0.1, "params": [0]}]}, "workload_options": {"width": 2, "noise": 0.5},
             "smoothed_loss": None, "workload": "resnet20"}
    checkpoint.save_checkpoint(tmp_path, 3, state)
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded["workload_options"] == {"width": 2, "noise": 0.5} and torch.equal(loaded["params"], state["params"])


def test_a_failed_resume_stays_an_error_on_the_next_start(tmp_path):
    (tmp_path / "ckpt-000000001.pt").write_bytes(checkpoint.MAGIC + b"0" * 64 + b"\ntruncated")
    for _ in range(2):  # the second start must not find an empty folder and start afresh
        with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint"):
            checkpoint.load_latest(tmp_path)
    (tmp_path / "ckpt-000000001.pt").rename(tmp_path / "ckpt-000000001.pt.corrupt")
    with pytest.raises(checkpoint.CheckpointError, match="only 1 corrupted"):
        checkpoint.load_latest(tmp_path)


def test_train_refuses_a_crafted_checkpoint_before_starting_anything(tmp_path, capsys):
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "artifacts" / "resume-me"
    _write_crafted(run_dir / "checkpoints", 5, marker)
    status = main(["train", "--workload", "resnet20", "--workload-opt", "width=2", "--workers", "p3.2xlarge=1",
                   "--batch-size", "4", "--max-updates", "3", "--run-id", "resume-me",
                   "--artifacts", str(tmp_path / "artifacts")])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and "refused" in err, err
    assert not marker.exists()
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "owner.lock"]  # no logs, no instance table


def test_a_fifo_among_the_checkpoints_is_set_aside_not_waited_on(tmp_path):
    checkpoint.save_checkpoint(tmp_path, 1, {"version": 1})
    os.mkfifo(tmp_path / "ckpt-000000002.pt")  # nobody ever writes into it: opening it to read would block
    found = {}
    loader = threading.Thread(target=lambda: found.update(state=checkpoint.load_latest(tmp_path)), daemon=True)
    loader.start()
    loader.join(timeout=120)  # a hang guard only
    assert not loader.is_alive(), "load_latest waited on a FIFO"
    assert found["state"] == {"version": 1}
    assert (tmp_path / "ckpt-000000002.pt.corrupt").exists()
    with pytest.raises(checkpoint.CheckpointError, match="is not a regular file"):
        checkpoint.load_checkpoint(tmp_path / "ckpt-000000002.pt.corrupt")


def test_partial_writes_of_a_killed_writer_are_removed_and_nothing_else(tmp_path):
    kept = checkpoint.save_checkpoint(tmp_path, 1, {"version": 1})
    partial = tmp_path / ".ckpt-000000002.pt.k3x9q.tmp"
    partial.write_bytes(checkpoint.MAGIC + b"half")
    other = tmp_path / ".notes.tmp"
    other.write_text("mine")
    assert checkpoint.remove_partial_writes(tmp_path) == [partial]
    assert not partial.exists() and kept.exists() and other.exists()
    assert checkpoint.remove_partial_writes(tmp_path / "absent") == []
