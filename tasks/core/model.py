"""The spotDNN analytical performance model (docs/model.md), vectorised.

`evaluate` takes many candidate clusters at once (a K x M matrix of instance counts over the
profile's M types) and returns their predicted iteration time, WA batch size, convergence
coefficient, iterations and training time and cost, so that solvers can score thousands of
clusters per numpy call. The paper's form is the default; a profile may select the extensions
of docs/model.md (`loss.kappa`, `contention.by = "load"`) and its further terms
(`contention.overlap`, `contention.link_cap`, `loss.batch_n_exponent`, `loss.batch_staleness`). Every prediction of time
and iterations (predict, plan, the risk model, the replay, validation and the fit's held-out
errors) is computed here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.core.profile import DEFAULT_OVERLAP_WIDTH, Profile


def contended_bandwidth_mbps(load, alpha1: float, beta1: float, breq_mbps: float, bps_mbps: float) -> np.ndarray:
    """Bwk of Eq. 8 with P of Eq. 9, for a PS loaded as `load` workers load it."""
    load = np.asarray(load, dtype=float)
    share = np.clip(alpha1 * np.sqrt(load) + beta1, 0.0, 1.0)
    contended = share * bps_mbps / np.maximum(load, 1.0) + (1.0 - share) * breq_mbps
    return np.where(load * breq_mbps <= bps_mbps, breq_mbps, contended)


def cluster_spread(cc, n, gamma4: float | None, kappa: float | None):
    """Eq. 3's cluster term ((R + gamma4) * n) ** kappa (gamma4 null: n ** kappa); kappa null is
    the paper's square root, computed as np.sqrt so that paper-form profiles predict bit for bit
    as before the extension."""
    base = np.asarray(n, dtype=float) if gamma4 is None else np.clip(np.asarray(cc, dtype=float) + gamma4, 0.0, None) * n
    return np.sqrt(base) if kappa is None else base ** kappa


def batch_slope(n, gamma2: float, batch_n_exponent: float | None = None, batch_staleness: float | None = None):
    """The batch term's slope at cluster size n: gamma2 * n ** eta + psi * (n - 1). Both further
    terms null: gamma2 itself (a float, so that paper-form profiles compute as before the terms)."""
    if batch_n_exponent is None and batch_staleness is None:
        return gamma2
    n = np.maximum(np.asarray(n, dtype=float), 1.0)
    slope = gamma2 if batch_n_exponent is None else gamma2 * n ** batch_n_exponent
    return slope if batch_staleness is None else slope + batch_staleness * (n - 1.0)


def curve_numerator(bw, cc, n, gamma2: float, gamma3: float, gamma4: float | None, kappa: float | None,
                    batch_n_exponent: float | None = None, batch_staleness: float | None = None,
                    batch_noise: float | None = None):
    """Eq. 3's numerator (gamma2 * bw * n ** eta + psi * (n - 1) * bw + gamma3 + beta / bw) *
    cluster_spread; eta, psi and beta null are the paper's batch term gamma2 * bw, each computed as
    before its term existed (bit for bit)."""
    spread = cluster_spread(cc, n, gamma4, kappa)
    if batch_staleness is not None or batch_noise is not None:
        noise = 0.0 if batch_noise is None else batch_noise / np.asarray(bw, dtype=float)
        return (batch_slope(n, gamma2, batch_n_exponent, batch_staleness) * bw + gamma3 + noise) * spread
    if batch_n_exponent is None:
        return (gamma2 * bw + gamma3) * spread
    return (gamma2 * bw * np.maximum(np.asarray(n, dtype=float), 1.0) ** batch_n_exponent + gamma3) * spread


def overlap_shares(counts, alone_s: np.ndarray, width: float) -> np.ndarray:
    """Each type's overlap share in each of K clusters (K x M): the mean, over a worker's peers,
    of q = max(0, 1 - (1 - T_short / T_long) / width) of the two types' periods alone. Workers
    of one period push at the same moments on every iteration (q = 1); periods a share `width`
    or more apart drift through each other's transfers and meet only at random (q = 0). A worker
    alone has no peers (0)."""
    counts = np.atleast_2d(np.asarray(counts, dtype=float))
    alone_s = np.asarray(alone_s, dtype=float)
    ratio = np.minimum.outer(alone_s, alone_s) / np.maximum.outer(alone_s, alone_s)
    q = np.clip(1.0 - (1.0 - ratio) / width, 0.0, 1.0)
    n = counts.sum(axis=1, keepdims=True)
    peers = np.clip(counts @ q - 1.0, 0.0, None)  # q[i, i] = 1: a worker is not its own peer
    return np.where(n > 1, peers / np.maximum(n - 1.0, 1.0), 0.0)


@dataclass(frozen=True)
class TypeArrays:
    """The per-type numbers of a profile as arrays, in the profile's order."""

    names: tuple[str, ...]
    gpus: np.ndarray
    batch: np.ndarray  # samples per iteration of one instance: gpus * batch_per_gpu
    compute_s: np.ndarray
    spot_usd_per_h: np.ndarray
    on_demand_usd_per_h: np.ndarray
    quota: np.ndarray

    @classmethod
    def from_profile(cls, profile: Profile) -> "TypeArrays":
        insts = profile.instances
        return cls(
            names=tuple(i.type for i in insts),
            gpus=np.array([i.gpus for i in insts], dtype=float),
            batch=np.array([i.gpus * i.batch_per_gpu for i in insts], dtype=float),
            compute_s=np.array([i.compute_time_s for i in insts], dtype=float),
            spot_usd_per_h=np.array([i.spot_price for i in insts], dtype=float),
            on_demand_usd_per_h=np.array([i.on_demand_price for i in insts], dtype=float),
            quota=np.array([i.quota for i in insts], dtype=np.int64),
        )


