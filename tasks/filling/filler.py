"""The filler: a PhaseListener for the training loop plus lane threads that run inference chunks
when the admission policy (the gate, or a baseline) lets them. Also keeps the numbers.

`lanes` lists each lane's kind (tasks.filling.scheduler.LANES): the gated filler has one "online"
lane plus K "offline" lanes; the shared-lane baselines have K "any" lanes.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from tasks.filling.gate import Admission
from tasks.filling.guard import StepTimeGuard
from tasks.filling.monitor import BubbleMonitor
from tasks.filling.scheduler import Chunk, Scheduler

# The longest a waiting lane sleeps between looks when nothing wakes it sooner: a safety net only,
# since every event that can make room notifies the waiting lanes.
LANE_WAIT_CAP_S = 0.5


@dataclass(frozen=True)
class ChunkRecord:
    """One finished chunk, for the bench's diagnostics and tests."""
    picked_s: float
    start_s: float
    end_s: float
    kind: str
    batch: int
    predicted_s: float  # its cost model's prediction when it was picked
    outside_s: float  # of its run, the seconds outside bubbles: what spilled into compute


class Filler:
    def __init__(self, monitor: BubbleMonitor, guard: StepTimeGuard, admission: Admission,
                 scheduler: Scheduler, executor, lanes: list[str]):
        self.monitor = monitor
        self.guard = guard
        self.admission = admission
        self.scheduler = scheduler
        self.executor = executor
        self.lanes = lanes
        monitor.on_compute_time(lambda compute_s: guard.observe_compute_s(compute_s,
                                                                          self._compute_clean))
        self.chunks = 0
        self.busy_s = 0.0
        self.busy_in_bubble_s = 0.0
        self.error: BaseException | None = None
        self._active = 0
        self._busy_since = 0.0
        self._compute_clean = True  # no chunk has run during the current compute phase
        self.chunk_log: deque[ChunkRecord] = deque(maxlen=10_000)  # recent chunks
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._threads: list[threading.Thread] = []
        self.started_s: float | None = None

    # -- PhaseListener: delegate to the monitor (returns at once) -------------------------------
    def compute_start(self, step: int) -> None:
        with self._stats_lock:
            self._compute_clean = self._active == 0
        self.monitor.compute_start(step)

    def compute_end(self, step: int, compute_s: float | None = None) -> None:
        self.monitor.compute_end(step, compute_s)

    def comm_start(self, step: int) -> None:
        self.monitor.comm_start(step)

    def comm_end(self, step: int) -> None:
        self.monitor.comm_end(step)

    # -- lanes ---------------------------------------------------------------------------------
    def calibrate(self, repeats: int = 3) -> None:
        """Measure each chunk size alone (before training starts) to seed the cost models (the
        online lane's with its thread count). Runs in its own thread, as a lane would, so the
        caller's intra-op thread count is left alone."""
        thread = threading.Thread(target=self._calibrate, args=(repeats,), name="fill-calibrate")
        thread.start()
        thread.join()

    def _calibrate(self, repeats: int) -> None:
        for lane in sorted(set(self.lanes)):
            self.executor.lane_setup(lane)
            costs = self.scheduler.cost_model(lane)
            for size in costs.batch_sizes:
                chunk = Chunk("offline", size, 0.0)
                self.executor.run(chunk)  # warm-up
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    device_s = self.executor.run(chunk)
                    costs.update(size, time.perf_counter() - t0 if device_s is None else device_s)

    def start(self) -> "Filler":
        """Start the lanes; online arrivals begin now."""
        self.started_s = self.monitor.clock()
        if self.scheduler.arrivals is not None:
            self.scheduler.arrivals.begin(self.monitor.clock())
        for i, lane in enumerate(self.lanes):
            thread = threading.Thread(target=self._lane, args=(lane,), name=f"fill-{lane}-{i}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _lane(self, lane: str) -> None:
        clock = self.monitor.clock
        self.executor.lane_setup(lane)
        # A lane wakes only when it may have work: a paused one sleeps until resume() or close()
        # (which sets both events), a waiting one until a bubble opens, a chunk ends inside one, a
        # request arrives or nears its bound (gate.py, "Waking"). Periodic polls would each take
        # the GIL and a core from training's compute phase, a few milliseconds now and then.
        while not self._stop.is_set():
            self._running.wait()
            if self._stop.is_set():
                break
            chunk = self.admission.start(
                lane, lambda allowance_s: self.scheduler.pick(allowance_s, clock(), lane))
            if chunk is None:
                self.admission.wait(lane, self.scheduler.idle_wait_s(lane, clock(), cap_s=LANE_WAIT_CAP_S))
                continue
            t0 = self._busy_begin()
            device_s = None
            try:
                device_s = self.executor.run(chunk)
            except Exception as err:  # stop filling, keep training alive; reported in metrics
                self.error = err
                self._stop.set()
            t1 = self._busy_end()
            self.admission.finish(lane, t0, t1)
            if self.error is not None:
                return
            self.scheduler.complete(chunk, t1, t1 - t0 if device_s is None else device_s)
            record = ChunkRecord(chunk.picked_s, t0, t1, chunk.kind, chunk.batch, chunk.predicted_s,
                                 (t1 - t0) - self.monitor.overlap_s(t0, t1))
            with self._stats_lock:
                self.chunks += 1
                self.chunk_log.append(record)

    # Busy time is the union of the lanes' chunk intervals (wall time with >= 1 chunk running),
    # so K concurrent chunks never count a bubble twice.
    def _busy_begin(self) -> float:
        with self._stats_lock:
            now = self.monitor.clock()
            if self._active == 0:
                self._busy_since = now
            self._active += 1
            self._compute_clean = False
            return now

    def _busy_end(self) -> float:
        with self._stats_lock:
            now = self.monitor.clock()
            self._active -= 1
            if self._active == 0:
                self.busy_s += now - self._busy_since
                self.busy_in_bubble_s += self.monitor.overlap_s(self._busy_since, now)
            return now

    def chunks_picked_since(self, since_s: float) -> list[ChunkRecord]:
        """The finished chunks picked at or after `since_s` (of the recent ones kept)."""
        with self._stats_lock:
            return [c for c in self.chunk_log if c.picked_s >= since_s]

    def pause(self) -> None:
        """Start no new chunk until resume() (running ones finish). Queued online requests are
        shed (counted in online_shed_paused): their latency would include the pause."""
        self._running.clear()
        self.scheduler.shed_queued()

    def resume(self) -> None:
        """Start again; the online arrival process restarts now. A request a lane queued while
        the pause took effect is shed too (its latency would include the pause)."""
        self.scheduler.shed_queued()
        if self.scheduler.arrivals is not None:
            self.scheduler.arrivals.begin(self.monitor.clock())
        self._running.set()

    def close(self) -> None:
        self._stop.set()
        self._running.set()
        with self.monitor.changed:
            self.monitor.changed.notify_all()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()

    # -- numbers -------------------------------------------------------------------------------
    def metrics(self, since_s: float = float("-inf")) -> dict:
        """Cumulative counters for telemetry; latency percentiles over requests completed since
        `since_s` (all by default)."""
        with self._stats_lock:
            busy_s, inside_s, chunks = self.busy_s, self.busy_in_bubble_s, self.chunks
        sched, queue, monitor = self.scheduler, self.scheduler.queue, self.monitor
        latency = sched.latency_percentiles(since_s)
        predicted_s, ewma_s = monitor.estimate(0)
        return {
            "inference_samples": sched.offline_samples + sched.online_served,
            "offline_samples": sched.offline_samples,
            "online_offered": queue.offered,
            "online_served": sched.online_served,
            "online_shed_overflow": queue.shed_overflow,
            "online_shed_expired": queue.shed_expired,
            "online_shed_paused": queue.shed_paused,
            "online_p50_s": latency["p50_s"],
            "online_p95_s": latency["p95_s"],
            "online_p99_s": latency["p99_s"],
            "chunks": chunks,
            "busy_s": busy_s,
            "busy_in_bubble_s": inside_s,
            "spill_s": busy_s - inside_s,
            "bubble_s": monitor.bubble_total_s,
            "bubbles": monitor.bubble_count,
            "bubble_predicted_s": predicted_s,
            "bubble_ewma_s": ewma_s,
            "fill_efficiency": inside_s / monitor.bubble_total_s if monitor.bubble_total_s else 0.0,
            "elapsed_s": self.monitor.clock() - self.started_s if self.started_s is not None else 0.0,
            "compute_slowdown": self.guard.slowdown(),
            "guard_budget": self.guard.budget,
            "guard_shrinks": self.guard.shrinks,
            "baseline_compute_s": self.guard.baseline_s,
            "online_priority": getattr(self.executor, "online_priority", None),
            "online_priority_refused": getattr(self.executor, "online_priority_refused", None),
            "error": repr(self.error) if self.error else None,
        }
