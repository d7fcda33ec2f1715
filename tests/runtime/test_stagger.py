"""Same-type workers spread over their period: the slots, the fractions, the one wait."""
from __future__ import annotations

import threading

import pytest

from tasks.runtime import wire, worker
from tasks.runtime.driver import free_port
from tasks.runtime.ps import ParameterServer, PsConfig
from tasks.runtime.stagger import ALIGN_STEP, PhaseAligner, TypeSlots, aligned_start_s, spread_fraction
from tasks.runtime.telemetry import read_records


def test_the_first_k_fractions_spread_over_the_period_for_any_k():
    assert [spread_fraction(r) for r in range(8)] == [0, 0.5, 0.25, 0.75, 0.125, 0.625, 0.375, 0.875]
    for k in range(2, 40):
        points = sorted(spread_fraction(r) for r in range(k))
        assert len(set(points)) == k
        gaps = [b - a for a, b in zip(points, points[1:])] + [1 + points[0] - points[-1]]
        assert max(gaps) <= 2 / k  # never worse than twice the even spacing
    with pytest.raises(ValueError):
        spread_fraction(-1)


def test_the_aligned_start_is_the_next_moment_at_the_slots_phase():
    assert aligned_start_s(10.0, 0.0, 1.0, 0.5) == 10.5
    assert aligned_start_s(10.5, 0.0, 1.0, 0.5) == 10.5  # already there: no wait
    assert aligned_start_s(10.6, 0.0, 1.0, 0.5) == pytest.approx(11.5)
    assert aligned_start_s(3.2, 1.0, 0.4, 0.25) == pytest.approx(3.5)  # 1 + (6 + 0.25) * 0.4; 3.1 has passed
    assert aligned_start_s(7.0, 0.0, 0.0, 0.5) == 7.0  # no period known: no wait


def test_each_type_takes_the_lowest_free_slot_and_aligns_to_its_oldest_worker():
    slots = TypeSlots()
    assert [slots.take("p3", 1), slots.take("p3", 2), slots.take("g3", 3), slots.take("p3", 4)] == [0, 0.5, 0, 0.25]
    assert slots.phase("p3", 2) == (0.5, 0.0)  # the anchor (worker 1) has not started
    slots.started(1, 100.0)
    slots.started(2, 100.2)
    assert slots.phase("p3", 1) == (0.0, 0.0)  # the anchor never waits
    assert slots.phase("p3", 2) == (0.5, 100.0) and slots.phase("p3", 4) == (0.25, 100.0)
    assert slots.phase("g3", 3) == (0.0, 0.0)  # alone in its type
    # the anchor leaves: the oldest left (worker 2, slot 1/2) anchors, and each fraction counts from its
    slots.free("p3", 1)
    assert slots.phase("p3", 4) == (0.75, 100.2)
    assert slots.take("p3", 5) == 0.0  # a replacement takes the freed slot: half a period after the new anchor
    assert slots.phase("p3", 5) == (0.5, 100.2)


def test_the_worker_waits_once_for_its_phase_from_its_measured_period():
    aligner = PhaseAligner()
    # iteration starts every 0.2 s from 100.03: the period is read from starts 1..ALIGN_STEP
    starts = [100.03 + 0.2 * k for k in range(ALIGN_STEP + 3)]
    waits = [aligner.wait_s(t, 0.5, 100.0) for t in starts]
    assert waits[:ALIGN_STEP] == [0.0] * ALIGN_STEP and waits[ALIGN_STEP + 1:] == [0.0, 0.0]
    # at 100.83 the next moment of the form 100 + (m + 0.5) * 0.2 is 100.9
    assert waits[ALIGN_STEP] == pytest.approx(0.07)
    # the anchor (no start to align to at its aligning step) never waits
    anchor = PhaseAligner()
    assert [anchor.wait_s(t, 0.0, 0.0) for t in starts] == [0.0] * len(starts)


def test_the_ps_gives_same_type_workers_different_slots_and_the_workers_align(tmp_path):
    """A real PS and two workers of one type and one of another, in threads: the join records
    carry the slots' fractions (the two of one type half a period apart, the other type's alone
    at 0), and every worker trains past its aligned step."""
    port = free_port()
    ps = ParameterServer(PsConfig(run_dir=tmp_path, port=port, workload="resnet20", workload_options={"width": 4}))
    thread = threading.Thread(target=ps.serve, args=(wire.host_store(port, 30),))
    thread.start()
    results, errors = {}, []

    def train(name: str, instance_type: str):
        try:
            config = worker.WorkerConfig("127.0.0.1", port, "resnet20", 8, workload_options={"width": 4},
                                         instance_type=instance_type, instance_id=name, max_steps=ALIGN_STEP + 3,
                                         connect_timeout_s=30)
            results[name] = worker.run_worker(config)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    workers = [threading.Thread(target=train, args=(name, t))
               for name, t in (("a", "p3.2xlarge"), ("b", "p3.2xlarge"), ("c", "g3.8xlarge"))]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=300)
    finally:
        ps.request_stop("test")
        thread.join(timeout=120)
    assert not errors and all(results[n].steps == ALIGN_STEP + 3 for n in "abc")
    joins = [r for r in read_records(tmp_path) if r["kind"] == "join"]
    by_type = {}
    for r in joins:
        by_type.setdefault(r["instance_type"], []).append(r["phase"])
    assert sorted(by_type["p3.2xlarge"]) == [0.0, 0.5] and by_type["g3.8xlarge"] == [0.0]
