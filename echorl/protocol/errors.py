"""The one error type of the protocol plane: every refusal is a ``ProtocolError`` with a code.

Codes are stable strings (they travel in ``Error`` messages and are listed in docs/protocol.md),
so a client in another language can branch on them.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    MALFORMED = "malformed"  # not decodable as a frame / msgpack / known message
    OVERSIZED = "oversized"  # frame or field larger than its documented limit
    SCHEMA = "schema"  # decodable, but a field is missing, extra, of the wrong type or out of range
    UNKNOWN_TYPE = "unknown_type"  # message type not defined by this protocol version
    BAD_SIGNATURE = "bad_signature"  # signature does not verify over the canonical bytes
    WRONG_SIGNER = "wrong_signer"  # signature verifies, but by a key other than the claimed/remote peer
    REPLAY = "replay"  # nonce, lease or timestamp already used or outside its window
    STALE_VERSION = "stale_version"  # policy version older than the staleness bound allows
    UNKNOWN_LEASE = "unknown_lease"  # lease id never issued, already settled or expired
    BAD_CHUNK = "bad_chunk"  # chunk bytes do not hash to the name the manifest gives
    BAD_MANIFEST = "bad_manifest"  # manifest inconsistent (sizes, offsets, hashes, versions)
    NOT_FOUND = "not_found"  # requested object (chunk, version) not held here
    RATE_LIMITED = "rate_limited"  # the peer exceeded its request budget
    UNAVAILABLE = "unavailable"  # temporarily cannot serve (e.g. no work); retry later
    INTERNAL = "internal"  # the handler failed; the request may be retried
    LOGPROB_MISMATCH = "logprob_mismatch"  # behaviour log-probs disagree with the claimed version's snapshot
    IDENTITY_IN_USE = "identity_in_use"  # another live node process already joined with this key
    BAD_ROLLOUT = (
        "bad_rollout"  # well-formed rollout that is not a completion of the lease (tokens after EOS/stop, ...)
    )
    UNPUBLISHED_VERSION = "unpublished_version"  # behaviour version the learner never published or no longer holds
    UNVERIFIABLE = "unverifiable"  # a submission whose due spot check cannot run (its lease is re-queued)
    REFUSED = "refused"  # the learner refuses this peer (e.g. its leases keep expiring)
    WRONG_INCARNATION = "wrong_incarnation"  # a version of another learner incarnation (an abandoned --resume branch)
    ENV_MISMATCH = (
        "env_mismatch"  # an episode's observations, turn boundaries or reward differ from the learner's replay
    )
    NOT_SAMPLED = "not_sampled"  # tokens are not the lease's seeded samples under the claimed version (replay)
    PEER_LIMIT = "peer_limit"  # too many peers from this address have joined (or hold connections) already


class ProtocolError(Exception):
    """A refusal with a stable ``code`` and a human-readable ``detail``."""

    def __init__(self, code: ErrorCode, detail: str = "") -> None:
        self.code = ErrorCode(code)
        self.detail = detail
        super().__init__(f"{self.code.value}: {detail}" if detail else self.code.value)
