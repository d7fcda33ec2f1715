"""A worker's pull lands in pieces while forward is already running.

The PS sends its range of the flat state vector (flat.py) as pieces (pieces.py), the pieces holding
buffers first, then the parameters' in order. The worker posts a receive for every piece as the
reply header arrives and starts forward at once: forward reads each parameter or buffer only after
the pieces holding it have landed. Most of a large model's pull then crosses the link while the
first layers compute.

"Before forward reads it" is enforced where torch sees every read: a torch function mode is active
in forward while pieces are in flight, and before any torch function runs it lands the pieces
holding the model's tensors among that function's arguments (it is left at the first module call
after the last piece has landed: it costs some microseconds a function). A module's forward, a parent reading
a child's weight (tied embeddings), a loss of the parameters: every read of a tensor in Python
goes through it. What it cannot see is a read inside TorchScript or a compiled graph: a model with
a TorchScript module or one wrapped by torch.compile always pulls before forward. For what is left
(a scripted function called from forward, a C++ extension), the first step is a probe: its pull
lands whole before forward while the same mode notes what forward reads, and from then on the
pieces holding any tensor it did not see read (read out of its sight, or not at all) land before
forward starts.

On CUDA a landed piece crosses the bus on a copy stream, and the compute stream waits for that copy
(an event) before its next kernel: neither the host nor the compute stream waits on the bus.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from tasks.runtime.flat import FlatModel, synced_tensors
from tasks.runtime.pieces import holding, pull_order, shard_pieces
from tasks.runtime.wire import LinkLost


class _Reads(TorchFunctionMode):
    """Calls `on_read(tensor)` for every tensor argument (and the tensors in a list or tuple
    argument) of every torch function, before the function runs."""

    def __init__(self, on_read):
        super().__init__()
        self.on_read = on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg in itertools.chain(args, kwargs.values()):
            if type(arg) in (list, tuple):
                for item in arg:
                    self.on_read(item)
            else:
                self.on_read(arg)
        return func(*args, **kwargs)


def _opaque(model: torch.nn.Module) -> bool:
    """Whether a part of the model runs where the mode cannot look: a TorchScript module, or one
    wrapped by torch.compile (its OptimizedModule has `_orig_mod`)."""
    return any(isinstance(module, torch.jit.ScriptModule) or hasattr(module, "_orig_mod") for module in model.modules())


class Puller:
    """Receives a worker's pulls into its model, piece by piece, while forward runs.

    `start(links)` once the shards' reply headers said continue (posts every piece's receive);
    forward inside `with landing():` (every piece has landed when it ends). `land_all()` lands
    whatever is in flight (a worker that leaves). A failed receive raises wire.LinkLost."""

    def __init__(self, bound: FlatModel, ranges: list[tuple[int, int]], host_state: torch.Tensor, piece_numel: int):
        self.state, self.host_state = bound.state, host_state
        self.on_cuda = self.state.device.type == "cuda"
        self.pieces = shard_pieces(ranges, piece_numel)
        params, buffers = synced_tensors(bound.model)
        self._pieces_of = {id(t): holding(self.pieces, lo, lo + t.numel())
                           for t, lo in zip(params + buffers, bound.layout.offsets)}
        self.order = self._order(ranges, bound.layout.param_numel)
        self._works: list = [None] * len(self.pieces)  # a piece's receive, until it has landed
        self._in_flight = 0
        self._reads: _Reads | None = None  # the mode, while it is on
        self._leave_hook = None
        self._thread = 0
        self._cursor = 0  # CUDA: where in `order` to look for the next piece that has arrived
        self.overlap = not _opaque(bound.model)
        self._early: list[int] | None = None  # landed before forward (the probe's finding); None: no probe yet
        if self.on_cuda:
            self._copy_stream = torch.cuda.Stream(self.state.device)

    def _order(self, ranges: list[tuple[int, int]], param_numel: int) -> list[int]:
        """The pieces in the order they arrive: each shard's in its pull order, taken in turn."""
        per_shard = []
        for shard, (lo, hi) in enumerate(ranges):
            mine = [j for j, p in enumerate(self.pieces) if p.shard == shard]
            cut = [(self.pieces[j].lo - lo, self.pieces[j].hi - lo) for j in mine]
            per_shard.append([mine[i] for i in pull_order(cut, max(0, min(hi, param_numel) - lo))])
        return [j for turn in itertools.zip_longest(*per_shard) for j in turn if j is not None]

    def start(self, links: list) -> None:
        self._works = [None] * len(self.pieces)
        for j in self.order:
            piece = self.pieces[j]
            self._works[j] = links[piece.shard].start_recv(self.host_state[piece.lo:piece.hi], piece.tag)
        self._in_flight = len(self.pieces)
        self._cursor = 0

    def _land(self, j: int) -> None:
        work, self._works[j] = self._works[j], None
        self._in_flight -= 1
        try:
            work.wait()
        except RuntimeError as err:
            raise LinkLost(str(err)) from err
        if self.on_cuda:
            piece, compute = self.pieces[j], torch.cuda.current_stream(self.state.device)
            # the state's readers of the last step are done: the worker's loss.item() waited for them
            with torch.cuda.stream(self._copy_stream):
                self.state[piece.lo:piece.hi].copy_(self.host_state[piece.lo:piece.hi], non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(self._copy_stream)
            compute.wait_event(landed)

    def land_all(self) -> None:
        for j in self.order:
            if self._works[j] is not None:
                self._land(j)

    def _land_arrived(self) -> None:
        """CUDA: start the bus copy of every piece that has arrived, in arrival order, ahead of
        its first reader."""
        while self._cursor < len(self.order):
            j = self.order[self._cursor]
            if self._works[j] is not None:
                if not self._works[j].is_completed():
                    return
                self._land(j)
            self._cursor += 1

    def _before_read(self, tensor) -> None:
        for j in self._pieces_of.get(id(tensor), ()):
            if self._works[j] is not None:
                self._land(j)
        if self.on_cuda:
            self._land_arrived()

    @contextlib.contextmanager
    def landing(self) -> Iterator[None]:
        """Around forward: every piece has landed before forward reads it, and all when it ends."""
        if self.overlap and self._early is not None and self._in_flight:
            for j in self._early:
                if self._works[j] is not None:
                    self._land(j)
            self._enter_mode()
            try:
                yield
            finally:
                self._leave_mode()
        else:
            self.land_all()
            if self.overlap and self._early is None:  # the probe
                seen: set[int] = set()
                with _Reads(lambda tensor: seen.add(id(tensor))):
                    yield
                self._early = self._unseen_pieces(seen)
            else:
                yield
        self.land_all()

    def _unseen_pieces(self, seen: set[int]) -> list[int]:
        """The pieces, in arrival order, holding a tensor forward did not read where the mode saw
        it: read nowhere, or out of its sight."""
        unseen = {j for key, held in self._pieces_of.items() if key not in seen for j in held}
        return [j for j in self.order if j in unseen]

    def _enter_mode(self) -> None:
        """The mode costs some microseconds a torch function: it is left at the first module call
        after the last piece has landed (a global module pre-hook, on only until then)."""
        self._reads, self._thread = _Reads(self._before_read), threading.get_ident()
        self._reads.__enter__()
        self._leave_hook = register_module_forward_pre_hook(self._leave_once_landed)

    def _leave_once_landed(self, _module, _args) -> None:
        if (not self._in_flight and threading.get_ident() == self._thread
                and _get_current_function_mode() is self._reads):  # not from inside a mode forward entered
            self._leave_mode()

    def _leave_mode(self) -> None:
        if self._leave_hook is not None:
            self._leave_hook.remove()
            self._leave_hook = None
        if self._reads is not None:
            self._reads.__exit__(None, None, None)
            self._reads = None
