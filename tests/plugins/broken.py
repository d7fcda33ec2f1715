"""Plug-ins that go wrong the ways a user's can: each must be refused with one line before anything
starts (tests/runtime/test_plugins.py)."""
import dataclasses
import math

import torch
from torch import nn
import torch.nn.functional as F

from tests.plugins.evaluated import build as evaluated
from tests.plugins.regression import build as regression


def not_a_tuple():
    return 42


def two_items():
    model, batches, _ = regression()
    return model, batches


def not_a_model():
    _, batches, loss_fn = regression()
    return "model", batches, loss_fn


def not_a_batch_source():
    model, _, loss_fn = regression()
    return model, [1, 2, 3], loss_fn


def yields_bare_tensors():
    model, _, loss_fn = regression()

    def batches(batch_size, seed):
        while True:
            yield torch.zeros(batch_size, 16)

    return model, batches, loss_fn


def nan_loss():
    model, batches, _ = regression()
    return model, batches, lambda out, target: F.mse_loss(out, target) * float("nan")


def shape_mismatch():
    _, batches, loss_fn = regression()
    return nn.Linear(8, 1), batches, loss_fn


def raises():
    raise RuntimeError("dataset not found at /data/x")


def never_learns():
    """Passes every check, but its loss is the same whatever the parameters: no loss band."""
    model, batches, _ = regression()
    return model, batches, lambda out, target: (0.0 * out).sum() + 1.0


def exits():
    import sys

    sys.exit("the plug-in gave up")


def talks_and_reads_its_data():
    """A valid plug-in that prints as it builds and reads a tensor's value (which the meta device
    used for the size check cannot give)."""
    print("building my model...")
    model, batches, loss_fn = regression()
    scale = torch.ones(3).mean().item()
    return model, batches, lambda out, y: scale * loss_fn(out, y)


def runs_out():
    """Passes the checks (one batch), then its batch source ends after the first step."""
    model, batches, loss_fn = regression()

    def two_batches(batch_size, seed):
        source = batches(batch_size, seed)
        yield next(source)
        yield next(source)

    return model, two_batches, loss_fn


def exits_hard():
    """os._exit(0): the process would end at once, with status 0 and no word."""
    import os

    os._exit(0)


def exits_hard_in_its_batches():
    model, _, loss_fn = regression()

    def batches(batch_size, seed):
        import os

        print("no data here")
        os._exit(3)

    return model, batches, loss_fn


def batches_not_iterable():
    model, _, loss_fn = regression()
    return model, lambda batch_size, seed: 42, loss_fn


def _in_dtype(dtype):
    """regression's model and data in `dtype`: a step of it trains, but the runtime's wire carries
    float32 parameters."""
    model, batches, loss_fn = regression()

    def cast(batch_size, seed):
        for x, y in batches(batch_size, seed):
            yield x.to(dtype), y.to(dtype)

    return model.to(dtype), cast, loss_fn


def bf16_model():
    return _in_dtype(torch.bfloat16)


def fp16_model():
    return _in_dtype(torch.float16)


def fp64_model():
    return _in_dtype(torch.float64)


def _evaluated_with(evaluate):
    """The evaluated classifier, its evaluate replaced."""
    return dataclasses.replace(evaluated(), evaluate=evaluate)


def evaluate_raises():
    def evaluate(model):
        raise ValueError("no held-out data")

    return _evaluated_with(evaluate)


def evaluate_nan():
    return _evaluated_with(lambda model: {"val_acc": 0.5, "val_loss": math.nan})


def evaluate_list():
    return _evaluated_with(lambda model: [{"val_acc": 0.5}])


def evaluate_nan_later(after: int = 1):
    """Passes the check before launch (its first evaluation), then returns NaN: a model that diverged."""
    calls = []

    def evaluate(model):
        calls.append(1)
        return {"val_acc": 0.5, "val_loss": math.nan if len(calls) > after else 1.0}

    return _evaluated_with(evaluate)
