"""`spotfill train` on the local provider with a multi-GPU type: one worker per instance, one
replica per GPU (tasks/runtime/replicas.py)."""
from __future__ import annotations

import json

import pytest

from tasks.runtime import wire
from tasks.runtime.replicas import pcie_floor_s
from tasks.runtime.telemetry import read_records
from tasks.runtime.workloads import build_workload
from tests.helpers import alive_pids, spotfill

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_four_gpu_instance_trains_four_replicas_and_pushes_four_batches_per_gpu_at_once(tmp_path):
    done = spotfill("train", "--workload", "resnet20", "--workload-opt", "width=4",
                    "--workers", "g3.16xlarge=1,p3.2xlarge=1", "--batch-size", "4", "--max-updates", "20",
                    "--bandwidth-scale", "1e-4", "--artifacts", str(tmp_path), "--run-id", "mg", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert sorted((w["instance_type"], w["gpus"]) for w in result["workers"].values()) == [
        ("g3.16xlarge", 4), ("p3.2xlarge", 1)]  # five replicas, two workers as the PS sees them
    records = read_records(tmp_path / "mg")
    updates = {t: [r for r in records if r["kind"] == "update" and r["instance_type"] == t]
               for t in ("g3.16xlarge", "p3.2xlarge")}
    assert updates["g3.16xlarge"] and updates["p3.2xlarge"]
    assert {r["samples"] for r in updates["g3.16xlarge"]} == {16} and {r["samples"] for r in updates["p3.2xlarge"]} == {4}
    # the sum is paced to the profile's PCIe bandwidth (10000 MB/s) times the bandwidth scale
    floor_s = pcie_floor_s(4, wire.flat_size(build_workload("resnet20", {"width": 4}).model), 8 * 10000 * 1e-4)
    # (its buckets hold the link that long; most of it during backward, the rest exposed: intra_sum_s)
    assert min(r["intra_sum_link_s"] for r in updates["g3.16xlarge"]) >= floor_s > 0.005
    assert all(r["intra_sum_s"] >= 0 for r in updates["g3.16xlarge"])
    assert all(r["intra_sum_s"] is None and r["intra_sum_link_s"] is None for r in updates["p3.2xlarge"])
    assert not alive_pids(tmp_path)
