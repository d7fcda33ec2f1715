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

On CUDA the pieces arrive in pinned host memory and a lander thread takes them in arrival order:
it waits for each receive, copies the piece over the bus on a copy stream and records an event.
Forward's first read of a piece makes the compute stream wait for that event, not the host for
the copy: the bus copies run ahead of forward and neither the host nor the compute stream waits on
the bus. (A gloo receive says it has completed only once it has been waited for, so only a thread
that waits can tell which pieces have arrived.)
"""
from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Iterator

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from tasks.runtime.flat import FlatModel, synced_tensors
from tasks.runtime.pieces import holding, pull_order, shard_pieces
from tasks.runtime.push import BusCopyFailed
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


class _Landing:
    """One pull as the lander thread lands it: per piece, `ready` is set once the piece has been
    received and its bus copy issued (`events[j]` completes with that copy; None: no device
    copy), or once the pull has failed (`error`)."""

    def __init__(self, order: list[int], works: list):
        self.order, self.works = order, works
        self.ready = {j: threading.Event() for j in order}
        self.events: dict = {}
        self.error: BaseException | None = None


class Puller:
    """Receives a worker's pulls into its model, piece by piece, while forward runs.

    `start(links)` once the shards' reply headers said continue (posts every piece's receive);
    forward inside `with landing():` (every piece has landed when it ends). `land_all()` lands
    whatever is in flight (a worker that leaves); `close()` ends the lander thread. A failed
    receive raises wire.LinkLost.

    `threaded` (default: on CUDA) receives into `host_state` and lets the lander thread move each
    piece into the state as it arrives; otherwise the receives write into the state itself (CPU:
    `host_state` is the state) and a piece is waited for at its first read."""

    def __init__(self, bound: FlatModel, ranges: list[tuple[int, int]], host_state: torch.Tensor, piece_numel: int,
                 threaded: bool | None = None):
        self.state, self.host_state = bound.state, host_state
        self.on_cuda = self.state.device.type == "cuda"
        self.threaded = self.on_cuda if threaded is None else threaded
        if self.threaded and host_state.data_ptr() == self.state.data_ptr():
            raise ValueError("a threaded pull receives into a host buffer of its own, not into the state")
        self.pieces = shard_pieces(ranges, piece_numel)
        params, buffers = synced_tensors(bound.model)
        self._pieces_of = {id(t): holding(self.pieces, lo, lo + t.numel())
                           for t, lo in zip(params + buffers, bound.layout.offsets)}
        self.order = self._order(ranges, bound.layout.param_numel)
        self._works: list = [None] * len(self.pieces)  # a piece's receive (threaded: True), until it has landed
        self._in_flight = 0
        self._reads: _Reads | None = None  # the mode, while it is on
        self._leave_hook = None
        self._thread = 0
        self._cursor = 0  # threaded: where in `order` to look for the next piece the lander has copied
        self.overlap = not _opaque(bound.model)
        self._early: list[int] | None = None  # landed before forward (the probe's finding); None: no probe yet
        self._landing: _Landing | None = None
        if self.on_cuda:
            self._copy_stream = torch.cuda.Stream(self.state.device)
        if self.threaded:
            self._queue: queue.Queue = queue.Queue()
            threading.Thread(target=self._land_in_order, daemon=True, name="pull").start()

    def _order(self, ranges: list[tuple[int, int]], param_numel: int) -> list[int]:
        """The pieces in the order they arrive: each shard's in its pull order, taken in turn."""
        per_shard = []
        for shard, (lo, hi) in enumerate(ranges):
            mine = [j for j, p in enumerate(self.pieces) if p.shard == shard]
            cut = [(self.pieces[j].lo - lo, self.pieces[j].hi - lo) for j in mine]
            per_shard.append([mine[i] for i in pull_order(cut, max(0, min(hi, param_numel) - lo))])
        return [j for turn in itertools.zip_longest(*per_shard) for j in turn if j is not None]

    def start(self, links: list) -> None:
        works = [None] * len(self.pieces)
        for j in self.order:
            piece = self.pieces[j]
            works[j] = links[piece.shard].start_recv(self.host_state[piece.lo:piece.hi], piece.tag)
        self._in_flight = len(self.pieces)
        self._cursor = 0
        if not self.threaded:
            self._works = works
            return
        self._works = [True] * len(self.pieces)
        if self.on_cuda:
            # the copies come after everything queued on the state so far (the last step's kernels,
            # an aborted forward's, bind's initial copy)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.state.device))
        self._landing = _Landing(self.order, works)
        self._queue.put(self._landing)

    def _land_in_order(self) -> None:
        """The lander thread: each pull's pieces in arrival order, received, then copied into the
        state (on CUDA over the bus, on the copy stream). After a failure the pull's remaining
        pieces are only marked ready: its error is raised where forward reads them."""
        while True:
            landing = self._queue.get()
            if landing is None:  # close()
                return
            for j in landing.order:
                if landing.error is None:
                    landing.error = self._receive_and_copy(landing, j)
                landing.ready[j].set()

    def _receive_and_copy(self, landing: _Landing, j: int) -> BaseException | None:
        """Piece j received and copied in; the failure, if any: a failed receive is a lost link
        (the worker rejoins), a failed bus copy the worker's own (it ends)."""
        try:
            landing.works[j].wait()
        except RuntimeError as err:
            return LinkLost(str(err))
        except BaseException as err:
            return err
        try:
            landing.events[j] = self._copy_in(self.pieces[j])
        except RuntimeError as err:
            return BusCopyFailed(str(err))
        except BaseException as err:
            return err
        return None

    def _copy_in(self, piece) -> "torch.cuda.Event | None":
        if not self.on_cuda:
            self.state[piece.lo:piece.hi].copy_(self.host_state[piece.lo:piece.hi])
            return None
        with torch.cuda.stream(self._copy_stream):
            self.state[piece.lo:piece.hi].copy_(self.host_state[piece.lo:piece.hi], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        return copied

    def _land(self, j: int) -> None:
        work, self._works[j] = self._works[j], None
        self._in_flight -= 1
        if not self.threaded:
            try:
                work.wait()
            except RuntimeError as err:
                raise LinkLost(str(err)) from err
            return
        landing = self._landing
        landing.ready[j].wait()
        if landing.error is not None:
            raise landing.error
        copied = landing.events.get(j)
        if copied is not None:
            torch.cuda.current_stream(self.state.device).wait_event(copied)

    def land_all(self) -> None:
        for j in self.order:
            if self._works[j] is not None:
                self._land(j)

    def _land_copied(self) -> None:
        """Threaded: land, in arrival order, every piece whose copy has already finished, so that
        the compute stream waits on nothing and the mode can be left as early as possible."""
        landing = self._landing
        while self._cursor < len(self.order):
            j = self.order[self._cursor]
            if self._works[j] is not None:
                if not landing.ready[j].is_set() or landing.error is not None:
                    return
                copied = landing.events[j]
                if copied is not None and not copied.query():
                    return
                self._land(j)
            self._cursor += 1

    def _before_read(self, tensor) -> None:
        for j in self._pieces_of.get(id(tensor), ()):
            if self._works[j] is not None:
                self._land(j)
        if self.threaded:
            self._land_copied()

    def close(self) -> None:
        """End the lander thread: a process may run several workers in turn (the bench)."""
        if self.threaded:
            self._queue.put(None)

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
