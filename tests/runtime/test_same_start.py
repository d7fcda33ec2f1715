"""The same start everywhere: a plug-in that does not seed builds the same model and data in every
process, and every worker starts from the PS's parameters whatever its own build made."""
from __future__ import annotations

import random
import threading

import numpy as np
import torch

from tasks.runtime import wire, worker
from tasks.runtime.driver import free_port
from tasks.runtime.ps import ParameterServer, PsConfig
from tasks.runtime.workloads import build_workload

UNSEEDED = "tests.plugins.global_rng:build"  # its data and model from the global generator, seeded nowhere


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_plugin_that_does_not_seed_builds_the_same_model_and_data_each_time():
    """Each process builds the same problem to learn (unseeded, every worker would learn its own:
    on 5 workers the loss stayed near 18 where it falls to 0.03)."""
    first, second = build_workload(UNSEEDED), build_workload(UNSEEDED)
    assert all(torch.equal(a, b) for a, b in zip(_params(first.model), _params(second.model)))
    batch_a, batch_b = next(first.batches(4, 7)), next(second.batches(4, 7))
    assert all(torch.equal(a, b) for a, b in zip(batch_a, batch_b))


def test_building_leaves_the_global_generators_as_they_were():
    """A worker's own randomness (dropout, batches from the global generator) stays its own."""
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    build_workload(UNSEEDED)
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], expected[0]) and np.array_equal(drawn[1], expected[1]) and drawn[2] == expected[2]


def test_every_worker_computes_its_first_step_on_the_parameters_of_the_ps(tmp_path, monkeypatch):
    """A plug-in seeded differently on every build: the worker's own build differs from the PS's,
    and yet its first gradient is computed on the PS's parameters (its first pull)."""
    spec = "tests.plugins.own_seed:build"
    port = free_port()
    ps = ParameterServer(PsConfig(run_dir=tmp_path, port=port, workload=spec))
    ps_start = _params(ps.model)
    built = {}

    def recording_build(name, options):
        workload = build_workload(name, options)
        built["model"], built["own"] = workload.model, _params(workload.model)
        return workload

    monkeypatch.setattr(worker, "build_workload", recording_build)
    first_step = {}

    class FirstStep:
        def compute_start(self, step): pass
        def compute_end(self, step): first_step.setdefault(step, _params(built["model"]))
        def comm_start(self, step): pass
        def comm_end(self, step): pass

    thread = threading.Thread(target=ps.serve, args=(wire.host_store(port, 30),))
    thread.start()
    try:
        config = worker.WorkerConfig("127.0.0.1", port, spec, 8, max_steps=2, connect_timeout_s=10)
        assert worker.run_worker(config, listener=FirstStep()).steps == 2
    finally:
        ps.request_stop("test")
        thread.join(timeout=120)
    assert not all(torch.equal(a, b) for a, b in zip(built["own"], ps_start))  # its own build differs
    assert all(torch.equal(a, b) for a, b in zip(first_step[0], ps_start))
