"""The pull in pieces (tasks/runtime/pull.py): forward never reads a tensor before its piece has
landed, however it reaches it, and most pieces land while forward already runs."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tasks.runtime import flat
from tasks.runtime.pieces import pieces, pull_order
from tasks.runtime.pull import Puller
from tasks.runtime.wire import LinkLost


def test_the_pull_sends_the_pieces_holding_buffers_first():
    cut = pieces(100, 30)  # (0, 30) (30, 60) (60, 90) (90, 100)
    assert pull_order(cut, param_numel=70) == [2, 3, 0, 1]
    assert pull_order(cut, param_numel=100) == [0, 1, 2, 3]
    assert pull_order(cut, param_numel=0) == [0, 1, 2, 3]


class Arrival:
    """A receive whose bytes arrive only when it is waited for: a tensor read before its wait
    would hold the previous step's values."""

    def __init__(self, log: list, tensor: torch.Tensor, values: torch.Tensor):
        self.log, self.tensor, self.values = log, tensor, values

    def wait(self):
        self.tensor.copy_(self.values)
        self.log.append(self)

    def is_completed(self):
        return False


class ArrivingLink:
    """Delivers `source` (the whole new state vector) into the pieces received from it."""

    def __init__(self, log: list, source: torch.Tensor, state: torch.Tensor):
        self.log, self.source, self.state = log, source, state

    def start_recv(self, tensor, tag=0):
        lo = (tensor.data_ptr() - self.state.data_ptr()) // tensor.element_size()
        return Arrival(self.log, tensor, self.source[lo:lo + tensor.numel()])


