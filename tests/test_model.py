import math

import numpy as np
import pytest

from tasks.model import Model
from tasks.profile import load_profile, profile_from_dict
from tests.conftest import SHIPPED_PROFILE


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.from_profile(load_profile(SHIPPED_PROFILE))


def one(model, cluster, loss, current=None):
    return {k: float(v[0]) for k, v in model.evaluate(model.counts_vector(cluster), loss, current).items()}


def test_orientation_values_from_the_contract(model):
    assert one(model, {"p3.2xlarge": 2, "g3.8xlarge": 2}, 0.9)["time_s"] == pytest.approx(1876, abs=1)
    # The paper's Table I observation for this plan: 2549.02 s.
    assert one(model, {"g3.8xlarge": 5, "g3.16xlarge": 3}, 0.8)["time_s"] == pytest.approx(2549.02, abs=0.05)


def test_convergence_coefficient(model):
    assert one(model, {"p3.2xlarge": 1}, 0.8)["cc"] == pytest.approx(0.0, abs=1e-12)
    for n in (2, 3, 5):
        assert one(model, {"g4dn.4xlarge": n}, 0.8)["cc"] == pytest.approx(math.sqrt((n - 1) / n))


def test_contention_regimes(model):
    p = model.profile
    # 8 workers want 8 * 142 = 1136 <= 1200 MB/s: no contention.
    assert model.worker_bandwidth_mbps(np.array(8.0)) == pytest.approx(p.required_bandwidth_mbps)
    # 20 workers: P = clip(0.8 * sqrt(20) - 1.92, 0, 1) = 1, so each gets Bps / n.
    assert model.worker_bandwidth_mbps(np.array(20.0)) == pytest.approx(1200 / 20)
    # 10 workers: partly contended.
    share = 0.8 * math.sqrt(10) - 1.92
    assert model.worker_bandwidth_mbps(np.array(10.0)) == pytest.approx(share * 120 + (1 - share) * 142)


def test_batch_evaluation_matches_single(model):
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 4, size=(50, 5))
    counts[counts.sum(1) == 0, 0] = 1
    batch = model.evaluate(counts, 0.8)
    for i in range(0, 50, 7):
        single = model.evaluate(counts[i], 0.8)
        for key in batch:
            assert batch[key][i] == pytest.approx(single[key][0])


def test_empty_cluster_is_infinite(model):
    r = model.evaluate(np.zeros(5), 0.8)
    assert math.isinf(r["time_s"][0]) and math.isinf(r["cost_usd"][0])


def test_remaining_work_with_current_loss(model):
    cluster = {"g3.8xlarge": 3}
    full_to_target = one(model, cluster, 0.8)["iterations"]
    full_to_current = one(model, cluster, 1.2)["iterations"]
    remaining = one(model, cluster, 0.8, current=1.2)["iterations"]
    assert remaining == pytest.approx(full_to_target - full_to_current)


def test_gamma4_form_uses_cc():
    data = load_profile(SHIPPED_PROFILE).model_dump()
    data["loss"]["gamma4"] = 0.5
    m = Model.from_profile(profile_from_dict(data))
    r = m.evaluate(m.counts_vector({"g4dn.4xlarge": 4}), 0.8)
    g = m.profile.loss
    expected = (g.gamma2 * 1024 + g.gamma3) * math.sqrt((math.sqrt(3 / 4) + 0.5) * 4) / (0.8 - g.gamma5) - g.gamma1
    assert r["iterations"][0] == pytest.approx(expected)


def test_bandwidth_margin_slows_prediction(model):
    slow = Model.from_profile(model.profile, bandwidth_margin=0.05)
    cluster = model.counts_vector({"g3.16xlarge": 8})
    assert slow.evaluate(cluster, 0.8)["time_s"][0] > model.evaluate(cluster, 0.8)["time_s"][0]
