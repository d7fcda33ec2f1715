"""What several test modules share: the repository's paths and plain helpers (no fixtures: those
live in conftest.py). Test modules import from here, never from one another."""
from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from hypothesis import assume
from hypothesis import strategies as st

from tasks.core.lifeline import tied_to_this_process
from tasks.core.processes import process_stats
from tasks.core.profile import profile_from_dict
from tasks.market.policies import Policy
from tasks.providers.base import InstanceType

REPO = Path(__file__).resolve().parents[1]
SHIPPED_PROFILE = REPO / "profiles" / "resnet110-cifar100.json"
LOCAL_QUICK_PROFILE = REPO / "profiles" / "transformer-lm-local-quick.json"
SOURCES = REPO / "profiles" / "sources"
PRICE_ARCHIVE = SOURCES / "spot-prices-gpu-2022-05-31.tsv"


def spotfill(*args: str) -> subprocess.CompletedProcess:
    """`spotfill ARGS` as a real subprocess, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "tasks.cli.main", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@dataclass(frozen=True)
class RecordingPolicy(Policy):
    """A replay policy that remembers every situation it was asked to plan for."""

    seen: list = field(default_factory=list)

    def plan(self, profile, loss_target, s):
        self.seen.append(s)
        return super().plan(profile, loss_target, s)


def process_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, or one being reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


@contextlib.contextmanager
def prefect_servers_tied_to_this_process() -> Iterator[None]:
    """Within the block, the API servers Prefect's test harness starts (SubprocessASGIServer) run
    through tasks.core.lifeline: a test run killed part way (its shell gone, a SIGKILL) takes
    them with it instead of leaving them running for good. Prefect's server module alone gets a
    `subprocess` whose Popen ties what it starts; every other start is untouched."""
    from prefect.server.api import server

    class TiedPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            super().__init__(tied_to_this_process(list(args)), *rest, **kwargs)

    tied = types.SimpleNamespace(**{**vars(subprocess), "Popen": TiedPopen})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server, "subprocess", tied)
        yield


def children_of(pid: int) -> list[int]:
    """The running processes whose parent is `pid`."""
    return [p.pid for p in process_stats() if p.parent == pid and p.running]


def alive_pids(artifacts: Path) -> list[int]:
    """Processes of any run under `artifacts` that still exist."""
    return [row["pid"] for table in artifacts.glob("*/instances.json")
            for row in json.loads(table.read_text())["instances"] if process_alive(row["pid"])]


def t4_profile(types: dict[str, InstanceType], quotas: dict[str, int]):
    """The shipped ResNet-110 profile moved onto the T4 types that moto and the price archive both
    know: g4dn.2xlarge takes the measured g4dn.4xlarge's compute time (same single T4),
    g4dn.12xlarge has four T4s; prices from `types`, quotas from `quotas`."""
    shipped = json.loads(SHIPPED_PROFILE.read_text())
    t4 = next(i for i in shipped["instances"] if i["type"] == "g4dn.4xlarge")
    shipped["instances"] = [
        {**t4, "type": name, "gpus": types[name].gpus, "quota": quotas[name],
         "spot_price": types[name].spot_usd_per_h, "on_demand_price": types[name].on_demand_usd_per_h}
        for name in ("g4dn.2xlarge", "g4dn.12xlarge")
    ]
    return profile_from_dict(shipped, source="t4 test profile")


def fake_result(rate: float) -> dict:
    """A single-rate result shaped like `spotfill bench filling`'s _run_one's (numbers made up)."""
    from tasks.bench import filling as bench  # here, not at the top: it imports torch (about 2 s)

    mode = {"training_retained": 0.99, "step_slowdown_p50": 0.01, "step_slowdown_p99": 0.03,
            "fill_efficiency": 0.6, "spill_fraction": 0.1, "spill_share_of_training_time": 0.02,
            "offline_samples_per_s": 500.0, "offline_share_of_solo": 0.3, "online_p50_s": 0.002,
            "online_p95_s": 0.01, "online_p99_s": 0.02, "online_wait_p95_s": 0.008, "online_served": 120,
            "online_shed": 0, "guard_shrinks": 0}
    modes = {m: dict(mode) for m in bench.MODES}
    modes["naive"]["online_p95_s"] = 0.02
    result = {"online_rate_per_s": rate, "training_retained": 0.99, "naive_training_retained": 0.7,
              "step_slowdown_p50": 0.01, "step_slowdown_p99": 0.03, "fill_efficiency": 0.6,
              "training_retained_p10": 0.97, "training_retained_p50": 0.99, "training_retained_p90": 1.01,
              "step_slowdown_p99_median": 0.03, "step_slowdown_p99_worst": 0.08,
              "step_slowdown_p99_worst_over_floor": 0.02,
              "noise_floor": {"training_retained": 1.0, "step_slowdown_p50": 0.0, "step_slowdown_p99": 0.0,
                              "training_retained_p10": 0.98, "training_retained_p50": 1.0,
                              "training_retained_p90": 1.02, "step_slowdown_p99_median": 0.0,
                              "step_slowdown_p99_worst": 0.06},
              "spill_sources": {"offline_spill_s": 0.004, "online_spill_s": 0.0, "offline_chunks": 300,
                                "offline_chunks_spilled": 2, "overrun_max": 1.4,
                                "online_requests_outside_bubbles": 0, "stretched_steps": 1,
                                "guard_shrinks": 1, "guard_reaction_steps_max": 0,
                                "stretched_steps_unanswered": 0, "guard_calibrating_steps": 3},
              "spill_fraction": 0.1, "offline_samples_per_s": 500.0, "offline_share_of_solo": 0.3,
              "online_p95_s": 0.01, "naive_online_p95_s": 0.02, "naive_split_online_p95_s": 0.02,
              "online_p95_over_naive": 0.5, "modes": modes,
              "solo_inference": {"offline_samples_per_s": 1600.0, "online_p50_s": 0.001,
                                 "online_p95_s": 0.002, "online_p99_s": 0.003},
              "settings": {"device": "cpu", "device_name": "cpu", "compute_s": 0.02, "comm_s": 0.02,
                           "rounds_run": 12, "block_steps": 6, "elapsed_s": 40.0,
                           "training": "small-cnn", "training_batch": 64, "param_mb": 1.72,
                           "instance_type": "p3.2xlarge", "bubble_scale": 1.0,
                           "fill_config": {"slo_s": 0.5, "model": "cnn"}},
              "plot": None}
    result["checks"] = bench.judge(result, bench.TARGETS)
    result["targets_met"] = all(c["met"] for c in result["checks"].values())
    return result


KAPPAS = st.sampled_from([None, 0.25, 0.5, 0.75, 1.0])
CONTENTION_BY = st.sampled_from([None, "workers", "load"])


@st.composite
def profiles(draw, max_types=4, max_quota=4, kappa=KAPPAS, by=CONTENTION_BY, further=st.just({}),
             ps_bandwidth=st.floats(300, 2000)):
    """Random small profiles (a hypothesis strategy) for the planner's property tests: types
    t0.x, t1.x, ... with quotas up to max_quota, at least one of them above 0. `further` draws
    the further terms: {"overlap": ..., "overlap_width": ..., "link_cap": ..., "batch_n_exponent": ...,
    "batch_staleness": ...}
    (none by default: the paper's form); `ps_bandwidth` draws Bps (a narrow one fills the PS link)."""
    m = draw(st.integers(1, max_types))
    instances = []
    for i in range(m):
        instances.append({
            "type": f"t{i}.x", "gpus": draw(st.sampled_from([1, 2, 4, 8])),
            "batch_per_gpu": draw(st.sampled_from([256, 512, 1024])),
            "compute_time_s": draw(st.floats(0.2, 4.0)),
            "spot_price": draw(st.floats(0.1, 3.0)), "on_demand_price": 5.0,
            "quota": draw(st.integers(0, max_quota)),
        })
    if all(i["quota"] == 0 for i in instances):
        instances[0]["quota"] = 1
    terms = draw(further)
    return profile_from_dict({
        "workload": "w", "param_mb": draw(st.floats(2, 40)), "required_bandwidth_mbps": draw(st.floats(50, 300)),
        "ps_bandwidth_mbps": draw(ps_bandwidth), "pcie_bandwidth_mbps": 10000, "num_ps": 1,
        "contention": {"alpha1": draw(st.floats(-0.3, 1.2)), "beta1": draw(st.floats(-3.0, 0.5)), "by": draw(by),
                       **{k: v for k, v in terms.items() if k.startswith("overlap") or k == "link_cap"}},
        "loss": {"gamma1": draw(st.floats(0, 1500)), "gamma2": draw(st.floats(-0.25, 0.05)),
                 "gamma3": 2507.6, "gamma4": draw(st.sampled_from([None, 0.05, 0.5])), "gamma5": 0.5,
                 "kappa": draw(kappa), **{k: v for k, v in terms.items() if k.startswith("batch_")}},
        "instances": instances,
    })


def fastest(profile, loss, **kw):
    """The fastest plan's time; cases where the target is met before training starts are skipped."""
    from tasks.planner import PlanRequest, fastest_time_s  # here: the planner is not every test's
    from tasks.planner.problem import build_problem

    best = fastest_time_s(build_problem(PlanRequest(profile, loss, 1e12, **kw)))
    assume(0 < best < math.inf)
    return best


def same_cost(a, b):
    """Equal costs up to the planner's tie tolerance (COST_TIE_REL)."""
    from tasks.planner.problem import COST_TIE_REL

    return abs(a - b) <= COST_TIE_REL * max(abs(a), abs(b)) + 1e-15


def observation(**patch):
    """A session Observation with plain defaults, the fields given replaced."""
    from tasks.pipeline.session import Observation

    base = dict(t_s=10.0, loss=2.0, updates=100, samples=1000, workers={"p3.2xlarge": 2}, spent_usd=0.0,
                ps_spent_usd=0.0, loss_fraction=0.1, time_fraction=0.1)
    return Observation(**(base | patch))


def sleeper_startup():
    """An instance that sleeps for two minutes: a process to start, watch and end."""
    from tasks.providers.base import Startup

    return Startup(("python", "-c", "import time; time.sleep(120)"))


def validated_with_fake_runs(monkeypatch, profile, clusters: list[dict], observed_s: dict[str, float]):
    """validate_profile on `clusters` with every run replaced by one that observes
    `observed_s[cluster_label(cluster)]` seconds (predicted 10 s): a report without training."""
    from tasks.profiling import validate
    from tasks.profiling.measurements import cluster_label

    def fake_run_once(provider, run_id, profile, workload, prediction, loss_target, **kwargs):
        seconds = observed_s[cluster_label(prediction.cluster)]
        return validate.RunObservation(
            observed_time_s=seconds, observed_iterations=100, predicted_time_s=10.0, paper_time_s=10.0,
            baseline_time_s=9.0, speed_time_s=10.0, baseline_speed_time_s=9.0, observed_iteration_time_s=0.1,
            start_skew_s=0.5, wall_s=seconds, compute_stretch=1.0)

    monkeypatch.setattr(validate, "run_once", fake_run_once)
    return validate.validate_profile(None, profile, "transformer-lm", clusters, 1.9, run_id="v")
