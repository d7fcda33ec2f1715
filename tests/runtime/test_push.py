"""The push in pieces (tasks/runtime/push.py): what leaves during backward, and that the PS gets
exactly the gradient a whole-vector push would have carried."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tasks.runtime import flat
from tasks.runtime.pieces import pieces
from tasks.runtime.push import Pusher


@pytest.mark.parametrize("numel,size", [(10, 3), (9, 3), (1, 5), (0, 4), (7, 7)])
def test_pieces_cover_the_range_in_order(numel, size):
    cut = pieces(numel, size)
    assert [lo for lo, _ in cut] == list(range(0, numel, size))
    assert all(0 < hi - lo <= size for lo, hi in cut)
    assert (cut[-1][1] if cut else 0) == numel
    with pytest.raises(ValueError):
        pieces(numel, 0)


class _Done:
    def wait(self):
        pass


class FakeLink:
    """Records each send: its tag, a copy of what was sent, and whether backward was running."""

    def __init__(self, clock: dict):
        self.clock, self.sent = clock, []

    def start_send(self, tensor, tag=0):
        self.sent.append((tag, tensor.clone(), self.clock["in_backward"]))
        return _Done()


class Shared(nn.Module):
    """Four layers; with `reentrant`, the first layer's weight is used both inside a reentrant
    checkpoint segment and outside it, so its gradient accumulates twice in one backward."""

    def __init__(self, reentrant: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.reentrant = reentrant

    def forward(self, x):
        first = self.layers[0]
        if self.reentrant:
            x = checkpoint(lambda y: first(y).relu(), x, use_reentrant=True)
        x = first(x).relu()
        for layer in self.layers[1:]:
            x = layer(x).relu()
        return x.sum()


def _pushes(model: nn.Module, shards: int, steps: int, before_step=lambda step: None, threaded: bool = False):
    """Run `steps` pushes through a Pusher on fake links; per step, what each link got.
    `threaded`: through the CUDA path's sender thread, a host copy standing for the bus copy."""
    bound = flat.bind(model)
    clock = {"in_backward": False}
    links = [FakeLink(clock) for _ in range(shards)]
    ranges = flat.shard_ranges(bound.layout.numel, shards)
    host = torch.empty_like(bound.push) if threaded else bound.push
    pusher = Pusher(bound, ranges, host, piece_numel=20, threaded=threaded)
    try:
        return _run_pushes(model, bound, pusher, links, ranges, steps, before_step, clock)
    finally:
        pusher.close()


def _run_pushes(model, bound, pusher, links, ranges, steps, before_step, clock):
    shards = len(links)
    out = []
    for step in range(steps):
        for link in links:
            link.sent.clear()
        before_step(step)
        pusher.start(links, [torch.tensor([1.0])] * shards)
        loss = model(torch.randn(3, 8, requires_grad=True))
        bound.zero_grad()
        clock["in_backward"] = True
        loss.backward()
        clock["in_backward"] = False
        bound.fill_push_buffers()
        pusher.compute_done()
        pusher.finish([torch.tensor([2.0])] * shards)
        out.append(([list(link.sent) for link in links], bound.push.clone(), ranges, pusher.dropped))
    return out


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_pieces_leave_during_backward_from_the_second_push_and_carry_the_final_gradient(shards, threaded):
    """Threaded (the CUDA path's sender thread): the same pieces, each once, each the final
    gradient; when the thread sends them is its own, so only the hooks' path is timed."""
    torch.manual_seed(0)
    for step, (sent, push, ranges, dropped) in enumerate(_pushes(Shared(), shards, steps=3, threaded=threaded)):
        early = 0
        for shard, (lo, hi) in enumerate(ranges):
            messages = sent[shard]
            assert messages[0][1].tolist() == [1.0] and messages[-1][1].tolist() == [2.0]  # header first, trailer last
            body = messages[1:-1]
            cut = pieces(hi - lo, 20)
            assert sorted(tag for tag, _, _ in body) == list(range(1, len(cut) + 1))  # each piece once
            for tag, tensor, _ in body:
                a, b = cut[tag - 1]
                assert torch.equal(tensor, push[lo + a:lo + b])  # what left is the final gradient
            early += sum(in_backward for _, _, in_backward in body)
        assert not dropped
        if threaded:
            continue
        if step == 0:
            assert early == 0  # the first push only counts accumulations
        else:
            assert early >= 2  # the last layers' pieces left while backward still ran


def _early_sends(run) -> int:
    return sum(in_backward for messages in run[0] for _, _, in_backward in messages)


def test_a_gradient_that_accumulates_twice_keeps_the_push_after_backward(capfd):
    torch.manual_seed(0)
    runs = _pushes(Shared(reentrant=True), shards=2, steps=3)
    assert [_early_sends(run) for run in runs] == [0, 0, 0]
    assert not any(run[3] for run in runs)  # nothing left early, nothing to drop
    assert "accumulates more than once" in capfd.readouterr().err


def test_the_sender_thread_drops_the_same_push_and_a_threaded_push_needs_a_host_buffer_of_its_own(capfd):
    torch.manual_seed(0)
    model = Shared()
    runs = _pushes(model, shards=2, steps=4, before_step=lambda step: setattr(model, "reentrant", step >= 2),
                   threaded=True)
    assert [run[3] for run in runs] == [False, False, True, False]
    bound = flat.bind(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="host buffer of its own"):
        Pusher(bound, [(0, bound.layout.numel)], bound.push, piece_numel=8, threaded=True)


