"""Multi-process runtime tests: a real PS and real workers on torch.distributed (gloo), launched
through the local provider. Small model, short runs, every wait bounded."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tasks.providers.local import LocalProvider, _proc_start_ticks
from tasks.runtime import checkpoint, driver
from tasks.runtime.telemetry import read_records

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WORKLOAD = "resnet20"
OPTIONS = {"width": 4}
TYPES = ("p3.2xlarge", "g4dn.4xlarge")


@pytest.fixture()
def provider(tmp_path):
    p = LocalProvider(tmp_path, terminate_grace_s=15.0)
    yield p
    p.kill_all_started()


def _pids(provider, run_id):
    return [r["pid"] for r in provider._load(run_id)["instances"]]


def _assert_all_gone(provider, run_id):
    for pid in _pids(provider, run_id):
        assert _proc_start_ticks(pid) is None, f"process {pid} outlived the run"


def _wait_gone(pid, timeout_s):
    deadline = time.monotonic() + timeout_s
    while _proc_start_ticks(pid) is not None:
        assert time.monotonic() < deadline, f"process {pid} outlived SIGKILL by {timeout_s} s"
        time.sleep(0.05)


def _updates(run_dir):
    return [r for r in read_records(run_dir) if r["kind"] == "update"]


def _assert_exact_accounting(run_dir):
    """Each accepted update counted once: contiguous versions, unique (worker, step), totals."""
    updates = _updates(run_dir)
    assert [u["version"] for u in updates] == list(range(1, len(updates) + 1))
    assert len({(u["worker"], u["step"]) for u in updates}) == len(updates)
    assert updates[-1]["samples_total"] == sum(u["samples"] for u in updates)
    return updates


def _start(provider, run_id, **kw):
    return driver.start_run(provider, run_id, WORKLOAD, workload_options=OPTIONS, ps_type="p3.2xlarge",
                            checkpoint_every_s=60.0, **kw)


def test_asp_workers_join_and_leave(provider):
    run = _start(provider, "asp", async_rule="momentum")  # its learning rate moves with the batch only
    try:
        first = driver.add_workers(run, TYPES[0], 1, batch_size=8).instances + \
            driver.add_workers(run, TYPES[1], 1, batch_size=16).instances
        driver.wait_for(run, lambda p: len(p.workers) == 2 and min(w.updates for w in p.workers.values()) >= 4, 60)
        provider.terminate([first[0].instance_id])  # leaves cleanly after its step
        late = driver.add_workers(run, TYPES[0], 1, batch_size=8, plan_id="p1").instances[0]
        driver.wait_for(run, lambda p: len(p.workers) == 3 and min(w.updates for w in p.workers.values()) >= 3, 60)
        assert driver.add_workers(run, TYPES[0], 1, batch_size=8, plan_id="p1").instances[0] == late  # idempotent
        final = driver.stop_run(run)
    finally:
        provider.cleanup(run.run_id)
    updates = _assert_exact_accounting(run.run_dir)
    assert final.stopped == "stop_file"
    records = read_records(run.run_dir)
    leaves = {r["worker"]: r["reason"] for r in records if r["kind"] == "leave"}
    assert sorted(leaves.values()) == ["ps_stop", "ps_stop", "terminated"]
    # linear scaling in the batch; the `momentum` rule does not damp the learning rate
    undamped = {u["samples"]: set() for u in updates}
    for u in updates:
        undamped[u["samples"]].add(round(u["lr"], 12))
    assert len(undamped[8]) == len(undamped[16]) == 1
    assert undamped[16].pop() == pytest.approx(2 * undamped[8].pop())
    assert max(u["staleness"] for u in updates) >= 1  # asynchronous: others updated in between
    assert all(u["staleness"] >= 0 for u in updates)
    _assert_all_gone(provider, "asp")


def test_worker_killed_and_worker_revoked_with_notice_while_the_run_goes_on(provider):
    """One worker is killed mid-run (kill -9), another gets a revocation notice; the third
    carries on, and every accepted sample is counted exactly once."""
    run = _start(provider, "faults")
    try:
        killed, survivor = driver.add_workers(run, TYPES[0], 2, batch_size=8).instances
        (noticed,) = driver.add_workers(run, TYPES[1], 1, batch_size=8).instances
        driver.wait_for(run, lambda p: len(p.workers) == 3 and min(w.updates for w in p.workers.values()) >= 2, 60)
        os.killpg(provider.pid_of("faults", killed.instance_id), signal.SIGKILL)
        notice = provider.inject_revocation("faults", noticed.instance_id, notice_s=30.0)
        before = run.progress().updates_total
        progress = driver.wait_for(run, lambda p: sorted(filter(None, (w.left for w in p.workers.values())))
                                   == ["lost", "notice"] and p.updates_total >= before + 6, 60)
        assert progress.stopped is None  # the run went on without them
        deadline = time.monotonic() + 20
        while noticed.instance_id in [i.instance_id for i in provider.describe("faults")] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert time.time() < notice.deadline_s  # it left (exit 0) before it would have been taken
        assert noticed.instance_id not in [i.instance_id for i in provider.describe("faults")]
        assert [e.kind for e in provider.poll_events("faults")] == ["revocation_notice"]
        driver.stop_run(run)
    finally:
        provider.cleanup(run.run_id)
    updates = _assert_exact_accounting(run.run_dir)
    assert "left (notice)" in (run.run_dir / "logs" / f"{noticed.instance_id}.log").read_text()
    last_noticed = max(u["t"] for u in updates if u["instance_type"] == TYPES[1])
    assert any(u["t"] > last_noticed for u in updates)  # the survivor kept training after the notice
    _assert_all_gone(provider, "faults")


def _newest_checkpoint(run_dir) -> int:
    """The version of the newest checkpoint file (-1: none yet)."""
    files = checkpoint.list_checkpoints(run_dir / "checkpoints")
    return int(files[-1].stem.removeprefix("ckpt-")) if files else -1


def test_ps_killed_and_restarted_resumes_from_checkpoint(provider):
    interval = 5
    run = _start(provider, "psfail", checkpoint_every_updates=interval)
    try:
        driver.add_workers(run, TYPES[0], 1, batch_size=8)
        # a checkpoint is written after its update, by the PS's main thread: on a loaded machine
        # several updates may pass first, so wait for the third one's file, not for its update
        driver.wait_for(run, lambda p: _newest_checkpoint(run.run_dir) >= 3 * interval, 90)
        ps_pid = provider.pid_of("psfail", run.ps_instance.instance_id)
        os.killpg(ps_pid, signal.SIGKILL)
        # SIGKILL takes effect when the process is next scheduled: on a loaded machine it may still
        # finish a checkpoint's rename after killpg returns. Read its files once it is gone.
        _wait_gone(ps_pid, timeout_s=60)
        killed_at = max(u["version"] for u in _updates(run.run_dir))
        # The newest checkpoint file is what a restart resumes from; the telemetry's "checkpoint"
        # record may not have been written yet when SIGKILL came (it follows the file).
        checkpointed = _newest_checkpoint(run.run_dir)
        run2 = driver.restart_ps(run, plan_id="ps-restart")
        assert run2.ps_address == run.ps_address
        progress = driver.wait_for(run2, lambda p: p.resumes == 1 and p.updates_total >= checkpointed + 5, 90)
        driver.stop_run(run2)
    finally:
        provider.cleanup("psfail")
    records = read_records(run.run_dir)
    resume = next(r for r in records if r["kind"] == "resume")
    assert resume["version"] == checkpointed >= 3 * interval  # from the newest checkpoint written
    assert checkpointed % interval == 0 and killed_at >= checkpointed
    assert progress.resumes == 1
    after = [r for r in records[records.index(resume):] if r["kind"] == "update"]
    assert [u["version"] for u in after] == list(range(checkpointed + 1, checkpointed + 1 + len(after)))
    assert min(u["worker"] for u in after) > max(u["worker"] for u in _updates(run.run_dir) if u["t"] < resume["t"])
    _assert_all_gone(provider, "psfail")


def _applied_by_shard(run_dir, shards):
    """Per shard: the telemetry's records, and each update keyed by (instance id, worker step)
    (worker ids are each shard's own)."""
    from tasks.runtime.cuts import shard_dir

    out = []
    for shard in range(shards):
        records = read_records(shard_dir(run_dir, shard))
        instance_of = {r["worker"]: r["instance_id"] for r in records if r["kind"] == "join"}
        out.append((records, instance_of))
    return out


def _history(records, instance_of):
    """The updates a shard's state holds at the end: the ones before each resume are cut back to
    the resumed checkpoint's version."""
    kept: list[tuple[str, int]] = []
    versions: list[int] = []
    for r in records:
        if r["kind"] == "update":
            kept.append((instance_of[r["worker"]], r["step"]))
            versions.append(r["version"])
        elif r["kind"] == "resume":
            n = sum(1 for v in versions if v <= r["version"])
            kept, versions = kept[:n], versions[:n]
    return kept


def test_sharded_ps_shard_killed_and_restarted_resumes_from_a_common_cut(provider):
    """k = 2 shards, two workers. Shard 1 is killed; both shards restart from the newest cut they
    both hold; afterwards every update is in both shards' histories or in neither."""
    run = _start(provider, "shards", checkpoint_every_updates=5, num_ps=2)
    try:
        assert len(run.ps_address.split(",")) == 2
        driver.add_workers(run, TYPES[0], 2, batch_size=8)
        driver.wait_for(run, lambda p: p.updates_total >= 16, 120)
        os.killpg(provider.pid_of("shards", run.ps_instances[1].instance_id), signal.SIGKILL)
        run2 = driver.restart_ps(run, plan_id="ps-restart")
        assert run2.ps_address == run.ps_address
        driver.wait_for(run2, lambda p: p.resumes == 1, 120)
        resumed_at = next(r for r in read_records(run.run_dir) if r["kind"] == "resume")["updates_total"]
        driver.wait_for(run2, lambda p: p.updates_total >= resumed_at + 6, 120)
        final = driver.stop_run(run2)
    finally:
        provider.cleanup("shards")
    assert final.stopped == "stop_file"
    (records0, ids0), (records1, ids1) = _applied_by_shard(run.run_dir, 2)
    resumes = [next(r for r in records if r["kind"] == "resume") for records in (records0, records1)]
    assert resumes[0]["epoch"] == resumes[1]["epoch"] >= 1  # the same cut on both
    assert resumes[0]["version"] == resumes[1]["version"]  # holding the same number of updates
    cuts1 = [r["epoch"] for r in records1 if r["kind"] == "checkpoint" and r["t"] < resumes[1]["t"]]
    # The killed shard resumed from a cut of its own (a checkpoint of another layout is refused at
    # load): one it recorded, or the one whose file it had written when the kill came, before the
    # record that follows the file (so a record never names a cut that is not on disk).
    assert resumes[1]["epoch"] in cuts1 or resumes[1]["epoch"] == max(cuts1, default=0) + 1
    history0, history1 = _history(records0, ids0), _history(records1, ids1)
    assert len(history0) > resumes[0]["version"]  # it trained on after the restart
    assert sorted(history0) == sorted(history1)  # no update applied on one shard and lost on the other
    assert len(set(history0)) == len(history0)  # none applied twice
    stops = [[r for r in records if r["kind"] == "stop"][-1] for records in (records0, records1)]
    assert stops[0]["version"] == stops[1]["version"]  # both stopped at the same cut
    finals = [[r for r in records if r["kind"] == "checkpoint"][-1] for records in (records0, records1)]
    assert finals[0]["epoch"] == finals[1]["epoch"] and finals[0]["version"] == finals[1]["version"]
    _assert_all_gone(provider, "shards")
