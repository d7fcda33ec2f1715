"""What is trained: a registry of built-in workloads and a `module:function` plug-in point.

Built-ins learn from synthetic data generated from a fixed seed (no downloads at run time), made
so the loss falls the way real training does, gradually and with noise:
- `resnet20|32|44|56|110` (add `-cifar100` for 100 classes): the CIFAR ResNets of He et al.
  (6n+2 layers) on CIFAR-shaped images, 3x32x32: each class has a smooth random prototype; a sample
  is its class prototype plus Gaussian noise, randomly shifted and flipped (like CIFAR augmentation).
- `transformer-lm`: a small causal transformer language model on token sequences drawn from a
  fixed sparse Markov chain (each token has a few likely successors), so the loss falls from
  ln(vocab) towards the chain's entropy rate.
Each evaluates itself on 256 held-out samples (`held_out_evaluation`): `val_loss` and `val_acc`.

A plug-in is `package.module:function`; the function takes the workload options as keyword
arguments and returns a `Workload` (or a tuple `(model, batches, loss_fn)`, which gets the
Workload defaults). `check_workload` refuses a bad one with one line before anything starts.
The user's guide is docs/plugins.md.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import math
import os
import random
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from tasks.core.errors import UserInputError, one_line, shown
from tasks.core.hard_exit import HardExit, hard_exit_raised
from tasks.core.limits import DEFAULT_MAX_PARAMS, env_limit
from tasks.core.thread_output import captured_output
from tasks.runtime import flat
from tasks.runtime.evaluation import TargetMetric, check_target_metric, evaluate_model

OPTIMIZERS = ("sgd", "adam")
BUILD_SEED = 0  # the global generators' seed while a workload builds, in every process
HELD_OUT_SEED = 2**31 - 1  # the built-ins' held-out batches: a seed no worker draws from
VAL_BATCHES, VAL_BATCH = 4, 64  # the built-ins' held-out set: 256 samples
Batch = tuple[torch.Tensor, torch.Tensor]
BatchSource = Callable[[int, int], Iterator[Batch]]  # (batch_size, seed) -> endless batches


@dataclass
class Workload:
    """A model, where its batches come from, and how it learns.

    `base_lr` is the learning rate at `base_batch`; a worker with batch b trains at
    base_lr * b / base_batch (the linear scaling rule), applied by the PS per update.
    """

    name: str
    model: nn.Module
    batches: BatchSource
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: str = "sgd"  # one of OPTIMIZERS: "sgd" (momentum 0.9, weight decay 1e-4) or "adam"
    base_lr: float = 0.05
    base_batch: int = 128
    # optional: the model's metrics on held-out data, {name: value} (tasks/runtime/evaluation.py)
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.base_lr)
        return torch.optim.SGD(params, lr=self.base_lr, momentum=0.9, weight_decay=1e-4)

    def lr_for_batch(self, batch_size: int) -> float:
        return self.base_lr * batch_size / self.base_batch

    def plain_steps(self, batch_size: int, seed: int = 1) -> Iterator[float]:
        """Plain single-process training, one step per `next()`, yielding the loss: the baseline
        the runtime's overhead is measured against, and the check that a workload learns."""
        optimizer = self.make_optimizer(self.model.parameters())
        for group in optimizer.param_groups:
            group["lr"] = self.lr_for_batch(batch_size)
        batches = self.batches(batch_size, seed)
        while True:
            inputs, targets = next(batches)
            loss = self.loss_fn(self.model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            yield loss.item()


def held_out_evaluation(batches: BatchSource, loss_fn: Callable, classifier: bool = True,
                        n_batches: int = VAL_BATCHES, batch_size: int = VAL_BATCH) -> Callable[[nn.Module], dict[str, float]]:
    """A built-in's evaluate(model): `val_loss` (and for a classifier `val_acc`, the share of
    argmax predictions that hit) on held-out batches from HELD_OUT_SEED, drawn at the first call
    (not at build time, which also runs on torch's meta device) and kept."""
    held_out: list[Batch] = []

    def evaluate(model: nn.Module) -> dict[str, float]:
        if not held_out:
            source = batches(batch_size, HELD_OUT_SEED)
            held_out.extend(next(source) for _ in range(n_batches))
        loss_sum = hits = count = 0.0
        for inputs, targets in held_out:
            logits = model(inputs)
            loss_sum += loss_fn(logits, targets).item() * targets.numel()
            hits += (logits.argmax(-1) == targets).sum().item()
            count += targets.numel()
        return {"val_loss": loss_sum / count, **({"val_acc": hits / count} if classifier else {})}

    return evaluate


# ---------------------------------------------------------------- CIFAR-shaped ResNets


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 inputs: three stages of n blocks at widths w, 2w, 4w."""

    def __init__(self, depth: int, num_classes: int, width: int = 16):
        super().__init__()
        if (depth - 2) % 6 != 0:
            raise UserInputError(f"ResNet depth must be 6n+2, got {depth}")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers: list[nn.Module] = []
        cin = width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                layers.append(_BasicBlock(cin, cout, 2 if (stage > 0 and i == 0) else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.stages(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(out, 1).flatten(1))


def synthetic_cifar(num_classes: int, noise: float = 1.0, data_seed: int = 0) -> BatchSource:
    """CIFAR-shaped learnable images: smooth class prototypes + noise, shifted and flipped."""
    g = torch.Generator().manual_seed(data_seed)
    coarse = torch.randn(num_classes, 3, 8, 8, generator=g)
    prototypes = F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    prototypes = prototypes / prototypes.flatten(1).std(dim=1).view(-1, 1, 1, 1)

    def batches(batch_size: int, seed: int) -> Iterator[Batch]:
        rng = torch.Generator().manual_seed(seed)
        while True:
            labels = torch.randint(0, num_classes, (batch_size,), generator=rng)
            images = prototypes[labels] + noise * torch.randn(batch_size, 3, 32, 32, generator=rng)
            shift = torch.randint(-4, 5, (2,), generator=rng).tolist()
            images = torch.roll(images, shifts=shift, dims=(2, 3))
            if torch.rand(1, generator=rng).item() < 0.5:
                images = images.flip(3)
            yield images, labels

    return batches


def resnet(depth: int, num_classes: int = 10, width: int = 16, noise: float = 1.0) -> Workload:
    batches = synthetic_cifar(num_classes, noise)
    return Workload(
        name=f"resnet{depth}" + ("-cifar100" if num_classes == 100 else ""),
        model=CifarResNet(depth, num_classes, width),
        batches=batches,
        loss_fn=F.cross_entropy,
        optimizer="sgd",
        base_lr=0.1,
        base_batch=32,
        evaluate=held_out_evaluation(batches, F.cross_entropy),
    )


# ---------------------------------------------------------------- tiny transformer LM


class TinyTransformerLM(nn.Module):
    """A causal transformer language model: token + position embeddings, pre-norm encoder layers."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int, heads: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tokens(tokens) + self.positions[:t]
        h = self.encoder(h, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def markov_tokens(vocab: int, seq_len: int, successors: int = 4, data_seed: int = 0) -> BatchSource:
    """Sequences from a fixed sparse Markov chain: each token has `successors` likely next tokens."""
    g = torch.Generator().manual_seed(data_seed)
    transition = torch.full((vocab, vocab), 1e-3)
    for token in range(vocab):
        nxt = torch.randperm(vocab, generator=g)[:successors]
        transition[token, nxt] = torch.rand(successors, generator=g) + 0.5
    transition = transition / transition.sum(dim=1, keepdim=True)

    def batches(batch_size: int, seed: int) -> Iterator[Batch]:
        rng = torch.Generator().manual_seed(seed)
        while True:
            seq = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
            seq[:, 0] = torch.randint(0, vocab, (batch_size,), generator=rng)
            for i in range(seq_len):
                seq[:, i + 1] = torch.multinomial(transition[seq[:, i]], 1, generator=rng).squeeze(1)
            yield seq[:, :-1], seq[:, 1:]

    return batches


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def transformer_lm(vocab: int = 64, seq_len: int = 32, d_model: int = 64, layers: int = 2, heads: int = 4) -> Workload:
    batches = markov_tokens(vocab, seq_len)
    return Workload(
        name="transformer-lm",
        model=TinyTransformerLM(vocab, seq_len, d_model, layers, heads),
        batches=batches,
        loss_fn=_lm_loss,
        optimizer="adam",
        base_lr=3e-3,
        base_batch=32,
        evaluate=held_out_evaluation(batches, _lm_loss),  # val_acc: next tokens predicted
    )


# ---------------------------------------------------------------- registry and plug-ins

RESNET_DEPTHS = (20, 32, 44, 56, 110)
BUILTIN: dict[str, Callable[..., Workload]] = {"transformer-lm": transformer_lm}
for _depth in RESNET_DEPTHS:
    BUILTIN[f"resnet{_depth}"] = lambda _d=_depth, **kw: resnet(_d, **kw)
    BUILTIN[f"resnet{_depth}-cifar100"] = lambda _d=_depth, **kw: resnet(_d, num_classes=100, **kw)


def parse_options(items: list[str] | None) -> dict[str, int | float | str]:
    """`key=value` strings (from --workload-opt) into keyword arguments; numbers become numbers."""
    options: dict[str, int | float | str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UserInputError(f"workload option must be key=value, got {item!r}")
        if key in options:
            raise UserInputError(f"workload option {key} given twice")
        for cast in (int, float):
            try:
                options[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            options[key] = value
    return options


@contextlib.contextmanager
def seeded_build(seed: int = BUILD_SEED):
    """Around a builder: torch's, numpy's and Python's global generators start from `seed`, so
    every process (the PS, each worker, each profiling cluster) builds the same initial parameters
    and the same data from a plug-in that does not seed; afterwards they are as they were, so a
    worker's own randomness (dropout, batches drawn from the global generator) stays its own."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def plugin_code(spec: str, doing: str):
    """Around a plug-in's own code: what it prints goes to stderr once it returns (stdout is for one
    JSON object; captured for this thread only, so plug-ins built in threads at once leave the
    process's streams alone: tasks/core/thread_output.py), and a sys.exit() inside it (an argparse
    at import, say) is its failure, not this process's: one line that ends with the last line the plug-in printed (argparse's complaint),
    not its usage text before ours. An os._exit() inside it is its failure too (tasks/core/hard_exit.py),
    not the end of this process with no word and perhaps status 0."""
    try:
        with captured_output() as printed, hard_exit_raised():
            yield
    except (SystemExit, HardExit) as err:
        said = [line.strip() for line in printed.getvalue().splitlines() if line.strip()]
        called = f"os._exit({err.status!r})" if isinstance(err, HardExit) else f"sys.exit({err.code!r})"
        raise UserInputError(f"workload plug-in {spec!r} called {called} while {doing}"
                             + (f": {shown(said[-1], 200)}" if said else "")) from None
    except BaseException:
        sys.stderr.write(printed.getvalue())
        raise
    sys.stderr.write(printed.getvalue())


def resolve_builder(spec: str) -> Callable[..., Workload | tuple]:
    """The function that builds a built-in or `module:function` workload; a bad name is a
    UserInputError naming what is known. Like `python -m`, the current folder is searched for the
    plug-in's module (the launched processes get it on their PYTHONPATH too)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    elif ":" in spec:
        module_name, _, function_name = spec.partition(":")
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            with plugin_code(spec, "being imported"):
                module = importlib.import_module(module_name)
        except UserInputError:
            raise
        except Exception as err:  # ImportError, or the module's own code failing on import
            raise UserInputError(f"workload plug-in {spec!r}: cannot import {module_name!r} "
                                 f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
        builder = getattr(module, function_name, None)
        if not callable(builder):
            raise UserInputError(f"workload plug-in {spec!r}: {module_name} has no function {function_name!r}")
        return builder
    raise UserInputError(f"unknown workload {spec!r}; built-ins: {', '.join(sorted(BUILTIN))}, or module:function")


def build_workload(spec: str, options: dict | None = None) -> Workload:
    """A built-in name or a `module:function` plug-in, built with keyword options under one seed
    (`seeded_build`); what a plug-in returns is checked for shape (a Workload, or the tuple
    (model, batches, loss_fn))."""
    options = options or {}
    builder = resolve_builder(spec)
    try:
        with plugin_code(spec, "building"), seeded_build():
            built = builder(**options)
    except TypeError as err:
        raise UserInputError(f"workload {spec!r} rejects options {options}: {err}") from None
    except UserInputError:
        raise
    except Exception as err:
        raise UserInputError(f"workload plug-in {spec!r} failed while building: {type(err).__name__}: {err}") from None
    if isinstance(built, tuple):
        if len(built) != 3:
            raise UserInputError(f"workload plug-in {spec!r} returned a tuple of {len(built)} items; "
                                 "expected (model, batches, loss_fn) or a Workload")
        model, batches, loss_fn = built
        built = Workload(name=spec, model=model, batches=batches, loss_fn=loss_fn)
    if not isinstance(built, Workload):
        raise UserInputError(f"workload plug-in {spec!r} returned {type(built).__name__}; "
                             "expected (model, batches, loss_fn) or a Workload")
    if not isinstance(built.model, nn.Module):
        raise UserInputError(f"workload {spec!r}: the model is a {type(built.model).__name__}, not a torch.nn.Module")
    if not any(p.requires_grad for p in built.model.parameters()):
        raise UserInputError(f"workload {spec!r}: the model has no trainable parameters")
    optional = [("evaluate", built.evaluate)] if built.evaluate is not None else []
    for what, value in [("batches", built.batches), ("loss_fn", built.loss_fn), *optional]:
        if not callable(value):
            raise UserInputError(f"workload {spec!r}: {what} is a {type(value).__name__}, not callable")
    built.batches = _iterating(spec, built.batches)
    if built.optimizer not in OPTIMIZERS:
        raise UserInputError(f"workload {spec!r}: optimizer {built.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if not (built.base_lr > 0 and built.base_batch > 0):
        raise UserInputError(f"workload {spec!r}: base_lr and base_batch must be positive "
                             f"(got {built.base_lr}, {built.base_batch})")
    return built


def _iterating(spec: str, batches: BatchSource) -> BatchSource:
    """`batches` whose every result is an iterator: a plug-in may return any iterable (a list, a
    DataLoader), and each consumer (the one-step check, profiling, the worker) calls next() on it;
    what is not iterable is one line naming the workload."""
    @functools.wraps(batches)
    def iterating(batch_size: int, seed: int) -> Iterator[Batch]:
        made = batches(batch_size, seed)
        try:
            return iter(made)
        except TypeError:
            raise UserInputError(f"workload {spec!r}: batches(batch_size, seed) returned a value of type {type(made).__name__}, "
                                 "not an iterable of (inputs, targets) pairs") from None

    return iterating


def check_workload(spec: str, options: dict | None = None, batch_size: int = 2,
                   target_metric: TargetMetric | None = None) -> Workload:
    """Refuse a bad workload in one line before any parameter server or worker starts. First it
    is built on torch's meta device (no memory), so that a bad name, a bad or non-finite option,
    or a model past SPOTFILL_MAX_PARAMS fails at once; then it is built for real and trained one
    step on a copy of the model, in this process: a batch source that yields no (inputs, targets)
    pair, a loss that is not a finite scalar, or a loss that does not reach the parameters is one
    UserInputError naming the cause. A plug-in with an `evaluate` (a built-in: with a target
    metric) is evaluated once on the model as built (tasks/runtime/evaluation.py), and
    `target_metric` must be among what it reports."""
    options = options or {}
    _check_size(spec, options)
    workload = build_workload(spec, options)
    with plugin_code(spec, "training one step"):
        _one_step(spec, workload, batch_size)
    if workload.evaluate is None:
        if target_metric is not None:
            raise UserInputError(f"target metric {target_metric.name!r} needs an evaluate(model) in workload {spec!r}, "
                                 "which has none (docs/plugins.md)")
        return workload
    if spec in BUILTIN and target_metric is None:  # the built-ins' own evaluate is tested, and costs seconds on a CPU
        return workload
    with plugin_code(spec, "evaluating"):
        metrics = evaluate_model(spec, workload.evaluate, copy.deepcopy(workload.model))
    if target_metric is not None:
        check_target_metric(spec, metrics, target_metric)
    return workload


def _check_size(spec: str, options: dict) -> None:
    """Options in range, and the model's parameter count within SPOTFILL_MAX_PARAMS, from a build
    on the meta device."""
    for key, value in options.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserInputError(f"workload option {key}={value} is not a finite number")
        if isinstance(value, int) and abs(value) >= 2**31:
            raise UserInputError(f"workload option {key}={value} is out of range")
    try:
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's notes on zero-element tensors: reported below
                built = build_workload(spec, options)
        except Exception as err:  # noqa: BLE001
            if "meta" not in str(err):
                raise
            # a builder that reads a tensor's values (data.mean().item()) cannot run on the meta
            # device: build it for real, as the one-step check does anyway
            built = build_workload(spec, options)
        sizes = [p.numel() for p in built.model.parameters()]
    except UserInputError:
        raise
    except Exception as err:  # noqa: BLE001 - a builder's own check (negative width, ...)
        raise UserInputError(f"workload {spec!r} cannot be built with options {options}: {one_line(err)}") from None
    if not sizes or 0 in sizes:
        raise UserInputError(f"workload {spec!r} with options {options} builds a layer with no parameters "
                             "(a size option of 0?)")
    n_params = sum(sizes)
    limit = env_limit("SPOTFILL_MAX_PARAMS", DEFAULT_MAX_PARAMS)
    if n_params > limit:
        raise UserInputError(f"workload {spec!r} with options {options} has {n_params} parameters, above the "
                             f"limit of {limit} (set SPOTFILL_MAX_PARAMS to raise it)")


def _check_float32(where: str, model: nn.Module) -> None:
    """The runtime keeps a model's parameters and floating-point buffers in one float32 vector
    (flat.py; the wire's type): a bfloat16 or float64 one would be turned into float32 there and
    the first step of training would then fail on mixed types."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and tensor.dtype != torch.float32:
            raise UserInputError(f"{where}: {name} is {str(tensor.dtype).removeprefix('torch.')}; the runtime trains "
                                 "float32 parameters and buffers: build the model in float32 (torch.autocast "
                                 "gives lower-precision compute)")


def _one_step(spec: str, workload: Workload, batch_size: int) -> Workload:
    """One step of the model as a worker holds it: bound into the flat float32 vector (flat.py)."""
    model = copy.deepcopy(workload.model)
    where = f"workload {spec!r}"
    _check_float32(where, model)
    flat.bind(model)
    try:
        batch = next(iter(workload.batches(batch_size, 0)))
    except UserInputError:  # what the batches are not (_iterating): said once, not wrapped in itself
        raise
    except Exception as err:
        raise UserInputError(f"{where}: batches(batch_size, seed) failed: {type(err).__name__}: {err}") from None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise UserInputError(f"{where}: batches(batch_size, seed) must yield (inputs, targets) tensor pairs, "
                             f"got {type(batch).__name__}")
    inputs, targets = batch
    try:
        loss = workload.loss_fn(model(inputs), targets)
    except Exception as err:
        raise UserInputError(f"{where}: loss_fn(model(inputs), targets) failed: {type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}") from None
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        raise UserInputError(f"{where}: loss_fn must return a scalar float tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    if not math.isfinite(loss.item()):
        raise UserInputError(f"{where}: the loss of the first batch is {loss.item()} (not finite)")
    if not loss.requires_grad:
        raise UserInputError(f"{where}: the loss does not depend on the model's parameters (no gradient)")
    return workload
