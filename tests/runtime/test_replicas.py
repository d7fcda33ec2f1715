"""Multi-GPU workers (tasks/runtime/replicas.py): g replicas in one worker, their gradients summed
inside the instance and pushed once; here on CPU, replicas as threads over gloo in one process."""
from __future__ import annotations

import threading

import pytest
import torch

from tasks.core.errors import UserInputError
from tasks.runtime import flat, wire
from tasks.runtime.driver import free_port
from tasks.runtime.ps import ParameterServer, PsConfig
from tasks.runtime.replicas import pcie_floor_s
from tasks.runtime.telemetry import read_records
from tasks.runtime.worker import WorkerConfig, main, run_worker
from tasks.runtime.workloads import build_workload

SPEC, OPTIONS = "resnet20", {"width": 4}  # SGD: the update is linear in the gradient, so a sum is told from a mean


def _train(tmp_path, gpus: int, batch: int, steps: int, run=run_worker, **config) -> tuple[ParameterServer, torch.Tensor, object]:
    """One worker of `gpus` replicas (`run(config)`) trains against an in-process PS; (PS, its start state, result)."""
    port = free_port()
    ps = ParameterServer(PsConfig(run_dir=tmp_path / "run", port=port, workload=SPEC, workload_options=OPTIONS))
    start_state = ps.state.clone()
    thread = threading.Thread(target=ps.serve, args=(wire.host_store(port, 30),))
    thread.start()
    try:
        result = run(WorkerConfig("127.0.0.1", port, SPEC, batch, OPTIONS, seed=5, gpus=gpus, **config))
    finally:
        ps.request_stop("test")
        thread.join(timeout=60)
    return ps, start_state, result


@pytest.mark.parametrize("gpus", [2, 4])
def test_an_instance_pushes_once_per_iteration_the_mean_of_its_replicas_gradients(tmp_path, gpus):
    batch_per_gpu, steps = 2, 3
    ps, start_state, result = _train(tmp_path, gpus, gpus * batch_per_gpu, steps, max_steps=steps)
    assert result.steps == steps and not any(t.name.startswith("replica-") for t in threading.enumerate())

    records = read_records(tmp_path / "run")
    joins = [r for r in records if r["kind"] == "join"]
    updates = [r for r in records if r["kind"] == "update"]
    assert [(j["gpus"], j["batch_size"]) for j in joins] == [(gpus, gpus * batch_per_gpu)]  # one worker per instance
    assert [u["samples"] for u in updates] == [gpus * batch_per_gpu] * steps
    assert all(u["intra_sum_s"] is not None and u["intra_sum_s"] >= 0 for u in updates)

    # the reference: replica r computes on batches(batch_per_gpu, seed + r) from the same state,
    # the PS applies the replicas' mean as one push of gpus x batch_per_gpu samples
    reference = ParameterServer(PsConfig(run_dir=tmp_path / "ref", port=0, workload=SPEC, workload_options=OPTIONS))
    reference.state.copy_(start_state)
    replicas = []
    for rank in range(gpus):
        workload = build_workload(SPEC, OPTIONS)
        replicas.append((workload, flat.bind(workload.model), workload.batches(batch_per_gpu, 5 + rank)))
    for step in range(steps):
        pushes, losses = [], []
        for workload, bound, batches in replicas:
            bound.state.copy_(reference.state)
            inputs, targets = next(batches)
            loss = workload.loss_fn(workload.model(inputs), targets)
            bound.zero_grad()
            loss.backward()
            pushes.append(bound.fill_push_buffers().clone())
            losses.append(loss.item())
        header = torch.tensor([wire.PUSH, step, gpus * batch_per_gpu, sum(losses) / gpus, step, 0.1, 0.05, 0, 0, 0, 0.0],
                              dtype=torch.float64)
        assert reference.apply(0, "t", header, torch.stack(pushes).sum(0) / gpus, gpus * batch_per_gpu)
    torch.testing.assert_close(ps.state, reference.state, rtol=1e-5, atol=1e-7)
    assert [u["loss"] for u in updates] == pytest.approx(
        [r["loss"] for r in read_records(tmp_path / "ref") if r["kind"] == "update"], rel=1e-5)


@pytest.mark.parametrize("after_backward", [False, True])
def test_the_sum_is_paced_to_the_emulated_pcie_link(tmp_path, after_backward):
    """Its buckets hold the link for at least the PCIe term; started after backward, the iteration
    waits for all of it (started during backward, for what is left: tests/runtime/test_buckets.py)."""
    pcie_mbps = 40.0  # megabits/s: a few tens of milliseconds for this model's vector
    ps, _, _ = _train(tmp_path, 2, 4, 3, max_steps=3, pcie_mbps=pcie_mbps, sum_after_backward=after_backward)
    floor_s = pcie_floor_s(2, ps.flat_size, pcie_mbps)
    assert floor_s > 0.01
    updates = [r for r in read_records(tmp_path / "run") if r["kind"] == "update"]
    assert len(updates) == 3 and min(u["intra_sum_link_s"] for u in updates) >= floor_s
    if after_backward:
        assert min(u["intra_sum_s"] for u in updates) >= floor_s


def test_a_notice_ends_every_replica_with_the_worker(tmp_path):
    notice = tmp_path / "notice"
    notice.write_text("{}")
    _, _, result = _train(tmp_path, 4, 8, 1, notice_file=notice)
    assert result.reason == "notice" and result.steps == 0
    assert not any(t.name.startswith("replica-") for t in threading.enumerate())


def test_a_batch_that_does_not_split_over_the_gpus_is_refused():
    with pytest.raises(UserInputError, match="batch size 6 does not split over 4 GPUs"):
        run_worker(WorkerConfig("127.0.0.1", 1, SPEC, 6, OPTIONS, gpus=4))


