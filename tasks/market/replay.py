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
                 events: list[tuple[np.ndarray, np.ndarray] | None], seed: int,
                 capacity: list[tuple[np.ndarray, np.ndarray] | None] | None = None):
        self.prices_usd_per_h = np.asarray(prices_usd_per_h, dtype=float)
        self.hazard_per_s = np.asarray(hazard_per_s, dtype=float)
        self.events = events
        self.seed = seed
        self.rng = np.random.default_rng([seed, 1])
        # per type, its spot capacity as steps (times from 0, counts); None: no limit
        self.capacity = capacity if capacity is not None else [None] * len(events)
        changes = [steps[0][1:] for steps in self.capacity if steps is not None]
        self.capacity_changes_s = np.unique(np.concatenate(changes)) if changes else np.array([])

    def capacity_at(self, m: int, t_s: float) -> float:
        """Spot instances of type m the market hands out at t_s (inf: no limit)."""
        steps = self.capacity[m]
        if steps is None:
            return math.inf
        return float(steps[1][np.searchsorted(steps[0], t_s, side="right") - 1])

    def next_capacity_change_s(self, t_s: float) -> float:
        i = np.searchsorted(self.capacity_changes_s, t_s, side="right")
        return float(self.capacity_changes_s[i]) if i < len(self.capacity_changes_s) else math.inf

    @classmethod
    def draw(cls, names: tuple[str, ...], hazards: dict[str, TypeHazard], prices_usd_per_h: np.ndarray,
             zone_prices: dict[str, np.ndarray], horizon_s: float, seed: int,
             capacity: dict[str, list] | None = None) -> "Market":
        """A random trace window per trace-mapped type (random trace and start offset; the trace
        wraps around) and a random zone's price per type with price history. On-demand offers
        (names absent from `hazards`) are never revoked and keep their price. `capacity`: per
        type, its zones' capacity records (CapacityTrace, each from a random offset, summed: a
        plan's instances of a type may sit in any zone of the region), or fixed steps
        (times, counts) as a synthetic market gives them."""
        rng = np.random.default_rng(seed)
        prices = np.array(prices_usd_per_h, dtype=float)
        events = []
        for m, name in enumerate(names):
            if name in zone_prices:
                prices[m] = rng.choice(zone_prices[name])
            traces = hazards[name].traces if name in hazards else ()
            events.append(None if not traces else cls._unroll(traces[rng.integers(len(traces))], horizon_s, rng))
        hazard_per_s = np.array([hazards[n].hazard_per_h / 3600.0 if n in hazards else 0.0 for n in names])
        capacity = capacity or {}
        steps = [summed_capacity(capacity[n], horizon_s, rng) if n in capacity else None for n in names]
        return cls(prices, hazard_per_s, events, seed, steps)

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
        return Market(self.prices_usd_per_h, self.hazard_per_s, self.events, self.seed, self.capacity)

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


def summed_capacity(records: list, horizon_s: float, rng=None) -> tuple[np.ndarray, np.ndarray]:
    """One type's capacity over [0, horizon]: the sum of its zones' records, each from a random
    offset (rng None: from its start; a record given as fixed steps is taken as it is)."""
    windows = [r if isinstance(r, tuple) else r.window(rng.uniform(0.0, r.duration_s) if rng else 0.0, horizon_s)
               for r in records]
    times = np.unique(np.concatenate([w[0] for w in windows]))
    counts = sum(w[1][np.searchsorted(w[0], times, side="right") - 1] for w in windows)
    return times, np.asarray(counts, dtype=float)


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


