"""Per-peer token buckets: each peer may make ``rate`` requests (or bytes: ``cost``) per second,
bursting to ``burst``; ``take`` refuses beyond it, ``reserve`` paces."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimit:
    rate: float  # tokens added per second
    burst: float  # bucket capacity


class TokenBuckets:
    """One bucket per key (peer id). Memory is bounded: idle full buckets are forgotten."""

    MAX_KEYS = 10_000

    def __init__(self, limit: RateLimit) -> None:
        self.limit = limit
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill time)

    def take(self, key: str, cost: float = 1.0, now: float | None = None) -> bool:
        """Spend ``cost`` tokens of ``key``'s bucket; False (and nothing spent) if too few."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(key, (self.limit.burst, now))
        tokens = min(self.limit.burst, tokens + (now - last) * self.limit.rate)
        ok = tokens >= cost
        if ok:
            tokens -= cost
        if len(self._buckets) >= self.MAX_KEYS and key not in self._buckets:
            self._forget_full(now)
        self._buckets[key] = (tokens, now)
        return ok

    def reserve(self, key: str, cost: float, max_wait_s: float, now: float | None = None) -> float | None:
        """Pace rather than refuse: spend ``cost`` tokens of ``key``'s bucket even if that takes
        it below zero, and return the seconds until the debt is paid (0: at once), or None (and
        nothing spent) if that would be more than ``max_wait_s``. Concurrent reservations queue
        behind each other, so a peer gets ``rate`` per second however many requests it sends."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.get(key, (self.limit.burst, now))
        tokens = min(self.limit.burst, tokens + (now - last) * self.limit.rate) - cost
        wait = max(0.0, -tokens / self.limit.rate) if self.limit.rate > 0 else (0.0 if tokens >= 0 else float("inf"))
        if wait > max_wait_s:
            return None
        if len(self._buckets) >= self.MAX_KEYS and key not in self._buckets:
            self._forget_full(now)
        self._buckets[key] = (tokens, now)
        return wait

    def _forget_full(self, now: float) -> None:
        for k, (tokens, last) in list(self._buckets.items()):
            if tokens + (now - last) * self.limit.rate >= self.limit.burst:
                del self._buckets[k]
        if len(self._buckets) >= self.MAX_KEYS:  # all busy: drop the oldest half
            for k, _ in sorted(self._buckets.items(), key=lambda kv: kv[1][1])[: self.MAX_KEYS // 2]:
                del self._buckets[k]
