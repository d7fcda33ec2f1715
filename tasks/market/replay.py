"""A discrete-event replay of one training run on the spot market, under one policy.

Training progresses at the model's speed on whatever cluster is up. The loss is tracked in
u = 1 / (L - gamma5), which the model's loss curve makes linear in iterations, so on a fixed
cluster u moves linearly in time from its current value to the target's in the model's predicted
remaining time; a new cluster continues from the loss reached (docs/model.md, re-planning). Events are
revocations (from the type's real trace, thinned to our instance count, or a Poisson process at
its band hazard), instances joining, and completion. On a revocation the policy re-plans with the
survivors as existing instances, the time and loss left and the overhead T_ohd; instances it adds
are paid from launch and train after T_ohd. A restart-on-preemption policy instead tears the
cluster down, relaunches its plan and resumes from the last checkpoint. Asynchronous PS training
loses no progress when a worker goes (the PS holds the parameters; it is assumed not to be
revoked). The initial cluster is up at t = 0 (the deadline clock starts with training).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# A replay with more revocations than this is no market's (the shipped traces give a few per
# instance-day), and each one re-plans: bad traces would keep a replay going for hours.
MAX_REVOCATIONS = 10_000

from tasks.core.errors import UserInputError
from tasks.core.model import Model
from tasks.core.profile import Profile
from tasks.market.hazards import TypeHazard
from tasks.market.policies import Policy, Situation


@dataclass(frozen=True)
class ReplayConfig:
    loss_target: float
    deadline_s: float
    overhead_s: float = 120.0  # T_ohd: the paper measured 2.1 min for a new instance to join
    checkpoint_s: float = 300.0  # restart policy: progress is saved this often
    give_up_factor: float = 20.0  # a run still going at this many deadlines is stopped (unfinished)


@dataclass(frozen=True)
class Outcome:
    time_s: float
    cost_usd: float
    met_deadline: bool
    finished: bool
    revocations: int
    replans: int


class Market:
    """One replay's market: per type, the revocation events it sees (replay times and revoked
    fractions; None: a Poisson process at its hazard) and the price it pays; plus the thinning
    randomness. `draw` makes a random one from the traces."""

    def __init__(self, prices_usd_per_h: np.ndarray, hazard_per_s: np.ndarray,
                 events: list[tuple[np.ndarray, np.ndarray] | None], seed: int):
        self.prices_usd_per_h = np.asarray(prices_usd_per_h, dtype=float)
        self.hazard_per_s = np.asarray(hazard_per_s, dtype=float)
        self.events = events
        self.seed = seed
        self.rng = np.random.default_rng([seed, 1])

    @classmethod
    def draw(cls, names: tuple[str, ...], hazards: dict[str, TypeHazard], prices_usd_per_h: np.ndarray,
             zone_prices: dict[str, np.ndarray], horizon_s: float, seed: int) -> "Market":
        """A random trace window per trace-mapped type (random trace and start offset; the trace
        wraps around) and a random zone's price per type with price history."""
        rng = np.random.default_rng(seed)
        prices = np.array(prices_usd_per_h, dtype=float)
        events = []
        for m, name in enumerate(names):
            if name in zone_prices:
                prices[m] = rng.choice(zone_prices[name])
            traces = hazards[name].traces
            events.append(None if not traces else cls._unroll(traces[rng.integers(len(traces))], horizon_s, rng))
        hazard_per_s = np.array([hazards[n].hazard_per_h / 3600.0 for n in names])
        return cls(prices, hazard_per_s, events, seed)

    @staticmethod
    def _unroll(trace, horizon_s: float, rng) -> tuple[np.ndarray, np.ndarray]:
        """The trace's events in replay time over [0, horizon], from a random offset, wrapping."""
        start, period = trace.live_from_s, trace.duration_s - trace.live_from_s
        offset = rng.uniform(0.0, period)
        rel = trace.event_times_s - start - offset  # event times relative to the replay's t = 0
        laps = np.arange(0, math.ceil(horizon_s / period) + 2)
        times = (rel[None, :] + laps[:, None] * period).ravel()
        fracs = np.tile(trace.revoked_fraction, len(laps))
        keep = (times > 0) & (times <= horizon_s)
        order = np.argsort(times[keep], kind="stable")
        return times[keep][order], fracs[keep][order]

    def fork(self) -> "Market":
        """The same market with its thinning randomness restarted (identical for every policy)."""
        return Market(self.prices_usd_per_h, self.hazard_per_s, self.events, self.seed)

    def revocation_times_s(self, m: int, n: int, launch_s: float) -> np.ndarray:
        """When each of n instances of type m launched at launch_s will be revoked (inf: never)."""
        events = self.events[m]
        if events is None:
            h = self.hazard_per_s[m]
            return launch_s + self.rng.exponential(1.0 / h, n) if h > 0 else np.full(n, np.inf)
        times, fracs = events
        i = np.searchsorted(times, launch_s, side="right")
        times, fracs = times[i:], fracs[i:]
        if len(times) == 0:
            return np.full(n, np.inf)
        hit = self.rng.random((n, len(times))) < fracs[None, :]
        first = hit.argmax(axis=1)
        return np.where(hit.any(axis=1), times[first], np.inf)


