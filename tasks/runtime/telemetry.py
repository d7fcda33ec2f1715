"""Training telemetry as JSON lines, written by the PS and read by the orchestrator while it runs.

File: <run_dir>/telemetry.jsonl, one JSON object a line, appended and flushed as events happen.
Every record has `t` (epoch seconds) and `kind`:
- `update`: one accepted gradient push. Fields: worker, instance_type, step (the worker's
  iteration), samples, loss, compute_s (this iteration's forward/backward, padded to the
  instance's speed), comm_s (the worker's previous iteration's push+pull, measured by the worker;
  null on its first), intra_sum_s (the part of a multi-GPU worker's sum of its replicas'
  gradients this iteration left exposed after compute, inside comm_s; null for one GPU),
  intra_sum_link_s (the seconds that sum held the instance's link, most of it during backward), base_version (the
  version the gradient was computed on), version (the PS version after applying it),
  staleness (version - 1 - base_version), lr, samples_total and updates_total (cluster totals
  after this update), apply_ms and apply_ms_per_mb (the PS's optimizer step for it).
- `join` / `leave`: a worker's membership (`join` has batch_size, the instance's samples per
  iteration, and gpus, its replicas). `leave` has reason: "notice", "stop", "terminated", "rejoin",
  "lost" (the connection broke: the worker died), "ps_stop", "ps_failed" (its handler failed the PS); a reader marks workers still
  connected at a `resume` as left with "ps_restart".
- `checkpoint`: version, samples_total, path, epoch (a sharded PS's cut; null otherwise). `resume`: the PS restarted from a checkpoint
  (version, samples_total); totals continue from there: updates after that checkpoint and before
  the crash are gone.
- `corrupt_checkpoint`: a checkpoint failed verification and was set aside (path, error).
- `evaluation`: the workload's evaluate(model) on a snapshot of the parameters taken at the
  update count `updates_total` (periodic_eval.py): version, snapshot_t (when the snapshot was
  taken), eval_s, metrics ({name: value}), skipped (due evaluations skipped since the previous one
  because it was still running), and with a target metric `target` and `met`.
- `stop`: the PS stopped (reason: max_updates, target_loss, target_metric, stop_file, signal, orchestrator_gone,
  diverged, lease_lapsed, failed: its error is in ps-error.txt beside the telemetry).
A reader tolerates a half-written last line (it is read again on the next poll); a line torn by a
PS killed mid-write is ended by the next PS and skipped by readers (counted in torn_lines).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

FILE_NAME = "telemetry.jsonl"


class TelemetryWriter:
    """Appends records; thread-safe (the PS has a thread per worker)."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / FILE_NAME
        torn = self.path.exists() and self.path.stat().st_size > 0 and not self.path.read_bytes().endswith(b"\n")
        self._file = open(self.path, "a", encoding="utf-8")
        if torn:  # a PS killed mid-write left half a line: end it, readers skip it
            self._file.write("\n")
        self._lock = threading.Lock()

    def write(self, kind: str, **fields) -> None:
        record = {"t": time.time(), "kind": kind, **fields}
        line = json.dumps(record, allow_nan=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class WorkerStats:
    instance_type: str = ""
    gpus: int = 1  # its replicas, one per GPU (replicas.py)
    instance_id: str = ""  # the instance it runs on (its filling metrics file's name)
    updates: int = 0
    samples: int = 0
    last_step_s: float | None = None  # compute_s + comm_s of its latest reported iteration
    max_staleness: int = 0
    left: str | None = None  # the leave reason, once it left


@dataclass
class ClusterProgress:
    """Cluster totals as the orchestrator sees them, from the telemetry so far."""

    updates_total: int = 0
    samples_total: int = 0
    smoothed_loss: float | None = None  # exponential moving average of update losses
    version: int = 0
    resumes: int = 0
    stopped: str | None = None  # the PS's stop reason, once it stopped
    first_update_t: float | None = None
    last_update_t: float | None = None
    workers: dict[int, WorkerStats] = field(default_factory=dict)
    metrics: dict[str, float] | None = None  # the newest evaluation's metrics (periodic_eval.py)
    metrics_updates: int | None = None  # the update count of the parameters they were measured on

    def active_workers(self) -> list[int]:
        return [w for w, s in self.workers.items() if s.left is None]


class TelemetryReader:
    """Tails the telemetry file: each `poll()` reads what was appended since the last one."""

    def __init__(self, run_dir: Path, loss_smoothing: float = 0.1):
        self.path = Path(run_dir) / FILE_NAME
        self.loss_smoothing = loss_smoothing
        self.progress = ClusterProgress()
        self.records: list[dict] = []
        self.torn_lines = 0
        self._offset = 0

    def poll(self) -> ClusterProgress:
        if not self.path.exists():
            return self.progress
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a half-written last line waits for the next poll
        self._offset += end
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self.torn_lines += 1  # half a record from a PS killed mid-write
                continue
            self.records.append(record)
            self._apply(record)
        return self.progress

    def _apply(self, r: dict) -> None:
        p = self.progress
        kind = r["kind"]
        if kind == "update":
            p.updates_total = r["updates_total"]
            p.samples_total = r["samples_total"]
            p.version = r["version"]
            a = self.loss_smoothing
            p.smoothed_loss = r["loss"] if p.smoothed_loss is None else (1 - a) * p.smoothed_loss + a * r["loss"]
            p.first_update_t = p.first_update_t or r["t"]
            p.last_update_t = r["t"]
            w = p.workers.setdefault(r["worker"], WorkerStats(r["instance_type"]))
            w.updates += 1
            w.samples += r["samples"]
            w.max_staleness = max(w.max_staleness, r["staleness"])
            if r["comm_s"] is not None:
                w.last_step_s = r["compute_s"] + r["comm_s"]
        elif kind == "join":
            p.workers.setdefault(r["worker"], WorkerStats(r["instance_type"], gpus=r.get("gpus", 1),
                                                          instance_id=r.get("instance_id") or ""))
        elif kind == "leave":
            p.workers.setdefault(r["worker"], WorkerStats()).left = r["reason"]
        elif kind == "resume":
            for w in p.active_workers():  # their connections died with the old PS
                p.workers[w].left = "ps_restart"
            p.resumes += 1
            p.version = r["version"]
            p.samples_total = r["samples_total"]
            p.updates_total = r["updates_total"]
            p.stopped = None
        elif kind == "evaluation":
            p.metrics, p.metrics_updates = r["metrics"], r["updates_total"]
        elif kind == "stop":
            p.stopped = r["reason"]


def read_records(run_dir: Path) -> list[dict]:
    """Every complete record of a run, in order."""
    reader = TelemetryReader(run_dir)
    reader.poll()
    return reader.records