class _Fleet:
    """The instances of one replay: parallel lists of type index, launch, join, revocation,
    planned release and end times (end None: alive)."""

    def __init__(self, n_types: int):
        self.n_types = n_types
        self.kind: list[int] = []
        self.launched: list[float] = []
        self.joins: list[float] = []
        self.revokes: list[float] = []
        self.releases: list[float] = []
        self.ends: list[float | None] = []

    def alive(self) -> list[int]:
        return [i for i, e in enumerate(self.ends) if e is None]

    def counts(self, joined_by: float | None = None, staying: bool = False) -> np.ndarray:
        """Alive instances per type (joined by then; staying: not to be released)."""
        c = np.zeros(self.n_types, dtype=np.int64)
        for k, j, r, e in zip(self.kind, self.joins, self.releases, self.ends):
            if e is None and (joined_by is None or j <= joined_by) and not (staying and r < math.inf):
                c[k] += 1
        return c

    def add(self, m: int, revocations: np.ndarray, now_s: float, join_s: float) -> None:
        n = len(revocations)
        self.kind.extend([m] * n)
        self.launched.extend([now_s] * n)
        self.joins.extend([join_s] * n)
        self.revokes.extend(float(r) for r in revocations)
        self.releases.extend([math.inf] * n)
        self.ends.extend([None] * n)

    def by_type(self) -> dict[int, list[int]]:
        """Alive instances by type, newest first."""
        out: dict[int, list[int]] = {}
        for i in reversed(range(len(self.ends))):
            if self.ends[i] is None:
                out.setdefault(self.kind[i], []).append(i)
        return out

    def cost_usd(self, prices: np.ndarray, until_s: float) -> float:
        return sum(prices[k] * ((until_s if e is None else e) - l0)
                   for k, l0, e in zip(self.kind, self.launched, self.ends)) / 3600.0