def test_a_second_accumulation_after_a_piece_left_drops_that_push(capfd):
    """Data-dependent control flow: the shared weight is first reused at the third push, after
    early sending began. That push is dropped (the PS will not apply it); later ones leave after
    backward."""
    torch.manual_seed(0)
    model = Shared()
    runs = _pushes(model, shards=1, steps=4, before_step=lambda step: setattr(model, "reentrant", step >= 2))
    assert [run[3] for run in runs] == [False, False, True, False]
    assert _early_sends(runs[1]) > 0 and _early_sends(runs[3]) == 0
    assert "this push is dropped" in capfd.readouterr().err


def test_the_ps_does_not_apply_a_dropped_push(tmp_path):
    from tasks.runtime import wire
    from tasks.runtime.ps import ParameterServer, PsConfig

    ps = ParameterServer(PsConfig(run_dir=tmp_path, port=0, workload="resnet20", workload_options={"width": 2}))
    before = ps.state.clone()
    header = torch.tensor([wire.PUSH, 0, 8, 2.0, 0, 0.1, 0.05, wire.DROPPED, 0, 0, -1], dtype=torch.float64)
    assert not ps.apply(0, "t", header, torch.ones(ps.flat_size), batch_size=8)
    assert torch.equal(ps.state, before) and (ps.version, ps.samples_total) == (0, 0)
    header[7] = 0.0
    assert ps.apply(0, "t", header, torch.ones(ps.flat_size), batch_size=8) and ps.version == 1


@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_a_push_whose_loss_is_not_finite_is_not_applied_and_stops_the_run_as_diverged(tmp_path, loss, num_shards):
    from tasks.runtime import wire
    from tasks.runtime.ps import ParameterServer, PsConfig
    from tasks.runtime.telemetry import read_records

    servers = [ParameterServer(PsConfig(run_dir=tmp_path, port=0, workload="resnet20", workload_options={"width": 2},
                                        shard=shard, num_shards=num_shards)) for shard in range(num_shards)]
    for ps in servers:
        before = ps.state.clone()
        header = torch.tensor([wire.PUSH, 0, 8, loss, 0, 0.1, 0.05, 0, 0, 0, -1], dtype=torch.float64)
        assert not ps.apply(0, "t", header, torch.ones(ps.flat_size), batch_size=8)
        assert torch.equal(ps.state, before) and (ps.version, ps.samples_total) == (0, 0)
        (record,) = [r for r in read_records(ps.dir) if r["kind"] == "diverged"]
        assert record["loss"] == repr(loss)
    leader = servers[0]
    if num_shards == 1:
        assert leader.stopping == "diverged"
    else:  # the leader stops every shard at its next cut; no shard applied the push
        assert leader.epochs.stop_reason == "diverged"


@pytest.mark.parametrize("num_shards", [1, 2])
def test_the_ps_applies_exactly_the_pieced_push(tmp_path, num_shards):
    """A worker's pushes, sent in pieces to real PS processes' code over gloo, give the PS the
    state a whole-vector push would: the same as applying the worker's gradients directly."""
    from tasks.runtime import wire
    from tasks.runtime.driver import free_port
    from tasks.runtime.ps import ParameterServer, PsConfig
    from tasks.runtime.worker import WorkerConfig, run_worker
    from tasks.runtime.workloads import build_workload

    spec, options, batch, steps = "transformer-lm", {"d_model": 32, "layers": 2}, 4, 3
    ports = [free_port() for _ in range(num_shards)]
    servers = [ParameterServer(PsConfig(run_dir=tmp_path / "run", port=port, workload=spec, workload_options=options,
                                        shard=i, num_shards=num_shards)) for i, port in enumerate(ports)]
    start_state = torch.cat([ps.state.clone() for ps in servers])
    threads = [threading.Thread(target=ps.serve, args=(wire.host_store(port, 30),)) for ps, port in zip(servers, ports)]
    for thread in threads:
        thread.start()
    try:
        config = WorkerConfig("127.0.0.1", ports[0], spec, batch, options, seed=5, max_steps=steps,
                              more_ps=[("127.0.0.1", p) for p in ports[1:]], piece_mb=0.004)  # 1000 elements
        assert run_worker(config).steps == steps
    finally:
        for ps in servers:
            ps.request_stop("test")
        for thread in threads:
            thread.join(timeout=60)
    got = torch.cat([ps.state for ps in servers])

    # the reference: the same batches, each gradient applied whole by one PS
    reference = ParameterServer(PsConfig(run_dir=tmp_path / "ref", port=0, workload=spec, workload_options=options))
    reference.state.copy_(start_state)
    workload = build_workload(spec, options)
    bound = flat.bind(workload.model)
    batches = workload.batches(batch, 5)
    for step in range(steps):
        bound.state.copy_(reference.state)
        inputs, targets = next(batches)
        loss = workload.loss_fn(workload.model(inputs), targets)
        bound.zero_grad()
        loss.backward()
        header = torch.tensor([1.0, step, batch, loss.item(), step, 0.1, 0.05, 0, 0, 0, -1], dtype=torch.float64)
        assert reference.apply(0, "t", header, bound.fill_push_buffers().clone(), batch)
    assert torch.equal(got, reference.state)
