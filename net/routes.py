"""Stream protocol IDs of the echorl network plane and their request size caps / rate limits."""

from __future__ import annotations

from echorl.protocol import limits

from echorl.net.ratelimit import RateLimit

JOIN = "/echorl/join/1"  # JoinRequest -> JoinAccepted
LEASE = "/echorl/lease/1"  # LeaseRequest -> Lease | LeaseDeferred | RunEnded
SUBMIT = "/echorl/submit/1"  # Submit -> SubmitAccepted
RETURN = "/echorl/return/1"  # LeaseReturn -> LeaseReturn (the lease ids re-queued)
MANIFEST = "/echorl/manifest/1"  # ManifestRequest -> Manifest
CHUNK = "/echorl/chunk/1"  # ChunkRequest -> Chunk
STATUS = "/echorl/status/1"  # StatusRequest -> Status

#: request size caps (bytes of one frame body)
MAX_REQUEST_BYTES = {
    JOIN: 16 * limits.KiB,
    LEASE: 4 * limits.KiB,
    SUBMIT: limits.MAX_FRAME_BYTES,
    RETURN: 16 * limits.KiB,
    MANIFEST: 4 * limits.KiB,
    CHUNK: 4 * limits.KiB,
    STATUS: 1 * limits.KiB,
}

#: per-peer rate limits
RATES = {
    JOIN: RateLimit(1.0, 10.0),
    LEASE: RateLimit(50.0, 100.0),
    SUBMIT: RateLimit(50.0, 100.0),
    RETURN: RateLimit(5.0, 20.0),
    MANIFEST: RateLimit(20.0, 50.0),
    CHUNK: RateLimit(500.0, 1000.0),
    STATUS: RateLimit(10.0, 30.0),
}