def replay(profile: Profile, model: Model, policy: Policy, cfg: ReplayConfig, market: Market | None,
           first_plan: dict[str, int] | None = None, clock: ClusterClock | None = None) -> Outcome:
    """One run of `policy` to the loss target; market None (or an on-demand policy): no revocations.
    `first_plan`: the policy's initial plan when already known (it is the same in every replay);
    `clock`: one shared by the replays of the same model and target. The model's types are the
    replay's: a policy that may use on-demand offers needs a model of the profile with its
    `TYPE:on-demand` twins (planner.on_demand.with_on_demand)."""
    clock = clock or ClusterClock(model, cfg.loss_target)
    names = model.types.names
    g5 = profile.loss.gamma5
    u_target = 1.0 / (cfg.loss_target - g5)
    spot = market is not None and not policy.on_demand
    if policy.on_demand:
        prices = model.types.on_demand_usd_per_h
    else:
        prices = market.prices_usd_per_h if market is not None else model.types.spot_usd_per_h
    limited = spot and any(steps is not None for steps in market.capacity)
    give_up_s = cfg.deadline_s * cfg.give_up_factor
    fleet = _Fleet(len(names))
    caps: dict[str, int] = {}  # spot capacity learned from refusals, per type, until it rises
    memory: dict = {}
    t, loss, saved_loss = 0.0, None, None
    revocations = replans = 0

    def time_on(plan: dict[str, int]) -> float:
        counts = model.counts_vector(plan)
        if not counts.any():
            return math.inf
        return clock.from_start(counts)[0] if loss is None else clock.remaining_s(counts, loss)

    def start_overhead_s() -> float:
        """What an instance launched now takes to join: nothing for the cluster up at t = 0."""
        return cfg.overhead_s if loss is not None or t > 0 else 0.0

    def situation() -> Situation:
        staying = fleet.counts(staying=True)
        existing = {names[m]: int(c) for m, c in enumerate(staying) if c > 0}
        return Situation(existing, cfg.deadline_s - t, loss, start_overhead_s(), t, dict(caps), time_on, memory)

    def launch(plan: dict[str, int], now_s: float, join_s: float) -> dict[int, int]:
        """Run `plan` from now: launch what it adds (within spot capacity), release what it drops
        (when the added instances join; at once if none are added). Returns refused counts."""
        want = model.counts_vector(plan)
        held = fleet.by_type()  # alive instances per type, newest first
        refused: dict[int, int] = {}
        added = False
        surplus: list[int] = []
        for m, mine in held.items():
            staying = [i for i in mine if fleet.releases[i] == math.inf]
            if len(staying) > want[m]:
                surplus += staying[: len(staying) - int(want[m])]
        for m in np.flatnonzero(want):
            mine = held.get(int(m), [])
            extra = int(want[m]) - sum(1 for i in mine if fleet.releases[i] == math.inf)
            for i in mine:
                if extra <= 0:
                    break
                if fleet.releases[i] < math.inf:  # being released, wanted again: keep it
                    fleet.releases[i] = math.inf
                    extra -= 1
            if extra <= 0:
                continue
            if limited:
                granted = int(max(0.0, min(extra, market.capacity_at(int(m), now_s) - len(mine))))
                if granted < extra:
                    refused[int(m)] = extra - granted
                extra = granted
            if extra > 0:
                times = market.revocation_times_s(int(m), extra, now_s) if spot else np.full(extra, np.inf)
                fleet.add(int(m), times, now_s, join_s)
                added = True
        for i in surplus:
            fleet.releases[i] = join_s if added else now_s
        return refused

    def decide() -> float:
        """Ask the policy; while the market refuses part of a launch, ask again knowing what it
        could get (each refusal caps a type, so this ends). Returns when to ask again."""
        for _ in range(len(names) + 1):
            decision = policy.decide(profile, cfg.loss_target, situation())
            refused = launch(decision.plan, t, t + start_overhead_s())
            if not refused:
                break
            held = fleet.by_type()
            for m in refused:
                caps[names[m]] = len(held.get(m, []))
        return decision.wake_at_s

    if first_plan is not None and not limited:
        launch(first_plan, 0.0, 0.0)
        wake_s = math.inf
    else:
        wake_s = decide()
    while True:
        active = fleet.counts(joined_by=t)
        remaining_s, u_now = math.inf, None
        if active.sum() > 0:
            if loss is None:
                remaining_s, iterations = clock.from_start(active)
                u_now = profile.loss.gamma1 * u_target / (iterations + profile.loss.gamma1)
            else:
                remaining_s, u_now = clock.remaining_s(active, loss), 1.0 / (loss - g5)
        alive = fleet.alive()
        next_revoke = min((fleet.revokes[i] for i in alive), default=math.inf)
        next_join = min((fleet.joins[i] for i in alive if fleet.joins[i] > t), default=math.inf)
        next_release = min((fleet.releases[i] for i in alive), default=math.inf)
        next_capacity = market.next_capacity_change_s(t) if limited else math.inf
        t_next = min(next_revoke, next_join, next_release, next_capacity, max(wake_s, t), t + remaining_s, give_up_s)

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
        for i in alive:
            if fleet.releases[i] <= t:
                fleet.ends[i] = t
        gone = [i for i in alive if fleet.revokes[i] <= t and fleet.ends[i] is None]
        if limited and next_capacity <= t:  # capacity below what runs takes the newest
            for m, held in fleet.by_type().items():
                over = len(held) - market.capacity_at(m, t)
                gone += [i for i in held[: int(max(over, 0))] if i not in gone]
            for m in range(len(names)):
                if market.capacity_at(m, t) > market.capacity_at(m, t - 1e-9):
                    caps.pop(names[m], None)  # capacity rose: what was refused may be had again
        for i in gone:
            fleet.ends[i] = t
        revocations += len(gone)
        if revocations > MAX_REVOCATIONS:
            raise UserInputError(
                f"a replay saw more than {MAX_REVOCATIONS:,} revocations within {t:.0f} s (one every {t / revocations:.2g} s): "
                "the traces or hazards given revoke far faster than a spot market does; check them (or --band-stress)")
        if not gone and next_capacity > t and wake_s > t:
            continue  # an instance joined or was released
        if policy.restart_on_preemption:
            if gone:
                for i in fleet.alive():
                    fleet.ends[i] = t
                loss = saved_loss
            launch(first_plan if first_plan is not None else policy.plan(profile, cfg.loss_target, initial_situation(cfg)),
                   t, t + cfg.overhead_s)
            wake_s = math.inf
        else:
            wake_s = decide()
            replans += 1
    cost_usd = fleet.cost_usd(prices, t)
    return Outcome(t, cost_usd, done and t <= cfg.deadline_s * (1 + 1e-9), done, revocations, replans)
