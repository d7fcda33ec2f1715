import itertools
import math

import numpy as np
import pytest

from tasks.core.model import Model, overlap_shares
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


SHIPPED_PREDICTIONS = [  # (profile, cluster, loss target, iterations, time_s, cost_usd) before the further terms existed
    ("resnet110-cifar100.json", {"g3.8xlarge": 5, "g3.16xlarge": 3}, 0.8,
     20119.6120287558, 2549.0237904573364, 5.751447345868572),
    ("resnet110-cifar100.json", {"p3.2xlarge": 2, "g4dn.4xlarge": 3}, 0.8,
     16287.557795288383, 2770.5077702396566, 2.2468818016643617),
    ("transformer-lm-local-quick.json", {"p3.2xlarge": 2}, 1.9,
     102.32689791207204, 7.565326203675653, 0.0038583163638745833),
    ("transformer-lm-local-quick.json", {"p3.2xlarge": 4, "g3.8xlarge": 2}, 1.9,
     162.7086819983759, 6.547802328544088, 0.009166923259961723),
]


@pytest.mark.parametrize("name, cluster, loss, iterations, time_s, cost_usd", SHIPPED_PREDICTIONS)
def test_the_shipped_profiles_predict_bit_for_bit_as_before_the_further_terms(name, cluster, loss, iterations, time_s,
                                                                              cost_usd):
    """Captured before contention.overlap, contention.link_cap, loss.batch_n_exponent,
    loss.batch_staleness and loss.batch_noise existed:
    the shipped profiles carry none, and absent, null and the neutral values all give exactly those
    numbers, for these clusters and (neutral against absent) every cluster within the quotas."""
    path = SHIPPED_PROFILE.parent / name
    profile = load_profile(path)
    assert profile.contention.overlap is None and profile.loss.batch_n_exponent is None
    assert profile.contention.link_cap is None and profile.loss.batch_staleness is None
    assert profile.loss.batch_noise is None
    m = Model.from_profile(profile)
    r = one(m, cluster, loss)
    assert (r["iterations"], r["time_s"], r["cost_usd"]) == (iterations, time_s, cost_usd)
    data = profile.model_dump()
    data["contention"].update(overlap=0.0, overlap_width=0.2, link_cap=False)
    data["loss"].update(batch_n_exponent=0.0, batch_staleness=0.0, batch_noise=0.0)
    neutral = Model.from_profile(profile_from_dict(data))
    every = np.array(list(itertools.product(*(range(i.quota + 1) for i in profile.instances))))
    a, b = m.evaluate(every, loss), neutral.evaluate(every, loss)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_overlap_shares_count_each_workers_peers_of_about_its_period():
    alone = np.array([1.0, 1.1, 2.0])  # 10% and 50% slower than the first type
    shares = overlap_shares(np.array([[2, 0, 0], [1, 0, 1], [1, 1, 0], [1, 0, 0], [3, 0, 1]]), alone, 0.2)
    q = 1 - (1 - 1 / 1.1) / 0.2  # periods 9% apart: half of their transfers coincide
    assert shares[0][0] == 1.0  # one period: every transfer coincides with the peer's
    assert shares[1][0] == 0.0 and shares[1][2] == 0.0  # periods far apart drift through each other
    assert shares[2][0] == pytest.approx(q) and shares[2][1] == pytest.approx(q)
    assert shares[3][0] == 0.0  # alone: no peers
    assert shares[4][0] == pytest.approx(2 / 3) and shares[4][2] == 0.0  # two of its three peers share its period


def with_terms(contention=None, loss=None, name="transformer-lm-local-quick.json", **top):
    data = {**load_profile(SHIPPED_PROFILE.parent / name).model_dump(), **top}
    data["contention"].update(contention or {})
    data["loss"].update(loss or {})
    return Model.from_profile(profile_from_dict(data))


def test_the_overlap_term_slows_contended_workers_with_peers_of_their_period():
    """1 + omega * share stretches the PS time of a worker whose peers push with it, only where
    the PS is contended: same-speed clusters slow down, a mixed pair and an uncontended cluster
    do not."""
    plain, overlapping = with_terms(), with_terms({"overlap": 0.5, "overlap_width": 0.2})
    p = plain.profile
    same = plain.counts_vector({"p3.2xlarge": 3})
    t0, t1 = plain.cluster_iteration_times_s(same)[0], overlapping.cluster_iteration_times_s(same)[0]
    assert 3 * p.required_bandwidth_mbps > p.ps_bandwidth_mbps  # contended
    fast = plain.types.names.index("p3.2xlarge")
    ps_s = t0[fast] - plain.types.compute_s[fast] - 2 * plain.types.gpus[fast] * p.param_mb / p.pcie_bandwidth_mbps
    assert t1[fast] == pytest.approx(t0[fast] + 0.5 * ps_s)
    mixed = plain.counts_vector({"p3.2xlarge": 1, "g3.8xlarge": 1})
    alone = plain.alone_times_s
    assert 1 - alone.min() / alone.max() >= 0.2  # the two types' periods are far enough apart
    assert np.array_equal(plain.cluster_iteration_times_s(mixed), overlapping.cluster_iteration_times_s(mixed))
    assert overlapping.evaluate(same, 1.9)["time_s"][0] > plain.evaluate(same, 1.9)["time_s"][0]
    wide = with_terms({"overlap": 0.5}, ps_bandwidth_mbps=1e6)  # a PS that carries every transfer at once
    roomy = with_terms(ps_bandwidth_mbps=1e6)
    assert np.array_equal(wide.cluster_iteration_times_s(same), roomy.cluster_iteration_times_s(same))


