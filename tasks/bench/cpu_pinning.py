"""Training's intra-op threads held one per core, for the CPU filling bench.

The CPU bench stands in for a GPU, where training's kernels own the device while they run. On a
CPU, training's compute phase is torch's OpenMP team (the calling thread and its workers), and
the threads meet at every parallel region. When inference has just run on one core during the
bubble, the OS now and then wakes both of training's threads on the other core, and the compute
phase runs on one core until the load balancer moves a thread back: a stretched step with no
inference running in it. Measured on the 2-core VM over 400 compute phases a mode: the p99
compute phase was 16.7 ms with filling and 17.7 ms alone, unpinned, against 7.9 ms and 9.0 ms
pinned (median 6.3-7.0 ms). Pinning training's threads one per core keeps them apart; the
filler's lanes, started before, keep the whole machine.
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator


def native_worker_ids() -> list[int]:
    """The process's threads that Python did not start (torch's OpenMP workers, in the bench),
    by kernel thread id; [] where /proc is not there."""
    try:
        tids = {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return []
    python = {t.native_id for t in threading.enumerate()}
    return sorted(tids - python)


@contextmanager
def one_core_each(worker_ids: list[int]) -> Iterator[bool]:
    """Pin the calling thread to the first allowed CPU and each of `worker_ids` to the next ones
    (round robin over the rest), and put every thread's CPUs back on exit. Yields whether it
    pinned: not where the OS has no thread affinity or fewer than two CPUs are allowed."""
    if not hasattr(os, "sched_setaffinity"):
        yield False
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield False
        return
    me = threading.get_native_id()
    plan = {me: {cpus[0]}}
    plan.update({tid: {cpus[1 + i % (len(cpus) - 1)]} for i, tid in enumerate(worker_ids) if tid != me})
    saved = {}
    try:
        for tid, cpu in plan.items():
            try:
                saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cpu)
            except ProcessLookupError:  # the thread ended meanwhile
                saved.pop(tid, None)
        yield True
    finally:
        for tid, mask in saved.items():
            try:
                os.sched_setaffinity(tid, mask)
            except ProcessLookupError:
                pass
