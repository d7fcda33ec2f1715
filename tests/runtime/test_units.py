"""Fast unit tests of the runtime's plain parts: workloads, checkpoints, shaping, telemetry."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from tasks.core.errors import UserInputError
from tasks.runtime import checkpoint
from tasks.runtime.ps import ParameterServer, PsConfig
from tasks.runtime.shaping import Shaper, TokenBucket
from tasks.runtime.telemetry import TelemetryReader, TelemetryWriter
from tasks.runtime.workloads import build_workload, parse_options


def _train(spec, options, batch_size, steps):
    torch.set_num_threads(1)
    plain = build_workload(spec, options).plain_steps(batch_size)
    return [next(plain) for _ in range(steps)]


@pytest.mark.parametrize("spec,options,batch,steps", [
    ("resnet20", {"width": 2}, 16, 25),
    ("transformer-lm", {"d_model": 32}, 16, 40),
])
def test_builtin_workloads_learn(spec, options, batch, steps):
    losses = _train(spec, options, batch, steps)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.85 * first, losses


def test_resnet_family_depths_and_classes():
    for depth, blocks in ((20, 9), (56, 27), (110, 54)):
        model = build_workload(f"resnet{depth}", {"width": 2}).model
        assert len(model.stages) == blocks
    assert build_workload("resnet32-cifar100", {"width": 2}).model.head.out_features == 100


def test_plugin_workload(tmp_path, monkeypatch):
    (tmp_path / "my_workload.py").write_text(
        "import torch\n"
        "def build(hidden=8):\n"
        "    model = torch.nn.Linear(4, 2)\n"
        "    def batches(batch_size, seed):\n"
        "        g = torch.Generator().manual_seed(seed)\n"
        "        while True:\n"
        "            x = torch.randn(batch_size, 4, generator=g)\n"
        "            yield x, (x[:, 0] > 0).long()\n"
        "    return model, batches, torch.nn.functional.cross_entropy\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    w = build_workload("my_workload:build", parse_options(["hidden=3"]))
    assert w.name == "my_workload:build"
    x, y = next(w.batches(5, 0))
    assert w.loss_fn(w.model(x), y).item() > 0


@pytest.mark.parametrize("spec,message", [
    ("resnet21", "unknown workload 'resnet21'"),
    ("no_such_module_xyz:build", "cannot import"),
    ("json:no_such_function", "has no function"),
])
def test_bad_workloads_are_user_errors(spec, message):
    with pytest.raises(UserInputError, match=message):
        build_workload(spec)


def test_bad_workload_options():
    with pytest.raises(UserInputError, match="key=value"):
        parse_options(["width"])
    with pytest.raises(UserInputError, match="rejects options"):
        build_workload("resnet20", {"colour": 3})


def test_checkpoint_roundtrip_keeps_two_and_rejects_corruption(tmp_path):
    for version in (1, 2, 3):
        checkpoint.save_checkpoint(tmp_path, version, {"version": version, "w": torch.arange(4.0)})
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-000000002.pt", "ckpt-000000003.pt"]
    newest = checkpoint.list_checkpoints(tmp_path)[-1]
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="corrupted"):
        checkpoint.load_checkpoint(newest)
    reported = []
    state = checkpoint.load_latest(tmp_path, on_corrupt=lambda path, err: reported.append(path))
    assert state["version"] == 2 and reported == [newest]
    assert newest.with_name(newest.name + ".corrupt").exists()
    assert checkpoint.list_checkpoints(tmp_path)[-1].name == "ckpt-000000002.pt"  # the good one is kept
    assert not list(tmp_path.glob(".ckpt-*.tmp"))


def test_checkpoint_all_corrupt_is_a_clear_error(tmp_path):
    (tmp_path / "ckpt-000000001.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="bad header"):
        checkpoint.load_latest(tmp_path)


def test_ps_resumes_from_previous_checkpoint_when_newest_is_corrupt(tmp_path):
    config = PsConfig(run_dir=tmp_path, port=0, workload="resnet20", workload_options={"width": 2})
    ps = ParameterServer(config)
    for version in (4, 9):
        ps.version = ps.updates_total = version
        ps.write_checkpoint()
    newest = checkpoint.list_checkpoints(tmp_path / "checkpoints")[-1]
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated by a crash of the disk
    resumed = ParameterServer(config)
    assert resumed.resume() and resumed.version == 4
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert "corrupt_checkpoint" in kinds and kinds[-1] == "resume"
    other = PsConfig(run_dir=tmp_path, port=0, workload="resnet20", workload_options={"width": 4})
    with pytest.raises(UserInputError, match="is for workload"):
        ParameterServer(other).resume()


def test_token_bucket_paces_and_shares():
    bucket = TokenBucket(rate_bytes_per_s=1e6, burst_bytes=0)
    first = bucket.reserve(100_000)
    second = bucket.reserve(100_000)
    assert second - first == pytest.approx(0.1, abs=0.02)
    shaper = Shaper(ps_mbps=8.0)  # 1 MB/s shared
    shaper.add_worker(1, nic_mbps=None)
    shaper.add_worker(2, nic_mbps=None)
    waited = {}
    threads = [threading.Thread(target=lambda w=w: waited.__setitem__(w, shaper.transfer(w, 200_000))) for w in (1, 2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start >= 0.3  # 400 kB through 1 MB/s, shared
    assert Shaper(None).transfer(1, 10**9) == 0.0


def test_worker_nic_limits_alone():
    shaper = Shaper(ps_mbps=None)
    shaper.add_worker(7, nic_mbps=8.0)
    assert shaper.transfer(7, 150_000) >= (150_000 - 65_536) / 1e6  # less the initial burst


def test_telemetry_reader_tails_and_resets_on_resume(tmp_path):
    writer = TelemetryWriter(tmp_path)
    reader = TelemetryReader(tmp_path, loss_smoothing=0.5)
    writer.write("join", worker=1, instance_type="a")
    base = dict(instance_type="a", samples=8, compute_s=0.1, comm_s=0.02, base_version=0, staleness=0, lr=0.1)
    writer.write("update", worker=1, step=0, loss=2.0, version=1, samples_total=8, updates_total=1, **base)
    writer.write("update", worker=1, step=1, loss=1.0, version=2, samples_total=16, updates_total=2, **base)
    p = reader.poll()
    assert (p.updates_total, p.samples_total, p.smoothed_loss) == (2, 16, 1.5)
    assert p.workers[1].last_step_s == pytest.approx(0.12)
    with open(tmp_path / "telemetry.jsonl", "a") as f:
        f.write('{"t": 1, "kind": "upd')  # half a line: read on a later poll
    assert reader.poll().updates_total == 2
    writer.close()
    with open(tmp_path / "telemetry.jsonl", "a") as f:
        f.write('ate_ignored_kind"}\n' + json.dumps({"t": 2, "kind": "resume", "version": 1, "updates_total": 1,
                                                    "samples_total": 8}) + "\n")
    p = reader.poll()
    assert (p.resumes, p.samples_total, p.workers[1].left) == (1, 8, "ps_restart")
    with open(tmp_path / "telemetry.jsonl", "a") as f:
        f.write('{"t": 3, "kind": "upd')  # a PS killed mid-write
    TelemetryWriter(tmp_path).write("stop", reason="test")  # the next PS ends the torn line first
    p = reader.poll()
    assert (p.stopped, reader.torn_lines) == ("test", 1)


def _dead_pid() -> int:
    """A pid no process has: pids stay below pid_max (no process started to get one)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def test_in_process_ps_and_worker_and_orchestrator_watch(tmp_path):
    """The worker loop against a PS in this process: ASP updates, listener phases in order, the
    exact count of accepted samples; then both notice that their orchestrator is gone."""
    from tasks.runtime import wire
    from tasks.runtime.driver import free_port
    from tasks.runtime.worker import WorkerConfig, run_worker

    port = free_port()
    ps = ParameterServer(PsConfig(run_dir=tmp_path, port=port, workload="resnet20", workload_options={"width": 2}))
    served = {}
    thread = threading.Thread(target=lambda: served.setdefault("reason", ps.serve(wire.host_store(port, 30))))
    thread.start()
    phases = []

    class Recorder:
        def compute_start(self, step): phases.append(("compute_start", step))
        def compute_end(self, step): phases.append(("compute_end", step))
        def comm_start(self, step): phases.append(("comm_start", step))
        def comm_end(self, step): phases.append(("comm_end", step))

    try:
        config = WorkerConfig("127.0.0.1", port, "resnet20", 4, {"width": 2}, max_steps=3, connect_timeout_s=10)
        result = run_worker(config, listener=Recorder())
        assert (result.reason, result.steps, result.samples_accepted) == ("done", 3, 12)
        assert phases == [(p, s) for s in range(3) for p in ("compute_start", "compute_end", "comm_start", "comm_end")]
        # the worker's own compute failing (CUDA out of memory, say) ends it with that error; it
        # is not a lost PS to rejoin forever
        class FailingCompute(Recorder):
            def compute_start(self, step):
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

        with pytest.raises(RuntimeError, match="out of memory"):
            run_worker(config, listener=FailingCompute())
        config.watch_pid = _dead_pid()
        assert run_worker(config).reason == "terminated"
        ps.config.watch_pid = _dead_pid()
        thread.join(timeout=120)
    finally:
        ps.request_stop("test")
        thread.join(timeout=120)
    assert served["reason"] == "orchestrator_gone"
    assert (ps.version, ps.samples_total) == (3, 12)


