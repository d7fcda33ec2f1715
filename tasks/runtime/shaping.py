"""Emulated network bandwidth: token buckets at the parameter server.

Every byte a worker pushes or pulls passes two buckets: the PS's shared bucket (the PS NIC, total
bytes per second over all workers, both directions) and the worker's own bucket (its instance's
NIC). Transfers are cut into chunks that take tokens in turn, so when several workers talk at once
they share the PS bucket and each one's transfer slows down: contention comes from the traffic,
not from a formula. A bucket may go into debt (a reservation): the taker sleeps until its tokens
would have arrived, outside the lock.
"""
from __future__ import annotations

import threading
import time

CHUNK_BYTES = 64 * 1024


class TokenBucket:
    """`rate_bytes_per_s` tokens a second, at most `burst_bytes` saved up."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float = CHUNK_BYTES):
        if rate_bytes_per_s <= 0:
            raise ValueError(f"bucket rate must be positive, got {rate_bytes_per_s}")
        self.rate_bytes_per_s = rate_bytes_per_s
        self.burst_bytes = burst_bytes
        self._tokens = burst_bytes
        self._last_s = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, nbytes: float) -> float:
        """Take `nbytes` now (possibly into debt); returns the monotonic time they are paid for."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._last_s) * self.rate_bytes_per_s)
            self._last_s = now
            self._tokens -= nbytes
            if self._tokens >= 0:
                return now
            return now - self._tokens / self.rate_bytes_per_s


def mbps_to_bytes_per_s(mbps: float) -> float:
    return mbps * 1e6 / 8


class Shaper:
    """The PS's view of the emulated network: one shared bucket and one bucket per worker.

    `ps_mbps=None` (or a worker's `nic_mbps=None`) means that link is not limited.
    """

    def __init__(self, ps_mbps: float | None):
        self.ps_bucket = TokenBucket(mbps_to_bytes_per_s(ps_mbps)) if ps_mbps else None
        self._workers: dict[int, TokenBucket] = {}
        self._lock = threading.Lock()

    def add_worker(self, worker_id: int, nic_mbps: float | None) -> None:
        if nic_mbps:
            with self._lock:
                self._workers[worker_id] = TokenBucket(mbps_to_bytes_per_s(nic_mbps))

    def remove_worker(self, worker_id: int) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def transfer(self, worker_id: int, nbytes: int) -> float:
        """Block for as long as `nbytes` take through both buckets; returns the seconds waited."""
        worker_bucket = self._workers.get(worker_id)
        buckets = [b for b in (self.ps_bucket, worker_bucket) if b is not None]
        if not buckets:
            return 0.0
        start_s = time.monotonic()
        remaining = nbytes
        while remaining > 0:
            chunk = min(CHUNK_BYTES, remaining)
            remaining -= chunk
            paid_s = max(bucket.reserve(chunk) for bucket in buckets)
            delay_s = paid_s - time.monotonic()
            if delay_s > 0:
                time.sleep(delay_s)
        return time.monotonic() - start_s
