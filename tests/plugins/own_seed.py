"""The regression MLP of regression.py, seeded differently on every build (as a script seeding from
the clock would be): each process builds other initial parameters, whatever spotfill seeds."""
import itertools

import torch

from tests.plugins.regression import build as regression

BUILDS = itertools.count(1000)


def build(inputs: int = 16, noise: float = 0.1):
    torch.manual_seed(next(BUILDS))
    return regression(inputs, noise)