def _apply_stale(ps: ParameterServer, base_version: int) -> float:
    """Apply one zero-gradient push computed on `base_version`; the learning rate the PS used."""
    header = torch.tensor([1.0, 0, 8, 2.0, base_version, 0.1, 0.05, 0, 0, 0, -1], dtype=torch.float64)
    assert ps.apply(0, "t", header, torch.zeros(ps.flat_size), batch_size=8)
    return json.loads((ps.config.run_dir / "telemetry.jsonl").read_text().splitlines()[-1])["lr"]


@pytest.mark.parametrize("power", [0.0, 0.5, 1.0])
def test_ps_damps_the_learning_rate_by_staleness(tmp_path, power):
    ps = ParameterServer(PsConfig(run_dir=tmp_path, port=0, workload="transformer-lm",
                                  workload_options={"d_model": 16, "layers": 1}, staleness_lr_power=power))
    base = ps.workload.lr_for_batch(8)
    assert _apply_stale(ps, 0) == pytest.approx(base)  # fresh: staleness 0
    ps.version = 10
    assert _apply_stale(ps, 7) == pytest.approx(base / 4 ** power)  # computed 3 versions ago


def test_prefetched_raises_the_producers_error_ends_with_it_and_stops_when_closed():
    """The CUDA batch pipeline's thread (worker.prefetched): a failing batch source must reach
    the worker as an error, not as a wait forever; a closed consumer must not leave it running."""
    from tasks.runtime.worker import prefetched

    assert list(prefetched(range(5), lambda x: x * 10)) == [0, 10, 20, 30, 40]

    def broken():
        yield 1
        raise ValueError("batch source failed")

    got = prefetched(broken(), lambda x: x)
    assert next(got) == 1
    with pytest.raises(ValueError, match="batch source failed"):
        next(got)

    made = []
    endless = prefetched(iter(int, 1), lambda x: made.append(x) or x)  # iter(int, 1): zeros forever
    next(endless)
    endless.close()
    threads = [t for t in threading.enumerate() if t.name == "prefetch"]
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert len(made) < 10  # it stopped making batches nobody takes


