"""A plug-in that prints while it builds and waits there on the test's events, so that two builds
in threads are inside the plug-in's code at once, entering and leaving in the order a test sets."""
import threading
from collections import defaultdict

import torch
from torch import nn
import torch.nn.functional as F

EVENTS: defaultdict[str, threading.Event] = defaultdict(threading.Event)


def build(name: str = "", set_on_entry: str = "", wait_for: str = ""):
    print(f"{name} building")
    if set_on_entry:
        EVENTS[set_on_entry].set()
    if wait_for and not EVENTS[wait_for].wait(60):
        raise RuntimeError(f"{name}: nothing set {wait_for!r}")

    def batches(batch_size: int, seed: int):
        rng = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randn(batch_size, 4, generator=rng), torch.randn(batch_size, 1, generator=rng)

    return nn.Linear(4, 1), batches, F.mse_loss
