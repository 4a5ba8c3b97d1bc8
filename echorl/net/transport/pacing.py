"""Upload pacing for the weight plane: one cap per process, shared fairly by every chunk stream.

``UploadLimiter`` is one token bucket per process (bytes/s), FIFO-fair between the streams that
share it, so a peer's children and recovery requests together never exceed its upload cap (WAN
emulation in benchmarks; a volunteer's cap in production). ``None`` rate = unlimited.
``write_paced`` writes one frame in slices of ``UploadLimiter.slice_bytes`` (about 5 ms of the
capped rate), each slice paid for in the limiter, so concurrent children of one parent
interleave fairly instead of one child getting a whole chunk first.
"""

from __future__ import annotations

import os
import time
from typing import Any

import trio

from echorl.protocol import wire

#: a slice of a paced write lasts about this long at the capped rate: short enough that children
#: sharing an uplink interleave finely, long enough that the per-slice cost (a limiter turn, a
#: send, a trio checkpoint: tens of µs of Python) stays small. At 400 Mbit/s a fixed 64 KiB slice
#: (1.3 ms) cost a quarter of a 1 GB broadcast's CPU (docs/broadcast-notes.md, wave 5).
SLICE_SECONDS = 0.005
MIN_SLICE_BYTES, MAX_SLICE_BYTES = 64 * 1024, 1024 * 1024
UNPACED_SLICE_BYTES = 256 * 1024  # no cap: the kernel paces; slices only bound one write
_SLICE_OVERRIDE = int(os.environ.get("ECHORL_SLICE_BYTES", 0))  # benchmarks: a fixed slice


class UploadLimiter:
    """Async token bucket in bytes per second; ``acquire`` waits FIFO (trio.Lock is fair)."""

    def __init__(self, bytes_per_s: float | None, burst_bytes: int | None = None) -> None:
        self.rate = bytes_per_s if bytes_per_s and bytes_per_s > 0 else None
        self.slice_bytes = _SLICE_OVERRIDE or slice_bytes_for(self.rate)
        self.burst = max(burst_bytes or self.slice_bytes, 1)
        self._tokens = float(self.burst)
        self._last = time.monotonic()
        self._lock = trio.Lock()
        self.sent_bytes = 0

    @classmethod
    def from_mbps(cls, mbps: float | None) -> UploadLimiter:
        """Megabits per second (20 Mbps = 2.5 MB/s); None or 0 = unlimited."""
        return cls(mbps * 1e6 / 8 if mbps else None)

    async def acquire(self, n: int) -> None:
        self.sent_bytes += n
        if self.rate is None:
            return
        async with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < n:
                await trio.sleep((n - self._tokens) / self.rate)
                now = time.monotonic()
                self._tokens += (now - self._last) * self.rate
                self._last = now
            self._tokens -= n


def slice_bytes_for(rate: float | None) -> int:
    """Bytes per paced write at ``rate`` bytes/s: ``SLICE_SECONDS`` of it, a multiple of 4 KiB
    within [``MIN_SLICE_BYTES``, ``MAX_SLICE_BYTES``]; ``UNPACED_SLICE_BYTES`` without a cap."""
    if rate is None:
        return UNPACED_SLICE_BYTES
    return max(MIN_SLICE_BYTES, min(MAX_SLICE_BYTES, int(rate * SLICE_SECONDS) // 4096 * 4096))


async def write_paced(stream: Any, body: bytes, limiter: UploadLimiter, timeout: float) -> None:
    """Write ``body`` as one frame (its length prefix, then the bytes) in slices of
    ``limiter.slice_bytes``, each paid for in ``limiter`` and written within ``timeout``. A
    stream with ``accepts_views`` is handed slices of ``body`` itself; others get copies."""
    view, step = memoryview(body), limiter.slice_bytes
    first = max(step - wire.FRAME_HEADER.size, 0)
    pieces = [wire.frame_header(len(body)) + view[:first]]
    pieces += (view[i : i + step] for i in range(first, len(view), step))
    copy = not getattr(stream, "accepts_views", False)
    for piece in pieces:
        await limiter.acquire(len(piece))
        with trio.fail_after(timeout):
            await stream.write(bytes(piece) if copy and isinstance(piece, memoryview) else piece)