class ClusterClock:
    """How long a cluster still trains from a loss, scored by the model once per composition.
    Mid-training, a cluster's remaining time is its own seconds per unit of progress times the
    remaining progress du = 1/(L_target - gamma5) - 1/(L - gamma5) (docs/model.md, re-planning),
    so the many events of many replays need no model call once a composition has been seen."""

    def __init__(self, model: Model, loss_target: float):
        self.model, self.loss_target = model, loss_target
        self.u_target = 1.0 / (loss_target - model.profile.loss.gamma5)
        self.starts: dict[bytes, tuple[float, float]] = {}  # time and iterations from the start
        self.per_progress_s: dict[bytes, float] = {}

    def from_start(self, counts: np.ndarray) -> tuple[float, float]:
        """Time and iterations to the target from the start of training."""
        key = counts.tobytes()
        if key not in self.starts:
            r = self.model.evaluate(counts, self.loss_target)
            self.starts[key] = (float(r["time_s"][0]), float(r["iterations"][0]))
        return self.starts[key]

    def remaining_s(self, counts: np.ndarray, loss: float) -> float:
        """Time to the target from `loss`."""
        du = self.u_target - 1.0 / (loss - self.model.profile.loss.gamma5)
        key = counts.tobytes()
        if key not in self.per_progress_s:
            self.per_progress_s[key] = float(self.model.evaluate(counts, self.loss_target, loss)["time_s"][0]) / du
        return self.per_progress_s[key] * du


def initial_situation(cfg: ReplayConfig) -> Situation:
    """Before training: nothing runs, the whole deadline is left."""
    return Situation({}, cfg.deadline_s, None, cfg.overhead_s)


