"""The instance's gradient sum bucket by bucket during backward (tasks/runtime/buckets.py): here
g replicas as threads over gloo in one process, on CPU."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.distributed import HashStore

from tasks.runtime import flat
from tasks.runtime.buckets import MIN_BUCKETS, BucketSum, bucket_ranges, emulated_ready_s
from tasks.runtime.replicas import local_group
from tasks.runtime.workloads import build_workload

SPEC, OPTIONS = "resnet20", {"width": 4}  # BatchNorm: the push has a buffers' region too
CPU = torch.device("cpu")


def _groups(gpus: int) -> list:
    store, groups = HashStore(), [None] * gpus

    def make(rank: int) -> None:
        groups[rank] = local_group(store, rank, gpus, CPU, 30.0)

    makers = [threading.Thread(target=make, args=(r,)) for r in range(gpus)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join()
    return groups


def _on_every_replica(gpus: int, work) -> list:
    """`work(rank)` in one thread per replica, at once (the collectives need them all); the results."""
    results, errors = [None] * gpus, []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(gpus)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return results


def test_buckets_cover_the_vector_gradients_from_the_end_then_the_buffers():
    buckets = bucket_ranges(param_numel=1000, numel=1096)
    assert len([b for b in buckets if b[1] <= 1000]) == MIN_BUCKETS  # a small model still overlaps
    assert buckets[0][1] == 1000 and buckets[MIN_BUCKETS - 1][0] == 0 and buckets[-1] == (1000, 1096)
    assert sorted(buckets) == [(lo, min(lo + 125, 1000)) for lo in range(0, 1000, 125)] + [(1000, 1096)]
    big = bucket_ranges(param_numel=10_000_000, numel=10_000_000, piece_mb=4.0)
    assert max(hi - lo for lo, hi in big) == 1_000_000  # at most PIECE_MB


def test_an_emulated_step_makes_its_buckets_through_backward_the_last_as_compute_ends():
    ready = [emulated_ready_s(j, 8, 0.6) for j in range(8)]
    assert ready[0] == pytest.approx(0.6 / 3 + 0.4 / 8) and ready[-1] == pytest.approx(0.6)
    assert ready == sorted(ready)


@pytest.mark.parametrize("gpus,early", [(2, True), (3, True), (2, False)])
def test_the_bucketed_sum_is_the_mean_of_the_replicas_pushes_and_starts_during_backward(gpus, early):
    """Each replica computes on its own batch; after each iteration every replica's push is the
    mean of the pushes computed alone (bit for bit with 2 replicas), and from the second
    iteration on the gradients' buckets started from backward's hooks, before compute ended."""
    groups, iterations = _groups(gpus), 3
    models = [build_workload(SPEC, OPTIONS) for _ in range(gpus)]
    bounds = [flat.bind(w.model) for w in models]
    for bound in bounds[1:]:
        bound.state.copy_(bounds[0].state)
    sums = [BucketSum(groups[r], gpus, bounds[r].push, bounds[r].layout.param_numel, bounds[r], 0.0, early=early)
            for r in range(gpus)]
    batches = [w.batches(4, 7 + r) for r, w in enumerate(models)]
    grad_buckets = len([b for b in sums[0].buckets if b[1] <= bounds[0].layout.param_numel])

    def iteration(rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        workload, bound, bucket_sum = models[rank], bounds[rank], sums[rank]
        bucket_sum.arm()
        inputs, targets = next(batches[rank])
        loss = workload.loss_fn(workload.model(inputs), targets)
        bound.zero_grad()
        loss.backward()
        alone = bound.fill_push_buffers().clone()  # buckets in flight may already hold sums: see below
        started = bucket_sum._next
        bucket_sum.compute_done()
        bucket_sum.wait()
        return alone, bound.push.clone(), started

    try:
        for i in range(iterations):
            results = _on_every_replica(gpus, iteration)
            started = [s for _, _, s in results]
            assert started == ([grad_buckets] * gpus if early and i > 0 else [0] * gpus)
            if not early or i == 0:  # nothing summed before compute ended: `alone` is each replica's own push
                expected = torch.stack([alone for alone, _, _ in results]).sum(0) / gpus
                for _, summed, _ in results:
                    if gpus == 2:
                        assert torch.equal(summed, expected)
                    else:
                        torch.testing.assert_close(summed, expected, rtol=1e-6, atol=1e-7)
            for _, summed, _ in results[1:]:
                assert torch.equal(summed, results[0][1])  # every replica holds the same mean
            assert not any(s.dropped for s in sums)
    finally:
        for s in sums:
            s.close()


def test_the_overlapped_sum_equals_the_sum_after_backward():
    """Same models, same batches: summed during backward and after it, the means agree."""
    gpus = 2
    pushes = {}
    for early in (True, False):
        groups = _groups(gpus)
        models = [build_workload(SPEC, OPTIONS) for _ in range(gpus)]
        torch.manual_seed(0)
        bounds = [flat.bind(w.model) for w in models]
        for bound in bounds[1:]:
            bound.state.copy_(bounds[0].state)
        start_state = bounds[0].state.clone()
        sums = [BucketSum(groups[r], gpus, bounds[r].push, bounds[r].layout.param_numel, bounds[r], 0.0, early=early)
                for r in range(gpus)]
        batches = [w.batches(4, 7 + r) for r, w in enumerate(models)]

        def iteration(rank: int) -> torch.Tensor:
            bounds[rank].state.copy_(start_state)  # the same pull every iteration
            sums[rank].arm()
            inputs, targets = next(batches[rank])
            loss = models[rank].loss_fn(models[rank].model(inputs), targets)
            bounds[rank].zero_grad()
            loss.backward()
            bounds[rank].fill_push_buffers()
            sums[rank].compute_done()
            sums[rank].wait()
            return bounds[rank].push.clone()

        try:
            pushes[early] = [_on_every_replica(gpus, iteration)[0] for _ in range(2)]
        finally:
            for s in sums:
                s.close()
    assert pushes[True][0].abs().sum() > 0
    for overlapped, after in zip(pushes[True], pushes[False]):
        assert torch.equal(overlapped, after)


def test_a_gradient_accumulating_twice_after_its_bucket_started_drops_that_iteration_and_ends_early_starts():
    """Two backward calls in one iteration (what reentrant checkpoint segments do) accumulate each
    gradient twice: the first iteration counts them before starting anything early; once early
    starts are on, such an iteration is dropped and every later sum starts after backward."""
    gpus = 2
    groups = _groups(gpus)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(gpus)]
    bounds = [flat.bind(m) for m in models]
    sums = [BucketSum(groups[r], gpus, bounds[r].push, bounds[r].layout.param_numel, bounds[r], 0.0) for r in range(gpus)]
    backwards = 1

    def iteration(rank: int) -> bool:
        sums[rank].arm()
        bounds[rank].zero_grad()
        for _ in range(backwards):
            models[rank](torch.ones(2, 4)).sum().backward()
        sums[rank].compute_done()
        sums[rank].wait()
        return sums[rank].dropped

    try:
        assert _on_every_replica(gpus, iteration) == [False, False]  # the first backward: counted, nothing early
        assert all(s.early for s in sums)
        backwards = 2
        assert _on_every_replica(gpus, iteration) == [True, True]
        assert not any(s.early for s in sums)
        assert _on_every_replica(gpus, iteration) == [False, False]  # after backward from now on: safe
    finally:
        for s in sums:
            s.close()