def test_ps_threads_leave_a_small_machines_cores_to_its_workers():
    from tasks.runtime.ps import build_parser, default_threads

    assert [default_threads(n) for n in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    assert build_parser().parse_args(["--run-dir", "x", "--port", "1", "--workload", "tiny", "--threads", "3"]).threads == 3


def test_overhead_row_puts_the_runtime_against_the_plain_step_and_the_link():
    """bench runtime's row for one case: the ratio to the plain loop, and to the step this
    machine's links allow (plain step + bus copies + 2 x vector at the loopback's rate)."""
    from tasks.bench.runtime import TINY, case_result

    updates = [{"comm_s": 0.04, "compute_s": 0.13, "apply_ms_per_mb": 1.0} for _ in range(3)]
    measured = {"plain_step_s": [0.1, 0.1, 0.1], "runtime_step_s": [0.2, 0.2, 0.2], "updates": updates}
    row = case_result(TINY.label, TINY.batch, measured, vector_mb=100.0, loopback=5.0, bus_s=(0.02, 0.01))
    assert row["ratio"] == pytest.approx(0.5)
    assert row["push_pull_gbps"] == pytest.approx(5.0) and row["push_pull_over_loopback"] == pytest.approx(1.0)
    assert row["compute_over_plain_step"] == pytest.approx(1.3)
    assert row["compute_less_bus_over_plain_step"] == pytest.approx(1.1)  # less the pull's copy only
    assert row["link_bound_step_s"] == pytest.approx(0.1 + 0.03 + 0.04)
    assert row["ratio_to_link_bound"] == pytest.approx(0.17 / 0.2)


def test_a_worker_takes_no_id_until_the_ps_has_seeded_its_ids():
    """A restarted PS listens before it re-seeds the id counter from its checkpoint; a worker that
    took an id in between would share it with a worker of the PS's first life (and wait on a link
    the PS never builds). Registration waits for the PS to say it serves."""
    from tasks.runtime import wire
    from tasks.runtime.driver import free_port

    port = free_port()
    store = wire.host_store(port, 30)
    with pytest.raises(RuntimeError):
        wire.register("127.0.0.1", port, {"batch_size": 8}, connect_timeout_s=0.5)
    assert int(store.add(wire.COUNTER_KEY, 0)) == 0  # it took no id
    store.add(wire.COUNTER_KEY, 3)  # what a PS resumed with three workers behind it does first
    store.set(wire.SERVING_KEY, "1")
    worker_id, _ = wire.register("127.0.0.1", port, {"batch_size": 8}, connect_timeout_s=5)
    assert worker_id == 4


def test_bench_cases_each_get_their_own_run_and_the_transformer_a_reference_that_overlaps_nothing():
    from tasks.bench.runtime import CPU_CASES, GPU_CASES

    for cases in (CPU_CASES, GPU_CASES):
        assert len({case.slug for case in cases}) == len(cases)
        assert [case.workload for case in cases if case.with_whole] == ["transformer-lm"]