def replay(profile: Profile, model: Model, policy: Policy, cfg: ReplayConfig, market: Market | None,
           first_plan: dict[str, int] | None = None, clock: ClusterClock | None = None) -> Outcome:
    """One run of `policy` to the loss target; market None (or an on-demand policy): no revocations.
    `first_plan`: the policy's initial plan when already known (it is the same in every replay);
    `clock`: one shared by the replays of the same model and target."""
    clock = clock or ClusterClock(model, cfg.loss_target)
    names = model.types.names
    g5 = profile.loss.gamma5
    u_target = 1.0 / (cfg.loss_target - g5)
    spot = market is not None and not policy.on_demand
    if policy.on_demand:
        prices = model.types.on_demand_usd_per_h
    else:
        prices = market.prices_usd_per_h if market is not None else model.types.spot_usd_per_h
    give_up_s = cfg.deadline_s * cfg.give_up_factor
    # Instances: parallel lists of type index, launch, join, revocation and end times.
    kind: list[int] = []
    launched: list[float] = []
    joins: list[float] = []
    revokes: list[float] = []
    ends: list[float | None] = []

    def launch(plan: dict[str, int], have: np.ndarray, now_s: float, join_s: float) -> None:
        for m, extra in enumerate(model.counts_vector(plan) - have):
            if extra > 0:
                times = market.revocation_times_s(m, int(extra), now_s) if spot else np.full(extra, np.inf)
                kind.extend([m] * len(times))
                launched.extend([now_s] * len(times))
                joins.extend([join_s] * len(times))
                revokes.extend(float(rt) for rt in times)
                ends.extend([None] * len(times))

    def live_counts(joined_by: float | None = None) -> np.ndarray:
        c = np.zeros(len(names), dtype=np.int64)
        for k, j, e in zip(kind, joins, ends):
            if e is None and (joined_by is None or j <= joined_by):
                c[k] += 1
        return c

    if first_plan is None:
        first_plan = policy.plan(profile, cfg.loss_target, initial_situation(cfg))
    launch(first_plan, np.zeros(len(names), dtype=np.int64), 0.0, 0.0)
    t, loss, saved_loss = 0.0, None, None
    revocations = replans = 0
    while True:
        active = live_counts(joined_by=t)
        remaining_s, u_now = math.inf, None
        if active.sum() > 0:
            if loss is None:
                remaining_s, iterations = clock.from_start(active)
                u_now = profile.loss.gamma1 * u_target / (iterations + profile.loss.gamma1)
            else:
                remaining_s, u_now = clock.remaining_s(active, loss), 1.0 / (loss - g5)
        alive = [i for i, e in enumerate(ends) if e is None]
        next_revoke = min((revokes[i] for i in alive), default=math.inf)
        next_join = min((joins[i] for i in alive if joins[i] > t), default=math.inf)
        t_next = min(next_revoke, next_join, t + remaining_s, give_up_s)

        def u_at(when_s: float) -> float:
            return u_now + (u_target - u_now) * (when_s - t) / remaining_s

        if policy.restart_on_preemption and cfg.checkpoint_s > 0:
            last_save = math.floor(t_next / cfg.checkpoint_s) * cfg.checkpoint_s
            if last_save > t and u_now is not None:
                saved_loss = g5 + 1.0 / u_at(last_save)
        done = t + remaining_s <= t_next
        if u_now is not None and not done:
            loss = g5 + 1.0 / u_at(t_next)
            done = loss <= cfg.loss_target  # rounding: the target is reached at t_next
        t = t_next
        if done or t >= give_up_s:
            break
        if next_revoke > t:
            continue  # an instance joined
        gone = [i for i in alive if revokes[i] <= t]
        for i in gone:
            ends[i] = t
        revocations += len(gone)
        if revocations > MAX_REVOCATIONS:
            raise UserInputError(
                f"a replay saw more than {MAX_REVOCATIONS:,} revocations within {t:.0f} s (one every {t / revocations:.2g} s): "
                "the traces or hazards given revoke far faster than a spot market does; check them (or --band-stress)")
        if policy.restart_on_preemption:
            for i in alive:
                ends[i] = t
            loss = saved_loss
            launch(first_plan, np.zeros(len(names), dtype=np.int64), t, t + cfg.overhead_s)
        else:
            have = live_counts()
            existing = {names[m]: int(c) for m, c in enumerate(have) if c > 0}
            plan = policy.plan(profile, cfg.loss_target, Situation(existing, cfg.deadline_s - t, loss, cfg.overhead_s))
            replans += 1
            launch(plan, have, t, t + cfg.overhead_s)
    cost_usd = sum(prices[k] * ((t if e is None else e) - l0) for k, l0, e in zip(kind, launched, ends)) / 3600.0
    return Outcome(t, cost_usd, done and t <= cfg.deadline_s * (1 + 1e-9), done, revocations, replans)