def test_a_device_naming_one_gpu_is_refused_for_a_multi_gpu_worker(capfd):
    assert main(["--ps", "127.0.0.1:1", "--workload", SPEC, "--batch-size", "8", "--gpus", "4", "--device", "cuda:1"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["spotfill worker: error: --device cuda:1 names one GPU, but the instance has 4: a multi-GPU worker "
                   "trains on cuda:0..cuda:3 (give --device cuda or auto)"]


def test_a_launch_of_a_multi_gpu_type_on_one_named_gpu_is_refused_before_any_process_starts(tmp_path):
    from tasks.providers.local import LocalProvider
    from tasks.runtime.driver import TrainingRun, add_workers

    provider = LocalProvider(tmp_path)
    run = TrainingRun("r", tmp_path / "r", provider, "127.0.0.1:1", None, SPEC)
    with pytest.raises(UserInputError, match="--device cuda:0 names one GPU, but the instance has 4"):
        add_workers(run, "g3.16xlarge", 1, 16, extra_args=("--device", "cuda:0"))
    assert provider.describe("r") == []


def test_a_replica_that_fails_has_its_error_raised_by_replica_0_and_every_replica_ends():
    from tasks.runtime.replicas import Replicas

    def step(push_complete):
        push_complete()
        return 1.0, None

    def build(rank: int):
        if rank == 2:
            raise RuntimeError("replica 2's GPU is gone")
        return flat.bind(torch.nn.Linear(2, 4)), step

    cpu = torch.device("cpu")
    bound = flat.bind(torch.nn.Linear(2, 4))
    replicas = Replicas(3, [cpu] * 3, bound, None, 30.0, build)
    replicas.hand_out(torch.ones(bound.layout.numel))
    replicas.compute_done()
    with pytest.raises(RuntimeError, match="replica 2's GPU is gone"):
        replicas.sum(1.0)
    replicas.close()
    assert not any(t.name.startswith("replica-") for t in threading.enumerate())

    # replica 0 failing between the hand-out and the sum: close() joins the sum the others wait in
    replicas = Replicas(3, [cpu] * 3, bound, None, 30.0, lambda rank: (flat.bind(torch.nn.Linear(2, 4)), step))
    replicas.hand_out(torch.ones(bound.layout.numel))
    replicas.close()
    assert not any(t.name.startswith("replica-") for t in threading.enumerate())


def test_every_replica_fills_its_own_bubbles_and_the_instance_metrics_sum_them(tmp_path, monkeypatch):
    """g = 2 on CPU with --fill: each replica has its own filler, fed its own phase edges; the
    instance's metrics file (what the report reads) is the sum of both replicas' harvest."""
    import json

    from tasks.filling.attach import CONFIG_ENV
    from tasks.runtime.worker import _LeaveFlag, build_filler, build_parser

    monkeypatch.setenv(CONFIG_ENV, json.dumps({"max_batch": 2, "dataset_size": 32, "calibration_steps": 3,
                                               "online_priority": "normal"}))
    args = build_parser().parse_args(["--ps", "127.0.0.1:1", "--workload", SPEC, "--batch-size", "4", "--gpus", "2",
                                      "--fill", "--fill-online-rate", "0", "--fill-metrics-dir", str(tmp_path / "filling"),
                                      "--instance-id", "i-2gpu"])
    instance, fillers = build_filler(args, "cpu", 2)
    assert len(fillers) == 2
    leave_flag = _LeaveFlag()

    class LeaveOnceBothFilled:
        """Replica 0's edges to the instance's filler; asks the worker to leave once every
        replica's filler has run inference (an event, not a step count)."""

        def __getattr__(self, name):
            return getattr(instance, name)

        def comm_end(self, step: int) -> None:
            instance.comm_end(step)
            if all(f.metrics()["offline_samples"] > 0 for f in fillers):
                leave_flag.set_terminated()

    # the sum paced to ~0.1 s: a bubble far longer than one inference chunk, however loaded the machine
    numel = sum(p.numel() for p in build_workload(SPEC, OPTIONS).model.parameters())
    pcie_mbps = 2 * 2 * numel * 32 / 0.1 / 1e6
    try:
        _, _, result = _train(tmp_path, 2, 4, 0, max_steps=400, pcie_mbps=pcie_mbps,
                              run=lambda config: run_worker(config, listener=LeaveOnceBothFilled(), leave_flag=leave_flag,
                                                            replica_listeners=fillers[1:]))
    finally:
        instance.close()
    assert result.reason == "terminated"
    per_replica = [f.metrics() for f in fillers]
    assert all(m["offline_samples"] > 0 and m["bubbles"] > 0 for m in per_replica)

    written = json.loads((tmp_path / "filling" / "i-2gpu.json").read_text())
    assert written["replicas"] == 2
    for key in ("inference_samples", "offline_samples", "chunks", "bubbles"):
        assert written[key] == sum(m[key] for m in written["per_replica"])
    assert written["offline_samples"] >= sum(m["offline_samples"] for m in per_replica)


def test_one_gpu_takes_the_replicas_path_when_asked_as_bench_gpu_does_on_a_one_gpu_machine(tmp_path):
    _train(tmp_path, 1, 2, 2, max_steps=2, sum_in_instance=True)
    updates = [r for r in read_records(tmp_path / "run") if r["kind"] == "update"]
    assert len(updates) == 2 and all(u["intra_sum_s"] is not None and u["samples"] == 2 for u in updates)
    _train(tmp_path / "plain", 1, 2, 2, max_steps=2)  # without it, the one-GPU path: no sum
    assert [r["intra_sum_s"] for r in read_records(tmp_path / "plain" / "run") if r["kind"] == "update"] == [None, None]
