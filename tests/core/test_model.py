import math

import numpy as np
import pytest

from tasks.core.model import Model
from tasks.core.profile import load_profile, profile_from_dict
from tests.helpers import SHIPPED_PROFILE


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


def test_a_profile_without_the_extensions_predicts_bit_for_bit_as_before(model):
    """Captured from the shipped profile before loss.kappa and contention.by existed; absent,
    null and the paper's explicit "workers" all give exactly those numbers."""
    data = load_profile(SHIPPED_PROFILE).model_dump()
    for contention_by in (None, "workers"):
        data["contention"]["by"] = contention_by
        m = Model.from_profile(profile_from_dict(data))
        r = one(m, {"p3.2xlarge": 2, "g3.8xlarge": 2}, 0.9)
        assert (r["iterations"], r["time_s"], r["cost_usd"]) == (10637.499999999998, 1876.1275462918966, 1.6697535161997878)
        assert one(m, {"p3.2xlarge": 1}, 0.9)["time_s"] == 2651.26247312676


def with_extensions(kappa=None, by=None, gamma4=None):
    data = load_profile(SHIPPED_PROFILE).model_dump()
    data["loss"].update(kappa=kappa, gamma4=gamma4)
    data["contention"]["by"] = by
    return Model.from_profile(profile_from_dict(data))


@pytest.mark.parametrize("kappa", [0.25, 0.75, 1.0])
def test_kappa_is_the_exponent_of_the_cluster_term(kappa):
    m, g = with_extensions(kappa=kappa), with_extensions(kappa=kappa).profile.loss
    for n in (1, 3, 6):
        expected = (g.gamma2 * 1024 + g.gamma3) * n ** kappa / (0.8 - g.gamma5) - g.gamma1
        assert one(m, {"g4dn.4xlarge": n}, 0.8)["iterations"] == pytest.approx(expected)
    m4 = with_extensions(kappa=kappa, gamma4=0.5)
    expected = (g.gamma2 * 1024 + g.gamma3) * ((math.sqrt(3 / 4) + 0.5) * 4) ** kappa / (0.8 - g.gamma5) - g.gamma1
    assert one(m4, {"g4dn.4xlarge": 4}, 0.8)["iterations"] == pytest.approx(expected)


def test_contention_by_load_counts_slow_workers_as_part_of_a_fast_one():
    by_load, by_workers = with_extensions(by="load"), with_extensions(by="workers")
    alone = by_load.alone_times_s
    fast, slow = by_load.types.names.index("p3.2xlarge"), by_load.types.names.index("p2.8xlarge")
    counts = np.zeros(len(alone))
    counts[fast], counts[slow] = 2, 6
    n_eff = 2 + 6 * min(alone[fast], alone[slow]) / alone[slow]
    assert by_load.ps_load(counts)[0] == pytest.approx(n_eff) and n_eff < 8
    assert by_workers.ps_load(counts)[0] == 8
    assert np.allclose(by_load.cluster_iteration_times_s(counts), by_load.iteration_times_s(np.array([n_eff])))
    # one type: both forms agree
    homogeneous = by_load.counts_vector({"g3.16xlarge": 7})
    for key in ("iteration_time_s", "time_s"):
        assert by_load.evaluate(homogeneous, 0.8)[key][0] == pytest.approx(by_workers.evaluate(homogeneous, 0.8)[key][0])
    mixed = by_load.counts_vector({"p3.2xlarge": 2, "p2.8xlarge": 12})  # contended by n, less so by n_eff
    assert by_load.evaluate(mixed, 0.8)["time_s"][0] < by_workers.evaluate(mixed, 0.8)["time_s"][0]
