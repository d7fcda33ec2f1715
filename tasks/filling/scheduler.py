"""Scheduler: online requests first, offline scoring in what remains, chunk sizes from measured cost.

Each lane asks for work of its kind (LANES): an "online" lane takes only online requests, an
"offline" lane only offline scoring, and an "any" lane (the baselines' shared lane) takes online
requests first and offline work only when no request waits. Online requests carry their arrival
time and share one latency SLO. Shedding (documented, counted):
- overflow: a request arriving to a full queue (`capacity`) is rejected at once;
- expired: a queued request already older than the SLO when a chunk is formed is dropped, since
  serving it cannot meet the SLO and would spend bubble time that fresher requests need;
- paused: requests still queued when the filler is paused are dropped.
Served requests' latency = completion - arrival, of which the wait = the chunk's forming - arrival
(the rest is the chunk's run). Offline work scores a fixed dataset over and over
(epochs); its progress is counted in samples.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np


LANES = ("online", "offline", "any")


@dataclass
class Chunk:
    """One unit of inference work: a micro-batch of online requests or of the offline dataset."""
    kind: str  # "online" or "offline"
    batch: int
    predicted_s: float
    picked_s: float = 0.0  # when the scheduler formed it (inside the admission's decision)
    arrivals_s: list[float] = field(default_factory=list)
    offline_start: int = 0
    lane: str = "any"  # the kind of lane that picked it (whose cost model it updates)


class CostModel:
    """Measured seconds per chunk, per batch size (EWMA); sizes are powers of two up to max_batch.

    It also keeps how far recent chunks overran their prediction: (chunk end - its pick) /
    predicted cost, start delay included, since that is what decides whether a chunk picked for
    a bubble ends inside it. A chunk fits an allowance only if its cost times a high quantile of
    those ratios (`overrun_quantile` of the last `overrun_window` seen within `overrun_memory_s`;
    at least 1) does: a prediction that is right on average still overruns in its tail, and the
    tail is what costs training. Ratios age out by time, not only by count: after a load spike
    whose overruns shut out every chunk, no new chunk would come to push them out.
    """

    def __init__(self, max_batch: int, weight: float = 0.2, overrun_quantile: float = 0.95,
                 overrun_window: int = 64, overrun_memory_s: float = 10.0):
        self.batch_sizes = [1 << i for i in range(max_batch.bit_length()) if (1 << i) <= max_batch]
        if self.batch_sizes[-1] != max_batch:
            self.batch_sizes.append(max_batch)
        self.weight = weight
        self.cost_s: dict[int, float] = {}
        self.overrun_quantile = overrun_quantile
        self.overrun_memory_s = overrun_memory_s
        self._overruns: deque[tuple[float, float]] = deque(maxlen=overrun_window)  # (at_s, ratio)
        self._lock = threading.Lock()

    def observe_overrun(self, ratio: float, at_s: float) -> None:
        """One chunk's (end - pick) / predicted cost, as of `at_s` (the chunk's end)."""
        with self._lock:
            self._overruns.append((at_s, ratio))

    def overrun_factor(self, now_s: float) -> float:
        """What a predicted cost is multiplied by before it is compared with an allowance."""
        with self._lock:
            while self._overruns and self._overruns[0][0] < now_s - self.overrun_memory_s:
                self._overruns.popleft()
            if not self._overruns:
                return 1.0
            ratios = np.fromiter((ratio for _at, ratio in self._overruns), float)
        return max(1.0, float(np.quantile(ratios, self.overrun_quantile)))

    def update(self, batch: int, seconds: float) -> None:
        size = self._size_for(batch)
        with self._lock:
            old = self.cost_s.get(size)
            # A partial batch is charged at its size's cost; never let it pull that cost down.
            if batch < size and old is not None and seconds < old:
                return
            self.cost_s[size] = seconds if old is None else (1 - self.weight) * old + self.weight * seconds

    def _size_for(self, batch: int) -> int:
        return next(s for s in self.batch_sizes if s >= batch)

    def predict_s(self, batch: int) -> float | None:
        """Cost of a chunk of `batch` samples: that of the next measured size up (conservative)."""
        return self.cost_s.get(self._size_for(batch))

    def largest_fitting(self, allowance_s: float, limit: int, factor: float = 1.0) -> int:
        """The largest batch (<= limit) whose measured cost, times `factor` (overrun_factor),
        fits the allowance; 0 if none."""
        best = 0
        for size in self.batch_sizes:
            n = min(size, limit)
            cost = self.predict_s(n)
            if cost is None or cost * factor > allowance_s:
                break
            best = n
            if size >= limit:
                break
        return best


class OnlineQueue:
    def __init__(self, capacity: int, slo_s: float):
        self.capacity = capacity
        self.slo_s = slo_s
        self._queue: deque[float] = deque()
        self.offered = 0
        self.shed_overflow = 0
        self.shed_expired = 0
        self.shed_paused = 0

    def __len__(self) -> int:
        return len(self._queue)

    def offer(self, arrival_s: float) -> bool:
        self.offered += 1
        if len(self._queue) >= self.capacity:
            self.shed_overflow += 1
            return False
        self._queue.append(arrival_s)
        return True

    def drop_expired(self, now_s: float) -> None:
        while self._queue and now_s - self._queue[0] > self.slo_s:
            self._queue.popleft()
            self.shed_expired += 1

    def clear(self) -> None:
        self.shed_paused += len(self._queue)
        self._queue.clear()

    def take(self, n: int) -> list[float]:
        return [self._queue.popleft() for _ in range(min(n, len(self._queue)))]

    def oldest_arrival_s(self) -> float | None:
        return self._queue[0] if self._queue else None


class PoissonArrivals:
    """A seeded Poisson arrival process at `rate_per_s`, released as wall time passes it; nothing
    arrives before `begin(start_s)`."""

    def __init__(self, rate_per_s: float, seed: int = 0):
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be > 0")
        self.rate_per_s = rate_per_s
        self._rng = np.random.default_rng(seed)
        self._next_s = float("inf")

    def begin(self, start_s: float) -> None:
        self._next_s = start_s + self._gap()

    def next_s(self) -> float:
        """When the next request arrives (inf before begin())."""
        return self._next_s

    def _gap(self) -> float:
        return float(self._rng.exponential(1.0 / self.rate_per_s))

    def due(self, now_s: float) -> list[float]:
        out = []
        while self._next_s <= now_s:
            out.append(self._next_s)
            self._next_s += self._gap()
        return out


class Scheduler:
    """Chooses the next chunk for an allowance; thread-safe across lanes. The online lane runs on
    fewer intra-op threads than the others, so it has its own cost model (`online_costs`; the
    shared one when not given)."""

    def __init__(self, queue: OnlineQueue, arrivals: PoissonArrivals | None, costs: CostModel,
                 dataset_size: int, online_costs: CostModel | None = None):
        self.queue = queue
        self.arrivals = arrivals
        self.costs = costs
        self.online_costs = online_costs or costs
        self.dataset_size = dataset_size
        self._offline_cursor = 0
        self._lock = threading.Lock()
        self.online_served = 0
        self.offline_samples = 0
        # (completed_s, latency_s, wait_s) per served request
        self.latencies: deque[tuple[float, float, float]] = deque(maxlen=200_000)

    def admit_arrivals(self, now_s: float) -> None:
        if self.arrivals is not None:
            for arrival_s in self.arrivals.due(now_s):
                self.queue.offer(arrival_s)

    def pick(self, allowance_s: float, now_s: float, lane: str = "any") -> Chunk | None:
        """The next chunk for a lane of kind `lane` (LANES) whose predicted cost fits the allowance."""
        costs = self.cost_model(lane)
        with self._lock:
            self.admit_arrivals(now_s)
            self.queue.drop_expired(now_s)
            max_batch = costs.batch_sizes[-1]
            factor = costs.overrun_factor(now_s)
            if lane != "offline" and len(self.queue):
                n = costs.largest_fitting(allowance_s, min(len(self.queue), max_batch), factor)
                if n == 0:
                    return None  # online first: on a shared lane offline does not jump a request
                return Chunk("online", n, costs.predict_s(n), now_s,
                             arrivals_s=self.queue.take(n), lane=lane)
            if lane == "online":
                return None
            n = costs.largest_fitting(allowance_s, max_batch, factor)
            if n == 0:
                return None
            start = self._offline_cursor
            self._offline_cursor = (start + n) % self.dataset_size
            return Chunk("offline", n, costs.predict_s(n), now_s, offline_start=start, lane=lane)

    def oldest_wait_s(self, now_s: float) -> float:
        """How long the oldest queued request has waited (0 with none queued)."""
        with self._lock:
            self.admit_arrivals(now_s)
            oldest = self.queue.oldest_arrival_s()
        return 0.0 if oldest is None else max(0.0, now_s - oldest)

    def cost_model(self, lane: str) -> CostModel:
        return self.online_costs if lane == "online" else self.costs

    def idle_wait_s(self, lane: str, now_s: float, cap_s: float) -> float:
        """How long a lane that got nothing may sleep before asking again (at most cap_s): an
        online lane with an empty queue until the next arrival; otherwise cap_s (the admission
        wakes waiting lanes at every bubble edge and chunk end, when room may have appeared).
        Requests already due join the queue first (the admission may not have called pick)."""
        if lane != "online":
            return cap_s
        with self._lock:
            self.admit_arrivals(now_s)
            if len(self.queue):
                return cap_s
            next_s = self.arrivals.next_s() if self.arrivals is not None else float("inf")
        return min(cap_s, max(0.0, next_s - now_s))

    def shed_queued(self) -> None:
        with self._lock:
            self.queue.clear()

    def complete(self, chunk: Chunk, end_s: float, busy_s: float) -> None:
        with self._lock:
            costs = self.cost_model(chunk.lane)
            if chunk.predicted_s > 0:
                costs.observe_overrun((end_s - chunk.picked_s) / chunk.predicted_s, end_s)
            costs.update(chunk.batch, busy_s)
            if chunk.kind == "online":
                self.online_served += chunk.batch
                self.latencies.extend((end_s, end_s - a, chunk.picked_s - a) for a in chunk.arrivals_s)
            else:
                self.offline_samples += chunk.batch

    def latency_percentiles(self, since_s: float = float("-inf")) -> dict[str, float | None]:
        with self._lock:
            values = [lat for end, lat, _wait in self.latencies if end >= since_s]
        if not values:
            return {"p50_s": None, "p95_s": None, "p99_s": None}
        p50, p95, p99 = np.percentile(values, [50, 95, 99])
        return {"p50_s": float(p50), "p95_s": float(p95), "p99_s": float(p99)}