@dataclass(frozen=True)
class Model:
    """A profile's model, ready to score clusters.

    `bandwidth_margin` (0 <= m < 1) discounts the network bandwidths (Breq and Bps) by that
    fraction: the paper over-provisions by 1-5% because the model tends to over-predict bandwidth.
    `on_demand` prices clusters at on-demand rather than spot prices.
    """

    profile: Profile
    types: TypeArrays
    bandwidth_margin: float = 0.0
    on_demand: bool = False

    @classmethod
    def from_profile(cls, profile: Profile, bandwidth_margin: float = 0.0, on_demand: bool = False) -> "Model":
        return cls(profile, TypeArrays.from_profile(profile), bandwidth_margin, on_demand)

    @property
    def prices_usd_per_h(self) -> np.ndarray:
        return self.types.on_demand_usd_per_h if self.on_demand else self.types.spot_usd_per_h

    @property
    def ps_link_mbps(self) -> float:
        """k * Bps, discounted by the bandwidth margin: what the PS link carries."""
        return self.profile.ps_bandwidth_mbps * self.profile.num_ps * (1.0 - self.bandwidth_margin)

    def worker_bandwidth_mbps(self, load: np.ndarray) -> np.ndarray:
        """Bwk for clusters loading the PS as `load` workers do (Eq. 8, 9; see ps_load)."""
        p = self.profile
        return contended_bandwidth_mbps(load, p.contention.alpha1, p.contention.beta1,
                                        p.required_bandwidth_mbps * (1.0 - self.bandwidth_margin), self.ps_link_mbps)

    def iteration_times_s(self, load: np.ndarray, overlap_factor=None) -> np.ndarray:
        """T_i of one instance of each type in a cluster loading the PS as `load` workers do
        (Eq. 6, 7): shape (..., M). With contention by workers the load is the cluster size.
        `overlap_factor` (..., M) stretches each type's PS transfers (overlap_factors); None is the
        paper's Eq. 7, and a factor >= 1 only makes T_i longer."""
        p = self.profile
        bwk = self.worker_bandwidth_mbps(load)[..., None]
        pcie_s = 2.0 * self.types.gpus * p.param_mb / p.pcie_bandwidth_mbps
        ps_s = 2.0 * p.param_mb / bwk
        return self.types.compute_s + (ps_s if overlap_factor is None else ps_s * overlap_factor) + pcie_s

    @property
    def alone_times_s(self) -> np.ndarray:
        """Each type's iteration time alone (one worker): the M-vector T_alone."""
        return self.iteration_times_s(np.array(1.0))

    def ps_load(self, counts: np.ndarray) -> np.ndarray:
        """The PS load of K clusters (K x M counts) in workers: n for contention by workers (the
        paper); for contention by load n_eff = sum_i T_fast / T_i_alone, T_fast the smallest
        T_alone in the cluster (docs/model.md, Extensions), which is n for one type."""
        counts = np.atleast_2d(np.asarray(counts, dtype=float))
        n = counts.sum(axis=1)
        if self.profile.contention.by != "load":
            return n
        alone = self.alone_times_s
        with np.errstate(invalid="ignore"):  # empty clusters: 0 * inf, replaced below
            load = (counts / alone).sum(axis=1) * np.where(counts > 0, alone, np.inf).min(axis=1)
        return np.where(n > 0, load, 0.0)

    def overlap_factors(self, counts: np.ndarray, load: np.ndarray) -> np.ndarray | None:
        """1 + omega * s_i (overlap_shares) for each type of K clusters, where the PS is contended
        (load * Breq > Bps: transfers that coincide slow each other only when the PS link cannot
        carry them at once); None without the term (docs/model.md, Further terms)."""
        c, p = self.profile.contention, self.profile
        if not c.overlap:
            return None
        shares = overlap_shares(counts, self.alone_times_s, c.overlap_width or DEFAULT_OVERLAP_WIDTH)
        contended = load * p.required_bandwidth_mbps > p.ps_bandwidth_mbps * p.num_ps
        return 1.0 + c.overlap * shares * contended[:, None]

    def cluster_iteration_times_s(self, counts: np.ndarray) -> np.ndarray:
        """T_i of each type in each of K clusters (K x M counts): K x M."""
        counts = np.atleast_2d(np.asarray(counts, dtype=float))
        load = self.ps_load(counts)
        t_i = self.iteration_times_s(load, self.overlap_factors(counts, load))
        return t_i if not self.profile.contention.link_cap else t_i * self.link_cap_stretch(counts, t_i)[:, None]

    def link_cap_stretch(self, counts: np.ndarray, t_i: np.ndarray) -> np.ndarray:
        """max(1, X / X_cap) for K clusters: every update moves 2 S through the PS link of k * Bps,
        so the update rate X = sum n_i / T_i cannot exceed X_cap = k * Bps / (2 S), Eq. 8's own
        limit (at P = 1 each worker gets Bps / n). Where Eq. 8-9 give more, every worker's time is
        stretched by the same factor: the workers' shares, and so bw and R, stay as they were."""
        cap_per_s = self.ps_link_mbps / (2.0 * self.profile.param_mb)
        return np.maximum(1.0, (counts / t_i).sum(axis=1) / cap_per_s)

    def evaluate(self, counts: np.ndarray, loss_target: float, current_loss: float | None = None) -> dict[str, np.ndarray]:
        """Score K clusters given as a K x M matrix of counts (or one M-vector).

        Returns arrays of length K: workers, iteration_time_s (Texp), speed (samples/s), wa_batch,
        cc (R), iterations (j, or j(L) - j(L0) when current_loss is given), time_s, cost_usd,
        usd_per_h. A cluster whose loss curve cannot reach the target gets infinite time and cost.
        """
        counts = np.atleast_2d(np.asarray(counts, dtype=float))
        n = counts.sum(axis=1)
        t_i = self.cluster_iteration_times_s(counts)  # K x M
        rate = counts / t_i  # iterations per second contributed by each type
        x = rate.sum(axis=1)
        speed_each = self.types.batch / t_i  # samples/s of ONE instance of each type
        v = (counts * speed_each).sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            texp = 1.0 / x
            bw = v * texp
            w = speed_each / v[:, None]
            w_max = np.where(counts > 0, w, 0.0).max(axis=1)
            r_sq = 1.0 - 2.0 * w_max + (counts * w * w).sum(axis=1)
        cc = np.sqrt(np.clip(r_sq, 0.0, None))
        iterations = self.iterations(bw, cc, n, loss_target, current_loss)
        usd_per_h = counts @ self.prices_usd_per_h
        with np.errstate(invalid="ignore"):  # empty clusters: inf * 0, replaced below
            time_s = iterations * texp
            cost = time_s / 3600.0 * usd_per_h
        empty = n <= 0
        return {
            "workers": n,
            "iteration_time_s": np.where(empty, np.inf, texp),
            "speed": v,
            "wa_batch": np.where(empty, 0.0, bw),
            "cc": np.where(empty, 0.0, cc),
            "iterations": np.where(empty, np.inf, iterations),
            "time_s": np.where(empty, np.inf, time_s),
            "cost_usd": np.where(empty, np.inf, cost),
            "usd_per_h": usd_per_h,
        }

    def curve_numerator(self, bw, cc, n):
        """Eq. 3's numerator for clusters of WA batch bw, coefficient R = cc and size n."""
        g = self.profile.loss
        return curve_numerator(bw, cc, n, g.gamma2, g.gamma3, g.gamma4, g.kappa, g.batch_n_exponent, g.batch_staleness,
                               g.batch_noise)

    def iterations(self, bw, cc, n, loss_target: float, current_loss: float | None = None) -> np.ndarray:
        """Iterations j to reach loss_target (Eq. 3 solved for j), floored at 0; with current_loss,
        the remaining iterations j(L) - j(L0) on the same cluster's curve. Infinite where the
        curve's numerator is not positive (the fitted curve does not descend there)."""
        g = self.profile.loss
        bw, cc, n = (np.asarray(a, dtype=float) for a in (bw, cc, n))
        numerator = self.curve_numerator(bw, cc, n)
        if current_loss is None:
            j = numerator / (loss_target - g.gamma5) - g.gamma1
        else:
            j = numerator * (1.0 / (loss_target - g.gamma5) - 1.0 / (current_loss - g.gamma5))
        return np.where(numerator > 0, np.maximum(j, 0.0), np.inf)

    def counts_vector(self, cluster: dict[str, int]) -> np.ndarray:
        """{type: n} -> an M-vector in profile order (unknown types are a UserInputError)."""
        vec = np.zeros(len(self.types.names), dtype=np.int64)
        for name, n in cluster.items():
            vec[self.types.names.index(self.profile.instance(name).type)] = n
        return vec
