"""How the learner polices a peer whose input was bad: spot checks that refuse and flag,
mismatches counted toward a ban, checks that cannot run for a flagged peer, the contributors of a
skipped training step. A mixin of ``LearnerService`` (``learner/service.py``), which owns the
state it uses (``book``, ``buffer``, ``counters``, ``spot``, ``mismatches``, ``ban_after``,
``admission``); split out so the service stays one screenful of handlers."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from echorl.actor.types import RolloutGroup as ActorGroup
from echorl.learner.leases import LeaseRecord
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id

if TYPE_CHECKING:
    from echorl.learner.admission import Admission
    from echorl.learner.buffer import StalenessBuffer
    from echorl.learner.leases import LeaseBook
    from echorl.learner.spot_check import SpotChecker

log = logging.getLogger("echorl.node.learner")


class Policing:
    book: "LeaseBook"
    buffer: "StalenessBuffer"
    counters: dict[str, int]
    spot: "SpotChecker | None"
    mismatches: dict[str, int]
    ban_after: int
    admission: "Admission"
    spot_check_seconds: float
    spot_check_passed_max_abs_diff: float
    peers: dict[str, Any]

    def step_skipped(self, batch: list[ActorGroup], why: str) -> None:
        """The trainer skipped a batch: count it; after a non-finite step flag every contributor
        (from then on each of their submissions is spot-checked)."""
        key = "train_steps_skipped_nonfinite" if why == "nonfinite" else "train_batches_dropped"
        self.counters[key] += 1
        suspects = self.admission.contributors_of([g.prompt_id for g in batch])
        log.warning("step skipped (%s); contributors flagged: %s", why, [p[:16] for p in suspects])
        if why == "nonfinite" and self.spot is not None:
            for pid in suspects:
                self.spot.flag(pid)

    async def _spot_check(self, groups: list[ActorGroup], version: int, rec: LeaseRecord, nonce: bytes,
                          peer_id: str) -> None:
        """Recompute the behaviour log-probs; on a mismatch refuse, flag (and maybe ban)."""
        assert self.spot is not None
        try:
            cap = self.peers[peer_id].capability  # joined: the submit handler looked it up
            res = await self.spot.check(groups, version, cap.engine, cap.dtype)
        except Exception:  # noqa: BLE001 - a failing check must not refuse an honest node
            log.exception("spot check of v%d failed to run; counted as skipped", version)
            return self._unchecked(rec, nonce, peer_id, version)
        self.spot_check_seconds += res.seconds
        if res.skipped:
            return self._unchecked(rec, nonce, peer_id, version)
        self.counters["spot_checks"] += 1
        if res.ok:
            self.spot_check_passed_max_abs_diff = max(self.spot_check_passed_max_abs_diff, res.max_abs_diff)
            return
        self.counters["rollouts_rejected_logprob"] += 1
        n = self._count_against(peer_id, rec, nonce, "logprob_mismatch")
        log.warning("spot check failed for %s at v%d: mean |Δ| %.4f, max |Δ| %.4f over %d tokens (mismatch %d)",
                    short_id(peer_id), version, res.mean_abs_diff, res.max_abs_diff, res.tokens, n)
        raise ProtocolError(ErrorCode.LOGPROB_MISMATCH,
                            f"behaviour log-probs do not match version {version}: mean |Δ| {res.mean_abs_diff:.4f}, "
                            f"max |Δ| {res.max_abs_diff:.4f} over {res.tokens} tokens")

    def _count_against(self, peer_id: str, rec: LeaseRecord, nonce: bytes, how: str) -> int:
        """A forged submission: settle it refused, flag the peer, ban at ``ban_after``; the count."""
        if self.book.active.get(rec.lease_id) is rec:  # not settled meanwhile
            self._settle_refused(rec, nonce, how)
        n = self.mismatches.get(peer_id, 0) + 1
        self.mismatches[peer_id] = n
        if n == 1:
            self.counters["peers_flagged"] += 1
        if self.spot is not None:
            self.spot.flag(peer_id)
        if self.banned(peer_id) and n == self.ban_after:
            self.counters["peers_banned"] += 1
            for gone in self.book.expire_peer(peer_id):
                self.buffer.requeue(gone.prompts)
            log.warning("peer %s banned after %d mismatches (log-probs or episodes)", short_id(peer_id), n)
        return n

    def _unchecked(self, rec: LeaseRecord, nonce: bytes, peer_id: str, version: int) -> None:
        """A spot check that could not run: counted; for a flagged peer a refusal (a flagged
        peer cannot escape checks by claiming a version whose snapshot is gone)."""
        self.counters["spot_checks_skipped"] += 1
        if self.spot is None or peer_id not in self.spot.flagged:
            return
        self.counters["submissions_rejected_unverifiable"] += 1
        if self.book.active.get(rec.lease_id) is rec:
            self._settle_refused(rec, nonce, "unverifiable")
        raise ProtocolError(ErrorCode.UNVERIFIABLE, f"flagged peer: the check of v{version} cannot run")

    def banned(self, peer_id: str) -> bool:
        return self.ban_after > 0 and self.mismatches.get(peer_id, 0) >= self.ban_after

    def _settle_refused(self, rec: LeaseRecord, nonce: bytes, how: str) -> None:
        self.book.settle(rec.lease_id, how, nonce)
        self.buffer.requeue(rec.prompts)
