"""Flat buffers (tasks/runtime/flat.py) and the PS's flat optimizer step against the previous
per-tensor one, unsharded and split across shards."""
from __future__ import annotations

import json
import random

import pytest
import torch

from tasks.runtime import flat
from tasks.runtime.ps import ParameterServer, PsConfig
from tasks.runtime.workloads import build_workload


def test_bind_makes_parameters_buffers_and_gradients_views_of_two_flat_vectors():
    torch.manual_seed(0)
    model = build_workload("resnet20", {"width": 2}).model
    before = [t.detach().clone() for t in flat.synced_tensors(model)[0] + flat.synced_tensors(model)[1]]
    fm = flat.bind(model)
    params, buffers = flat.synced_tensors(model)
    offsets = fm.layout.offsets
    assert len(offsets) == len(params + buffers) and offsets[0] == 0
    assert all(b - a >= t.numel() for a, b, t in zip(offsets, offsets[1:], params + buffers))  # in order, no overlap
    assert fm.layout.param_numel == offsets[len(params)] and fm.layout.numel >= offsets[-1] + buffers[-1].numel()
    assert fm.layout.buffer_numel > 0  # BatchNorm statistics travel too
    start, end = fm.state.data_ptr(), fm.state.data_ptr() + fm.state.numel() * 4
    for t, old in zip(params + buffers, before):
        assert start <= t.data_ptr() < end and torch.equal(t, old)  # a view, values kept
        assert (t.data_ptr() - start) % 64 == 0  # on a 64-byte boundary, as a tensor of its own is
    fm.state.fill_(0.5)
    assert all(bool((t == 0.5).all()) for t in params + buffers)  # a pull into state lands in the model
    x = torch.randn(4, 3, 32, 32)
    for _ in range(2):  # gradients accumulate in place, into the push vector
        fm.zero_grad()
        model(x).sum().backward()
        assert all(p.grad.data_ptr() >= fm.push.data_ptr() for p in params)
    push = fm.fill_push_buffers()
    reference = fm.state.clone()  # the buffers' region as the state holds it
    reference[:fm.layout.param_numel] = 0.0  # the gradients' gaps stay zero
    for p, offset in zip(params, offsets):
        reference[offset:offset + p.numel()] = p.grad.reshape(-1)
    assert torch.equal(push, reference)


@pytest.mark.parametrize("numel,shards", [(10, 3), (7, 7), (5, 8), (101_212_416, 2), (0, 2)])
def test_shard_ranges_cover_the_vector_in_equal_bytes(numel, shards):
    ranges = flat.shard_ranges(numel, shards)
    assert len(ranges) == shards and ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_shard_ranges_random():
    rng = random.Random(3)
    for _ in range(200):
        numel, shards = rng.randrange(0, 10_000), rng.randrange(1, 17)
        sizes = [hi - lo for lo, hi in flat.shard_ranges(numel, shards)]
        assert sum(sizes) == numel and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        flat.shard_ranges(10, 0)


def _per_tensor_reference(spec: str, options: dict, pushes: list[tuple[torch.Tensor, int, int]], power: float) -> torch.Tensor:
    """The PS's previous update: one optimizer over the model's tensors, each gradient copied out
    of the push, the learning rate scaled by batch and damped by staleness."""
    workload = build_workload(spec, options)
    params = list(workload.model.parameters())
    buffers = [b for b in workload.model.buffers() if b.is_floating_point()]
    layout = flat.layout_of(workload.model)
    param_offsets, buffer_offsets = layout.offsets[:len(params)], layout.offsets[len(params):]
    optimizer = workload.make_optimizer(params)
    version = 0
    for push, base_version, batch in pushes:
        for p, offset in zip(params, param_offsets):
            p.grad = push[offset:offset + p.numel()].view_as(p).clone()
        with torch.no_grad():
            for b, offset in zip(buffers, buffer_offsets):
                b.copy_(push[offset:offset + b.numel()].view_as(b))
        lr = workload.lr_for_batch(batch) / (1 + version - base_version) ** power
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        version += 1
    state = torch.zeros(layout.numel)
    for t, offset in zip(params + buffers, layout.offsets):
        state[offset:offset + t.numel()] = t.detach().reshape(-1)
    return state


@pytest.mark.parametrize("spec,options", [
    ("resnet20", {"width": 2}),  # SGD, momentum, weight decay, BatchNorm buffers
    ("transformer-lm", {"d_model": 16, "layers": 1}),  # Adam
])
@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_flat_ps_step_equals_the_per_tensor_step(tmp_path, spec, options, num_shards):
    model = build_workload(spec, options).model
    layout = flat.layout_of(model)
    inside = torch.zeros(layout.numel)  # a worker's push is zero in the gaps between tensors
    for t, offset in zip(flat.synced_tensors(model)[0] + flat.synced_tensors(model)[1], layout.offsets):
        inside[offset:offset + t.numel()] = 1.0
    g = torch.Generator().manual_seed(1)
    pushes = [(torch.randn(layout.numel, generator=g) * 0.1 * inside, base, batch)
              for base, batch in ((0, 8), (0, 16), (1, 8), (3, 4))]
    expected = _per_tensor_reference(spec, options, pushes, power=0.5)
    servers = [ParameterServer(PsConfig(run_dir=tmp_path, port=0, workload=spec, workload_options=options,
                                        shard=i, num_shards=num_shards, async_rule="sqrt"))
               for i in range(num_shards)]  # the reference damps by sqrt(1 + staleness)
    for step, (push, base, batch) in enumerate(pushes):
        for ps in servers:
            header = torch.tensor([1.0, step, batch, 2.0, base, 0.1, 0.05, 0, 1, 0], dtype=torch.float64)
            if ps.sharded:
                ps.epochs.joined(7)
            assert ps.apply(7, "t", header, push[ps.lo:ps.hi].clone(), batch)
    got = torch.cat([ps.state for ps in servers])
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7), (got - expected).abs().max()
    record = json.loads((tmp_path / "telemetry.jsonl").read_text().splitlines()[-1])
    assert record["apply_ms_per_mb"] > 0
