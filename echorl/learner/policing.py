"""How the learner polices a peer whose input was bad: spot checks that refuse and flag,
mismatches counted toward a ban, checks that cannot run for a flagged peer, the contributors of a
skipped training step (docs/threat-model.md).

:class:`Police` is one component of the learner service: it owns the spot checker, the ban
threshold and the counters of what it did; a peer's flags and mismatch counts are the peer
book's (``learner/peers.py``); settling a refused lease is the caller's ``refuse`` (the lease
book and the buffer are the service's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from echorl.actor.types import RolloutGroup as ActorGroup
from echorl.learner.leases import LeaseBook, LeaseRecord
from echorl.learner.peers import PeerBook
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id

if TYPE_CHECKING:
    from echorl.learner.admission import Admission
    from echorl.learner.spot_check import SeedProof, SpotChecker, SpotResult

log = logging.getLogger(__name__)

Refuse = Callable[[LeaseRecord, bytes, str], None]
"""Settle a lease as refused (``how``) and re-queue its prompts, if it is still open."""


class Police:
    """Spot checks, flags and bans. ``spot``: None turns spot checks off; ``ban_after``:
    mismatches before a peer is refused leases (0: never)."""

    def __init__(
        self,
        book: PeerBook,
        leases: LeaseBook,
        admission: Admission,
        refuse: Refuse,
        requeue: Callable[[list[LeaseRecord]], None],
        spot: SpotChecker | None = None,
        ban_after: int = 3,
    ) -> None:
        self.book, self.leases, self.admission = book, leases, admission
        self.refuse, self.requeue = refuse, requeue
        self.spot = spot
        self.ban_after = ban_after
        self.counters = {
            "spot_checks": 0,
            "spot_checks_skipped": 0,
            "peers_flagged": 0,
            "peers_banned": 0,
            "sampling_proofs_failed": 0,
        }
        self.spot_check_seconds = 0.0
        self.spot_check_passed_max_abs_diff = 0.0  # largest max |Δ| of a passing check: headroom to the tolerance

    def metrics(self) -> dict[str, float]:
        return {
            **self.counters,
            "spot_check_fraction": self.spot.fraction if self.spot is not None else 0.0,
            "spot_check_seconds": self.spot_check_seconds,
            "spot_check_passed_max_abs_diff": self.spot_check_passed_max_abs_diff,
        }

    def banned(self, peer_id: str) -> bool:
        return self.ban_after > 0 and self.book.mismatches.get(peer_id, 0) >= self.ban_after

    def check_not_banned(self, peer_id: str) -> None:
        """A banned peer's lease requests are refused with ``logprob_mismatch``."""
        if self.banned(peer_id):
            n = self.book.mismatches[peer_id]
            raise ProtocolError(ErrorCode.LOGPROB_MISMATCH, f"refused: {n} behaviour log-prob mismatches")

    def should_check(self, peer_id: str) -> bool:
        return self.spot is not None and self.spot.should_check(peer_id in self.book.flagged)

    def step_skipped(self, batch: list[ActorGroup], why: str) -> None:
        """The trainer skipped a batch (it counts that): after a non-finite step flag every
        contributor (from then on each of their submissions is spot-checked)."""
        suspects = self.admission.contributors_of([g.prompt_id for g in batch])
        log.warning("step skipped (%s); contributors flagged: %s", why, [p[:16] for p in suspects])
        if why == "nonfinite" and self.spot is not None:
            for pid in suspects:
                self.book.flag(pid)

    async def spot_check(
        self,
        groups: list[ActorGroup],
        version: int,
        rec: LeaseRecord,
        nonce: bytes,
        peer_id: str,
        proof: SeedProof | None = None,
    ) -> SpotResult | None:
        """Recompute the behaviour log-probs (and, with a ``proof``, replay the seeded choices:
        the result says whether they held); on a log-prob mismatch refuse, flag (and maybe ban).
        None: the check did not run."""
        assert self.spot is not None
        try:
            cap = self.book[peer_id].capability  # joined: the submit handler looked it up
            res = await self.spot.check(groups, version, cap.engine, cap.dtype, proof)
        except Exception:
            log.exception("spot check of v%d failed to run; counted as skipped", version)
            self._unchecked(rec, nonce, peer_id, version)
            return None
        self.spot_check_seconds += res.seconds
        if res.skipped:
            self._unchecked(rec, nonce, peer_id, version)
            return None
        self.counters["spot_checks"] += 1
        if res.ok:
            self.spot_check_passed_max_abs_diff = max(self.spot_check_passed_max_abs_diff, res.max_abs_diff)
            return res
        n = self.count_against(peer_id, rec, nonce, ErrorCode.LOGPROB_MISMATCH)
        log.warning(
            "spot check failed for %s at v%d: mean |Δ| %.4f, max |Δ| %.4f over %d tokens (mismatch %d)",
            short_id(peer_id),
            version,
            res.mean_abs_diff,
            res.max_abs_diff,
            res.tokens,
            n,
        )
        raise ProtocolError(
            ErrorCode.LOGPROB_MISMATCH,
            f"behaviour log-probs do not match version {version}: mean |Δ| {res.mean_abs_diff:.4f}, "
            f"max |Δ| {res.max_abs_diff:.4f} over {res.tokens} tokens",
        )

    def not_sampled(self, peer_id: str, rec: LeaseRecord, nonce: bytes, res: SpotResult) -> ProtocolError:
        """A proven cheat (its tokens are not the lease's seeded samples): refuse, count against
        the peer, and expire its other leases (their submissions are refused as unknown); the
        error to raise."""
        self.counters["sampling_proofs_failed"] += 1
        n = self.count_against(peer_id, rec, nonce, ErrorCode.NOT_SAMPLED)
        self.requeue(self.leases.expire_peer(peer_id))
        log.warning(
            "sampling replay failed for %s: %d of %d tokens not the seeded choice (max gap %.3f, mismatch %d)",
            short_id(peer_id),
            res.misses,
            res.replayed,
            res.max_gap,
            n,
        )
        return ProtocolError(
            ErrorCode.NOT_SAMPLED,
            f"{res.misses} of {res.replayed} tokens are not the lease's seeded samples (max gap {res.max_gap:.3f})",
        )

    def count_against(self, peer_id: str, rec: LeaseRecord, nonce: bytes, code: ErrorCode) -> int:
        """A forged submission: settle it refused, flag the peer, ban at ``ban_after``; the count."""
        self.refuse(rec, nonce, code.value)
        n = self.book.count_mismatch(peer_id)
        if n == 1:
            self.counters["peers_flagged"] += 1
        if self.banned(peer_id) and n == self.ban_after:
            self.counters["peers_banned"] += 1
            self.requeue(self.leases.expire_peer(peer_id))
            log.warning("peer %s banned after %d mismatches (log-probs or episodes)", short_id(peer_id), n)
        return n

    def _unchecked(self, rec: LeaseRecord, nonce: bytes, peer_id: str, version: int) -> None:
        """A spot check that was due and could not run (the claimed version's snapshot is not
        held, yet or any more): counted and refused, for every peer (skipped is never accepted:
        no one escapes a check by claiming a version being built); its prompts go back to the
        queue. Not counted against the peer (the learner could not check, it did not fail)."""
        self.counters["spot_checks_skipped"] += 1
        self.refuse(rec, nonce, ErrorCode.UNVERIFIABLE.value)
        raise ProtocolError(ErrorCode.UNVERIFIABLE, f"the spot check of v{version} cannot run now; lease re-queued")