@torch.jit.script
def _scripted_linear(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return h @ weight.t()


class Tied(nn.Module):
    """A BatchNorm at the start (its statistics live at the vector's end), a stack of layers whose
    last bias the parent reads before the first layer runs, and a head that reads the embedding's
    weight from the parent's forward (tied weights)."""

    def __init__(self, hidden: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.BatchNorm1d(8).eval()  # normalizes with its pulled statistics
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.hidden = nn.Linear(8, 8) if hidden else None  # read where torch functions cannot see it

    def forward(self, tokens):
        h = self.norm(self.embed(tokens)) + self.layers[-1].bias
        for layer in self.layers:
            h = layer(h).tanh()
        if self.hidden is not None:
            h = _scripted_linear(h, self.hidden.weight)
        return F.linear(h, self.embed.weight)


def _steps(model: nn.Module, steps: int, shards: int = 2):
    """Pull fresh random state into `model` `steps` times through a Puller on links that deliver
    each piece only when waited for; per step the forward output, the output the same state gives
    when it is all in place first, and how many pieces had landed when the first layer ran."""
    bound = flat.bind(model)
    ranges = flat.shard_ranges(bound.layout.numel, shards)
    puller = Puller(bound, ranges, bound.state, piece_numel=40)
    log: list = []
    landed_at_first_layer = []
    model.layers[0].register_forward_pre_hook(lambda *_: landed_at_first_layer.append(len(log)))
    tokens = torch.randint(0, 16, (5,))
    results = []
    for step in range(steps):
        source = torch.rand(bound.layout.numel) + 0.5  # a valid variance for the statistics too
        links = [ArrivingLink(log, source, bound.state) for _ in ranges]
        log.clear()
        landed_at_first_layer.clear()
        puller.start(links)
        with puller.landing():
            out = model(tokens)
        assert len(log) == len(puller.pieces)  # every piece landed by the end of forward
        out.sum().backward()
        assert torch.equal(bound.state, source)
        with torch.no_grad():
            expected = model(tokens)  # the same forward with the whole pull in place
        results.append((out.detach(), expected, landed_at_first_layer[0]))
        model.zero_grad(set_to_none=False)
    return puller, results


@pytest.mark.parametrize("hidden", [False, True])
def test_forward_reads_every_tensor_only_after_its_piece_has_landed(hidden):
    """With `hidden`, forward also hands a weight to a TorchScript function, a read the mode cannot
    see: the probe finds that weight unread, so its pieces land before forward starts."""
    torch.manual_seed(0)
    model = Tied(hidden=hidden)
    puller, results = _steps(model, steps=3)
    assert puller.overlap is True
    total = len(puller.pieces)
    for step, (out, expected, landed_before_first_layer) in enumerate(results):
        assert torch.equal(out, expected)  # nothing read before it arrived, tied head included
        if step == 0:
            assert landed_before_first_layer == total  # the probe: the pull lands before forward
        else:
            assert landed_before_first_layer < total / 2  # most of it lands while forward runs


@pytest.mark.parametrize("wrap", [torch.compile, torch.jit.script])
def test_a_compiled_or_scripted_model_lands_its_pull_before_forward(wrap):
    model = nn.Sequential(nn.Linear(4, 4), wrap(nn.Linear(4, 4)))
    bound = flat.bind(model)
    assert Puller(bound, [(0, bound.layout.numel)], bound.state, piece_numel=8).overlap is False


@pytest.mark.parametrize("shards", [1, 3])
def test_the_arrival_order_takes_each_shards_buffers_first_and_the_shards_in_turn(shards):
    model = Tied()
    bound = flat.bind(model)
    ranges = flat.shard_ranges(bound.layout.numel, shards)
    puller = Puller(bound, ranges, bound.state, piece_numel=40)
    assert sorted(puller.order) == list(range(len(puller.pieces)))
    firsts = [puller.pieces[j] for j in puller.order[:shards]]
    assert [p.shard for p in firsts] == list(range(shards))
    last_shard_first = firsts[-1]
    assert last_shard_first.hi > bound.layout.param_numel  # the buffers' piece leads its shard


def test_the_mode_is_left_once_every_piece_has_landed():
    """After the last piece lands, later torch functions run without the mode (it costs
    microseconds each), and nothing of it outlives forward."""
    from torch.nn.modules.module import _global_forward_pre_hooks
    from torch.overrides import _get_current_function_mode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    bound = flat.bind(model)
    puller = Puller(bound, [(0, bound.layout.numel)], bound.state, piece_numel=10_000)  # one piece
    mode_on_at_last_layer = []
    model[2].register_forward_pre_hook(lambda *_: mode_on_at_last_layer.append(_get_current_function_mode() is not None))
    log: list = []
    for _ in range(2):  # the probe, then a pull that overlaps
        puller.start([ArrivingLink(log, torch.randn(bound.layout.numel), bound.state)])
        with puller.landing():
            out = model(torch.randn(2, 4))
        out.sum().backward()
        assert _get_current_function_mode() is None and not _global_forward_pre_hooks
    assert mode_on_at_last_layer == [True, False]  # the probe notes reads throughout


class HeldLink(ArrivingLink):
    """Delivers into a host buffer of its own, each piece only once `released` is set and
    `arrive_s` after the one before (a slow link: a reader that did not wait would find old
    values); a piece at `broken` fails as a lost connection does."""

    def __init__(self, log, source, host, released: "threading.Event", broken: int | None = None, arrive_s: float = 0.0):
        super().__init__(log, source, host)
        self.released, self.broken, self.arrive_s, self.posted = released, broken, arrive_s, 0

    def start_recv(self, tensor, tag=0):
        arrival, released, fails = super().start_recv(tensor, tag), self.released, self.posted == self.broken
        arrive_s = self.arrive_s
        self.posted += 1

        class Held:
            def wait(self):
                released.wait()
                time.sleep(arrive_s)
                if fails:
                    raise RuntimeError("Connection closed by peer")
                arrival.wait()
        return Held()


def _threaded(model: nn.Module, shards: int = 2):
    bound = flat.bind(model)
    ranges = flat.shard_ranges(bound.layout.numel, shards)
    host = torch.empty_like(bound.state)
    return bound, ranges, host, Puller(bound, ranges, host, piece_numel=40, threaded=True)


def test_the_lander_thread_lands_each_piece_before_forward_reads_it():
    """The CUDA path's thread (threaded on the CPU: a host copy stands for the bus copy): after
    the probe step (whose pull lands before forward) the pieces arrive only once forward has
    started, so forward waits for the thread at its reads; what it computes is what the whole
    pull in place gives."""
    torch.manual_seed(0)
    model = Tied()
    bound, ranges, host, puller = _threaded(model)
    tokens = torch.randint(0, 16, (5,))
    try:
        for step in range(3):
            source = torch.rand(bound.layout.numel) + 0.5
            released, log = threading.Event(), []
            if step == 0:
                released.set()
            handle = model.register_forward_pre_hook(lambda *_: released.set())
            puller.start([HeldLink(log, source, host, released, arrive_s=0.002) for _ in ranges])
            with puller.landing():
                out = model(tokens)
            handle.remove()
            assert len(log) == len(puller.pieces)
            assert torch.equal(bound.state, source)
            with torch.no_grad():
                assert torch.equal(out.detach(), model(tokens))
            out.sum().backward()
    finally:
        puller.close()


def test_a_receive_the_lander_thread_loses_is_a_lost_link_where_forward_reads_and_the_next_pull_lands():
    torch.manual_seed(0)
    model = Tied()
    bound, ranges, host, puller = _threaded(model, shards=1)
    tokens = torch.randint(0, 16, (5,))
    try:
        for _ in range(2):  # the probe, then a pull that overlaps forward
            released = threading.Event()
            released.set()
            puller.start([HeldLink([], torch.rand(bound.layout.numel) + 0.5, host, released)])
            with puller.landing():
                model(tokens)
        released = threading.Event()
        released.set()
        puller.start([HeldLink([], torch.rand(bound.layout.numel) + 0.5, host, released, broken=2)])
        with pytest.raises(LinkLost, match="closed by peer"), puller.landing():
            model(tokens)
        source = torch.rand(bound.layout.numel) + 0.5  # the rejoin's pull
        puller.start([HeldLink([], source, host, released)])
        puller.land_all()
        assert torch.equal(bound.state, source)
    finally:
        puller.close()


def test_a_bus_copy_the_lander_thread_fails_is_the_workers_own_failure_not_a_lost_link(monkeypatch):
    from tasks.runtime.push import BusCopyFailed

    model = Tied()
    bound, ranges, host, puller = _threaded(model, shards=1)

    def fails(piece):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(puller, "_copy_in", fails)
    released = threading.Event()
    released.set()
    try:
        puller.start([HeldLink([], torch.rand(bound.layout.numel), host, released)])
        with pytest.raises(BusCopyFailed, match="illegal memory access"), puller.landing():
            model(torch.randint(0, 16, (5,)))
    finally:
        puller.close()


def test_a_threaded_pull_needs_a_host_buffer_of_its_own():
    bound = flat.bind(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="host buffer of its own"):
        Puller(bound, [(0, bound.layout.numel)], bound.state, piece_numel=8, threaded=True)


def test_close_ends_the_lander_thread():
    bound = flat.bind(nn.Linear(4, 4))
    before = {t for t in threading.enumerate() if t.name == "pull"}
    puller = Puller(bound, [(0, bound.layout.numel)], torch.empty_like(bound.state), piece_numel=8, threaded=True)
    (thread,) = {t for t in threading.enumerate() if t.name == "pull"} - before
    puller.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
