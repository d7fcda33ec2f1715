import os
import threading

import pytest

from tasks.bench.cpu_pinning import native_worker_ids, one_core_each

needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs thread affinity and two CPUs")


def idle_thread():
    """A thread that waits until told, and its stop event."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    return thread, stop


def test_python_threads_are_not_taken_for_torchs_workers():
    thread, stop = idle_thread()
    try:
        assert thread.native_id not in native_worker_ids()
        assert threading.get_native_id() not in native_worker_ids()
    finally:
        stop.set()
        thread.join()


@needs_two_cpus
def test_the_caller_and_each_worker_get_a_core_of_their_own_and_everything_is_put_back():
    thread, stop = idle_thread()
    cpus = sorted(os.sched_getaffinity(0))
    before = (os.sched_getaffinity(0), os.sched_getaffinity(thread.native_id))
    try:
        with one_core_each([thread.native_id]) as pinned:
            assert pinned
            assert os.sched_getaffinity(0) == {cpus[0]}
            assert os.sched_getaffinity(thread.native_id) == {cpus[1]}
        assert (os.sched_getaffinity(0), os.sched_getaffinity(thread.native_id)) == before
    finally:
        stop.set()
        thread.join()


@needs_two_cpus
def test_a_worker_that_ended_before_the_pinning_is_skipped():
    thread, stop = idle_thread()
    gone = thread.native_id
    stop.set()
    thread.join()
    before = os.sched_getaffinity(0)
    with one_core_each([gone]) as pinned:
        assert pinned
    assert os.sched_getaffinity(0) == before