@pytest.mark.parametrize("margin", [0.0, 0.1])
def test_the_link_cap_stretches_every_worker_alike_where_the_ps_link_is_full(margin):
    """Every update moves 2 S through the PS link: where Eq. 8-9 give a larger update rate than
    k * Bps / (2 S) (discounted by the bandwidth margin), every worker's time is stretched by one
    factor so that the rate is the link's; the WA batch and R stay as they were, and a cluster
    below the cap is untouched."""
    no_share = {"alpha1": 0.0, "beta1": 0.0}  # P = 0: every worker at Breq, past what the link carries
    plain = Model.from_profile(with_terms(no_share).profile, bandwidth_margin=margin)
    capped = Model.from_profile(with_terms({**no_share, "link_cap": True}).profile, bandwidth_margin=margin)
    p = plain.profile
    cap_per_s = p.ps_bandwidth_mbps * p.num_ps * (1 - margin) / (2 * p.param_mb)
    counts = np.array([plain.counts_vector(c) for c in ({"p3.2xlarge": 8, "g3.8xlarge": 2},
                                                        {"p3.2xlarge": 1, "g3.8xlarge": 1}, {})])
    a, b = plain.evaluate(counts, 1.9), capped.evaluate(counts, 1.9)
    assert 1 / a["iteration_time_s"][0] > cap_per_s  # beyond the link: capped to it
    assert 1 / b["iteration_time_s"][0] == pytest.approx(cap_per_s)
    t_plain, t_capped = plain.cluster_iteration_times_s(counts), capped.cluster_iteration_times_s(counts)
    assert t_capped[0] / t_plain[0] == pytest.approx(np.full(2, t_capped[0][0] / t_plain[0][0]))
    assert b["wa_batch"][0] == pytest.approx(a["wa_batch"][0]) and b["cc"][0] == pytest.approx(a["cc"][0])
    assert b["iterations"][0] == pytest.approx(a["iterations"][0])
    assert 1 / a["iteration_time_s"][1] < cap_per_s  # below it: as without the term
    assert np.array_equal(t_plain[1], t_capped[1]) and b["time_s"][1] == a["time_s"][1]
    assert b["time_s"][2] == np.inf  # an empty cluster stays empty


@pytest.mark.parametrize("eta", [-1.5, -0.5, 0.5, 1.0])
def test_the_batch_n_exponent_scales_the_batch_term_by_n(eta):
    m = with_terms(loss={"batch_n_exponent": eta}, name="resnet110-cifar100.json")
    g = m.profile.loss
    for n in (1, 3, 6):
        expected = (g.gamma2 * 1024 * n ** eta + g.gamma3) * math.sqrt(n) / (0.8 - g.gamma5) - g.gamma1
        assert one(m, {"g4dn.4xlarge": n}, 0.8)["iterations"] == pytest.approx(expected)


@pytest.mark.parametrize("psi, eta", [(0.0, None), (0.05, None), (0.3, None), (0.05, -0.5)])
def test_the_staleness_cost_adds_to_the_batch_slope_with_each_worker_beyond_the_first(psi, eta):
    """psi * bw * (n - 1) joins the batch term: nothing for one worker, and a slope that rises
    with n, so that with gamma2 < 0 a larger batch needs fewer updates in a small cluster and
    more in a large one (docs/model.md, Further terms)."""
    m = with_terms(loss={"batch_staleness": psi, "batch_n_exponent": eta}, name="resnet110-cifar100.json")
    g = m.profile.loss
    for n in (1, 3, 6):
        slope = g.gamma2 * (1.0 if eta is None else n ** eta) + psi * (n - 1)
        expected = (slope * 1024 + g.gamma3) * math.sqrt(n) / (0.8 - g.gamma5) - g.gamma1
        assert one(m, {"g4dn.4xlarge": n}, 0.8)["iterations"] == pytest.approx(expected)
    base = with_terms(loss={"batch_n_exponent": eta}, name="resnet110-cifar100.json")
    alone = one(m, {"g4dn.4xlarge": 1}, 0.8)["iterations"]
    assert alone == pytest.approx(one(base, {"g4dn.4xlarge": 1}, 0.8)["iterations"])


@pytest.mark.parametrize("beta, psi", [(0.0, None), (2e5, None), (2e6, None), (2e5, 0.05)])
def test_the_gradient_noise_adds_beta_over_the_batch_so_updates_fall_as_one_over_the_batch(beta, psi):
    """beta / bw joins Eq. 3's numerator (docs/model.md, Further terms): the updates to a target
    fall as 1 / bw towards a floor, steeply for small batches and little for large ones (convex
    in the batch), at every cluster size."""
    m = with_terms(loss={"batch_noise": beta, "batch_staleness": psi}, name="resnet110-cifar100.json")
    g = m.profile.loss
    for n in (1, 3, 6):
        slope = g.gamma2 + (psi or 0.0) * (n - 1)
        expected = (slope * 1024 + g.gamma3 + beta / 1024) * math.sqrt(n) / (0.8 - g.gamma5) - g.gamma1
        assert one(m, {"g4dn.4xlarge": n}, 0.8)["iterations"] == pytest.approx(expected)
    j = [float(m.iterations(bw, 0.0, 2, 0.8)) for bw in (256.0, 512.0, 1024.0)]
    if beta > 0 and psi is None:
        assert j[0] - j[1] > j[1] - j[2]  # halving a small batch costs more updates than halving a large one
