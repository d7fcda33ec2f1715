"""Consistent checkpoints of sharded parameter servers (`num_ps` = k > 1): epochs and cuts.

Each worker pushes every gradient to all k shards, and each shard applies it on its own, so two
shards can see different workers' pushes in different orders. A checkpoint is only useful if every
shard's checkpoint holds exactly the same pushes: otherwise a shard restarted from its checkpoint
would lack an update the others kept.

The scheme (a Chandy-Lamport cut carried by the workers):
- Every push carries an epoch tag: the largest epoch any shard advertised to that worker. Shard 0
  (the leader) opens a new epoch every `checkpoint_every_updates` updates or `checkpoint_every_s`
  seconds by advertising epoch + 1; the other shards advertise the largest tag they have seen.
- A shard applies pushes tagged with its current epoch e. A push tagged later waits until every
  worker connected to the shard has sent a push tagged later than e (or left). At that moment the
  shard holds exactly the pushes tagged <= e, on every shard alike: it takes the cut of epoch e
  (ckpt-<e>.pt, written at once), moves to the next epoch and lets the waiting pushes in.
- A stop is a cut too: the leader advertises a stop epoch; at that cut every shard stops, and the
  waiting pushes are answered STOP, applied nowhere.
- Restart: a PS shard resumes from the newest cut that every shard has on disk (each keeps its
  newest CUTS_KEPT). Restarting one shard alone would leave the others ahead of it, so the
  driver restarts all k together (driver.restart_ps): the survivors roll back to that same cut.
The cost: at each cut a worker may wait for the slowest worker's next push. A worker that dies
halfway through pushing to the shards (killed between two sends) can leave that one push on some
shards only; the next cut carries it as it is.
"""
from __future__ import annotations

import threading
from pathlib import Path

from tasks.runtime import checkpoint

CUTS_KEPT = 3  # a shard's newest durable cut can trail another's by two


def shard_dir(run_dir: Path, shard: int) -> Path:
    """Where shard `shard` keeps its telemetry, checkpoints and ps.json: shard 0 in the run
    directory itself (so single-PS runs look as before), others in shards/<i>/."""
    return run_dir if shard == 0 else run_dir / "shards" / str(shard)


class EpochCut:
    """One shard's side of the scheme. Every method but `advertised` runs under the PS's lock."""

    def __init__(self, ps):
        self.ps = ps
        self.leader = ps.config.shard == 0
        self.cond = threading.Condition(ps.lock)
        self.epoch = 1  # pushes tagged with this epoch are applied now
        self.proposed = 1  # the leader's next epoch; the others: the largest tag seen
        self.stop_epoch = 0  # 0: no stop decided
        self.stop_reason: str | None = None
        self.tags: dict[int, int] = {}  # connected worker -> epoch tag of its latest push (0: none yet)

    def advertised(self) -> tuple[int, int]:
        """(epoch, stop epoch) for a reply header; workers tag their next push with the largest."""
        return max(self.epoch, self.proposed, self.stop_epoch), self.stop_epoch

    def resume_after(self, cut_epoch: int) -> None:
        self.epoch = self.proposed = cut_epoch + 1

    def joined(self, worker_id: int) -> None:
        with self.cond:
            self.tags[worker_id] = 0

    def left(self, worker_id: int) -> None:
        with self.cond:
            self.tags.pop(worker_id, None)
            self._advance()

    def propose(self, stop_reason: str | None = None) -> None:
        """The leader opens the next epoch (a cut), or decides the stop cut."""
        if stop_reason:
            if not self.stop_epoch:
                self.stop_epoch, self.stop_reason = max(self.epoch, self.proposed) + 1, stop_reason
        elif self.proposed <= self.epoch:
            self.proposed = self.epoch + 1
        self._advance()

    def stop_if_idle(self, reason: str) -> None:
        """A follower told to stop with no worker connected: nothing can reach it any more."""
        if not self.tags:
            self.stop_epoch, self.stop_reason = self.stop_epoch or self.epoch + 1, self.stop_reason or reason
            self._advance()

    def admit(self, worker_id: int, tag: int, stop_epoch: int) -> bool:
        """Wait until the epoch of this push is open; False when the PS stopped meanwhile (the
        push is not applied)."""
        self.tags[worker_id] = max(self.tags.get(worker_id, 0), tag)
        self.proposed = max(self.proposed, tag)
        if stop_epoch and not self.stop_epoch:
            self.stop_epoch, self.stop_reason = stop_epoch, "leader_stop"
        self._advance()
        while tag > self.epoch and not self.ps.stopping:
            self.cond.wait(timeout=1.0)
        return not self.ps.stopping

    def _advance(self) -> None:
        """Take the cut when every connected worker has moved past the current epoch."""
        target = min(self.tags.values()) if self.tags else max(self.proposed, self.stop_epoch)
        if target <= self.epoch:
            return
        self.ps.cut(self.epoch)
        self.epoch = target
        if self.stop_epoch and self.epoch >= self.stop_epoch:
            self.ps.stopping = self.ps.stopping or self.stop_reason
        self.cond.notify_all()

    def load_common_cut(self) -> dict | None:
        """This shard's state at the newest cut every shard has on disk; None when there is none."""
        config = self.ps.config
        found = [{checkpoint.number_of(p) for p in checkpoint.list_checkpoints(shard_dir(config.run_dir, i) / "checkpoints")}
                 for i in range(config.num_shards)]
        common = set.intersection(*found)
        if not common:
            return None
        return checkpoint.load_checkpoint(checkpoint.path_of(self.ps.checkpoint_dir, max(common)))
