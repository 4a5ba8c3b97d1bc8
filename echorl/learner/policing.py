"""How the learner polices a peer whose input was bad: spot checks that refuse and flag,
mismatches counted toward a ban, checks that cannot run for a flagged peer, the contributors of a
skipped training step (docs/threat-model.md).

Which submissions are checked: every one of a suspect (flagged, or joined from an address a
proven cheat joined from: ``PeerBook.suspect``) and a newcomer's first ``NEWCOMER_CHECKS``; the
rest at the check fraction. A proven cheat (a log-prob mismatch, a failed sampling replay, an
episode the replay refutes) is convicted (:meth:`Police.convict`): flagged, its other leases
expired (their submissions are refused), its groups still waiting in the buffer dropped (their
prompts re-queued), its receipts no replay verified voided in the ledger, its address remembered.

:class:`Police` is one component of the learner service: it owns the spot checker, the ban
threshold and the counters of what it did; a peer's flags and mismatch counts are the peer
book's (``learner/peers.py``), and so are the accounts a conviction voids; settling a refused
lease is the caller's ``refuse`` (the lease book and the buffer are the service's: a conviction
expires leases and drops buffered groups through them).
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
from echorl.rl.buffer import StalenessBuffer

if TYPE_CHECKING:
    from echorl.learner.admission import Admission
    from echorl.learner.spot_check import SeedProof, SpotChecker, SpotResult

log = logging.getLogger(__name__)

NEWCOMER_CHECKS = 3
"""A peer's first accepted submissions that are always checked (with the fraction on): a cheat from
the start is caught on its first submission instead of after 1/f on average (10 at the default
f = 0.1), before it is paid or trained on at all. The cost is bounded: only unproven peers pay
it, three checks each (an identity is free, so a sybil pays it per identity; an honest node once).
Three, because the issue's target is a cheat flagged within 3 submissions."""

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
        buffer: StalenessBuffer,
        spot: SpotChecker | None = None,
        ban_after: int = 3,
    ) -> None:
        self.book, self.leases, self.admission, self.buffer = book, leases, admission, buffer
        self.refuse = refuse
        self.spot = spot
        self.ban_after = ban_after
        self.counters = {
            "spot_checks": 0,
            "spot_checks_skipped": 0,
            "peers_flagged": 0,
            "peers_banned": 0,
            "sampling_proofs_failed": 0,
            "receipts_voided": 0,  # unverified receipts of proven cheats
            "groups_purged": 0,  # buffered groups of proven cheats dropped before training
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
        """Every submission of a suspect peer, a newcomer's first ``NEWCOMER_CHECKS`` (unless the
        fraction is 0: routine checks off), else at the check fraction (the checker's RNG)."""
        if self.spot is None:
            return False
        return self.spot.should_check(self.book.suspect(peer_id) or (self.spot.fraction > 0 and self.newcomer(peer_id)))

    def newcomer(self, peer_id: str) -> bool:
        """Fewer than ``NEWCOMER_CHECKS`` accepted submissions (an untracked peer, beyond the
        book's accounts, stays a newcomer: always checked)."""
        acc = self.book.find_account(peer_id)
        return acc is None or acc.submissions_accepted < NEWCOMER_CHECKS

    def requeue(self, gone: list[LeaseRecord]) -> None:
        for rec in gone:
            self.buffer.requeue(rec.prompts)

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
        the peer (``count_against``: convicted); the error to raise."""
        self.counters["sampling_proofs_failed"] += 1
        n = self.count_against(peer_id, rec, nonce, ErrorCode.NOT_SAMPLED)
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
        """A forged submission: settle it refused, flag and convict the peer, ban at
        ``ban_after``; the count."""
        self.refuse(rec, nonce, code.value)
        n = self.book.count_mismatch(peer_id)
        if n == 1:
            self.counters["peers_flagged"] += 1
        self.convict(peer_id)
        if self.banned(peer_id) and n == self.ban_after:
            self.counters["peers_banned"] += 1
            log.warning("peer %s banned after %d mismatches (log-probs or episodes)", short_id(peer_id), n)
        return n

    def convict(self, peer_id: str) -> None:
        """A proven cheat: its other leases expire (their submissions are refused,
        ``unknown_lease``), its groups still in the buffer are dropped (prompts re-queued), its
        receipts that no replay verified are voided, and its address is remembered
        (``PeerBook.remember_cheat``: new identities from it are checked on every submission)."""
        self.requeue(self.leases.expire_peer(peer_id))
        purged = self.buffer.drop(self.admission.buffered_by(peer_id, self.buffer.buffered_ids()))
        acc = self.book.find_account(peer_id)
        voided = acc.void_unverified() if acc is not None else 0
        self.counters["groups_purged"] += purged
        self.counters["receipts_voided"] += voided
        address = self.book.remember_cheat(peer_id)
        log.warning(
            "convicted %s: %d buffered groups dropped, %d unverified receipts voided, address %s suspect",
            short_id(peer_id),
            purged,
            voided,
            address or "unknown",
        )

    def _unchecked(self, rec: LeaseRecord, nonce: bytes, peer_id: str, version: int) -> None:
        """A spot check that was due and could not run (the claimed version's snapshot is not
        held, yet or any more): counted and refused, for every peer (skipped is never accepted:
        no one escapes a check by claiming a version being built); its prompts go back to the
        queue. Not counted against the peer (the learner could not check, it did not fail)."""
        self.counters["spot_checks_skipped"] += 1
        self.refuse(rec, nonce, ErrorCode.UNVERIFIABLE.value)
        raise ProtocolError(ErrorCode.UNVERIFIABLE, f"the spot check of v{version} cannot run now; lease re-queued")
