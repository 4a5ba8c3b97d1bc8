"""The learner's network handlers: join, lease, submit, return, status, and the liveness sweep.

Every submission is checked in this order, and a refusal changes only rejection counters:
run id → signature by the stream's remote peer (``wrong_signer`` / ``bad_signature``) → nonce
not seen (``replay``) → lease active and held by that peer (``replay`` once settled by a result,
``unknown_lease`` if expired/returned/never issued) → groups match the lease (``schema``) →
staleness ``t − b ≤ S`` (``stale_version``; the lease is settled and its prompts re-queued) →
version published and held (``unpublished_version``) → completions end at EOS/stop
(``bad_rollout``) → spot check (``logprob_mismatch``, ``learner/spot_check.py``; ``unverifiable``
if it cannot run for a flagged peer) → rewards by the task verifier, for episodes by replay
(``env_mismatch``, ``learner/replay.py``, counted against the peer like a log-prob mismatch).
Lease limits, deadlines, expiry back-off and these checks: ``learner/admission.py``.

Spot checks: a random ``fraction`` of submissions (every submission of a flagged peer) is
recomputed with the snapshot of the claimed behaviour version (the broadcaster's store keeps
every version within S of the newest); if that snapshot is gone the check is skipped and
counted (``spot_checks_skipped``; for a flagged peer: refused). A mismatch beyond tolerance
settles the lease as refused (its prompts are re-queued), counts ``rollouts_rejected_logprob`` (submissions), flags the
peer (from then on all its submissions are checked) and answers ``logprob_mismatch``. After
``ban_after`` mismatches (default 3; 0: never) the peer is banned for the rest of the run: its
leases are expired (prompts re-queued) and every later lease request is refused with
``logprob_mismatch``. Flags and bans are kept by peer ID across re-joins and, through the
learner's checkpoint (``learner/resume.py``), across a learner restart with ``--resume``.

Cost-aware activation (``policy.activation == "cost"``, architecture §7): see ``learner/activation.py``;
standby nodes' lease requests are answered ``lease_deferred`` / ``standby``.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from echorl.actor.types import RolloutGroup as ActorGroup
from echorl.learner.buffer import StalenessBuffer, Verdict
from echorl.learner.replay import ReplayMismatch, episode_spec
from echorl.protocol import limits, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import (
    Capability, JoinAccepted, JoinRequest, Lease, LeaseDeferred, LeasePrompt, LeaseRequest, LeaseReturn, Message,
    Status, StatusRequest, Submit, SubmitAccepted,
)

from echorl.protocol import routes
from echorl.learner.admission import Admission, convert_submission, finite_row, submit_cap
from echorl.learner.activation import Activation, NodeOffer, choose_active, preemption_margin
from echorl.net.host import Host, PeerUnavailable, RequestContext
from echorl.learner.membership import Members
from echorl.learner.ledger import Ledger
from echorl.learner.leases import LeaseBook, LeasePolicy, LeaseRecord  # noqa: F401 - LeasePolicy re-exported
from echorl.learner.resume import decode_service_state, encode_service_state
from echorl.learner.spot_check import SpotChecker
from echorl.learner.policing import Policing
from echorl.learner.roster import Roster, RosterPolicy
from echorl.protocol.identity import short_id

log = logging.getLogger("echorl.node.learner")


@dataclass
class PeerRecord:
    peer_id: str
    capability: Capability
    joined_at: float
    last_seen: float
    version: int = -1
    alive: bool = True
    leases_done: int = 0
    groups_accepted: int = 0
    generate_seconds: float = 0.0
    groups_generated: int = 0

    @property
    def rollouts_per_s(self) -> float:
        """Measured rollout-group throughput while generating (μ_i of the capacity model)."""
        return self.groups_generated / self.generate_seconds if self.generate_seconds > 0 else 0.0


class LearnerService(Policing):
    """``version`` (the trainer's newest version t), ``required`` (the provisioning rule's Σμ)
    and ``summary`` (the run's headline figures for status) are read from the trainer."""

    def __init__(self, identity: Identity, run_id: str, task: Any, tokenizer: Any,
                 buffer: StalenessBuffer, policy: LeasePolicy, vocab_size: int, *,
                 version: Callable[[], int] = lambda: 0, published: int = 0,
                 required: Callable[[], float | None] = lambda: None,
                 summary: Callable[[], dict[str, Any]] = dict,
                 spot: SpotChecker | None = None, ban_after: int = 3, incarnation: bytes | None = None) -> None:
        self.identity = identity
        self.incarnation = incarnation or secrets.token_bytes(16)  # the broadcaster's: signed into manifests
        self.run_id = run_id
        self.task = task
        self.tokenizer = tokenizer
        self.buffer = buffer
        self.policy = policy
        self.vocab_size = vocab_size
        self.book = LeaseBook()
        self.peers: dict[str, PeerRecord] = {}
        self._version = version
        self.published = published  # newest version handed to the broadcast (and the fetch fallback)
        self.members = Members(identity, run_id)  # one process per key, dial-back, run end (learner/membership.py)
        self.stopping = False  # no new leases (the learner is checkpointing and exiting)
        self.accepted = trio.Event()
        self.counters: dict[str, int] = {
            "signatures_verified": 0, "rollouts_rejected_invalid": 0, "submissions_rejected_replay": 0,
            "submissions_rejected_unknown_lease": 0, "submissions_rejected_stale": 0,
            "submissions_accepted": 0, "groups_received": 0, "submissions_rejected_unpublished": 0,
            "rollouts_rejected_bad": 0, "submissions_rejected_unverifiable": 0, "leases_refused": 0,
            "train_steps_skipped_nonfinite": 0, "train_batches_dropped": 0, "versions_withheld_nonfinite": 0,
        }
        self.summary = summary
        self.admission = Admission(held_versions=policy.staleness + 2)
        self.roster = Roster(RosterPolicy.of(policy))  # per-IP joins, plan members, idle drop (learner/roster.py)
        self.host: Host | None = None
        self.spot = spot  # None: spot checks off
        self.ban_after = ban_after  # mismatches before a peer is refused leases (0: never)
        self.remembered_addrs: dict[str, list[str]] = {}  # nodes of a checkpoint, to re-dial
        self.mismatches: dict[str, int] = {}  # peer id -> spot-check mismatches (flags survive re-joins)
        self.counters.update({"spot_checks": 0, "spot_checks_skipped": 0, "rollouts_rejected_logprob": 0,
                              "rollouts_rejected_env": 0, "peers_flagged": 0, "peers_banned": 0})
        self.spot_check_seconds = 0.0
        self.spot_check_passed_max_abs_diff = 0.0  # largest max |Δ| of a passing check: headroom to the tolerance
        # cost-aware activation: the current decision (None: everyone active), the required Σμ
        # (from the trainer's EMAs; None: unbounded or unknown) and recent losses
        self.activation: Activation | None = None
        self.required_fn = required
        self.losses: deque[tuple[float, str]] = deque()  # (monotonic time, peer id) of liveness expiries
        self._last_decision = 0.0
        self.ledger = Ledger(identity, run_id)  # receipts, per-peer rejections by reason, cost

    @property
    def version(self) -> int:
        return self._version()

    def note_published(self, version: int, weights_bytes: int = 0) -> None:
        """A version is held for the fetch fallback and being broadcast: nodes may ask for it.
        ``weights_bytes`` (the full snapshot's size) lengthens every lease by the time a node
        may spend loading a version that arrives while it works (``Admission.deadline``)."""
        self.published = max(self.published, version)
        self.admission.note_published(version, weights_bytes)

    async def wait_for_submission(self, timeout_s: float) -> None:
        """Until the next accepted submission (or ``timeout_s``, or :meth:`stop`)."""
        self.accepted = trio.Event()
        with trio.move_on_after(timeout_s):
            await self.accepted.wait()

    def stop(self) -> None:
        """No new leases (the learner is checkpointing and exiting); wake the trainer."""
        self.stopping = True
        self.accepted.set()

    def state_dict(self) -> dict[str, Any]:
        """Spot-check mismatch counts and recent nodes' addresses (``learner/resume.py``)."""
        return encode_service_state(self.peers, self.mismatches)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore mismatch counts (flags and bans survive a restart) and the addresses to re-dial."""
        self.mismatches, self.remembered_addrs = decode_service_state(state)
        for peer_id in self.mismatches if self.spot is not None else ():
            self.spot.flag(peer_id)
        if self.mismatches:
            log.info("restored spot-check flags of %d peers (%d banned)", len(self.mismatches),
                     sum(self.banned(p) for p in self.mismatches))

    # --- wiring -------------------------------------------------------------------------------
    def install(self, host: Host) -> None:
        self.host = host
        joined = {routes.LEASE: self.admits, routes.SUBMIT: self.admits, routes.RETURN: self.admits}
        pol = self.policy
        host.serve({routes.JOIN: self.on_join, routes.LEASE: self.members.lease_or_end(self.on_lease, self.peers),
                    routes.SUBMIT: self.ledger.counting(self.on_submit), routes.RETURN: self.on_return,
                    routes.STATUS: self.on_status, routes.DIALBACK: self.members.dial_back_handler(host)},
                   # joins, dial-backs and the run's end: learner/membership.py
                   admit=joined,
                   max_request_bytes={routes.SUBMIT: submit_cap(pol.sampling.max_new_tokens, pol.group_size,
                                                                pol.prompts_per_lease)})

    def admits(self, peer_id: str) -> bool:
        """Whether a peer's lease/submit/return bodies are read at all: only once it joined."""
        return peer_id in self.peers

    def _peer(self, ctx: RequestContext) -> PeerRecord:
        rec = self.peers.get(ctx.peer_id)
        if rec is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "not joined: send a join request first")
        rec.last_seen = time.monotonic()
        rec.alive = True
        return rec

    # --- handlers -----------------------------------------------------------------------------
    async def on_join(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, JoinRequest)
        if msg.run_id != self.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"run {msg.run_id!r} is not served here")
        wire.verify(msg, expected_signer=ctx.peer_id)
        if abs(msg.timestamp - time.time()) > limits.MAX_CLOCK_SKEW_S:
            raise ProtocolError(ErrorCode.REPLAY, "join timestamp outside the clock-skew window")
        self.book.check_nonce(msg.nonce)
        self.book.settle(f"join:{msg.nonce.hex()}", "join", msg.nonce)
        self.counters["signatures_verified"] += 1
        ip = self.host.remote_ip(ctx.peer_id) if self.host is not None else None
        self.roster.check_join(ctx.peer_id, ip)
        cap = await self.members.admit(msg, ctx.peer_id, self.peers, self.host, self.policy)
        now, old = time.monotonic(), self.peers.get(ctx.peer_id)
        rec = PeerRecord(ctx.peer_id, cap, now, now, msg.version)
        if old is not None:  # a re-join keeps the throughput history
            rec.leases_done, rec.groups_accepted = old.leases_done, old.groups_accepted
            rec.generate_seconds, rec.groups_generated = old.generate_seconds, old.groups_generated
        self.peers[ctx.peer_id] = rec
        self.roster.note_join(ctx.peer_id, ip)
        if self.host is not None:
            self.host.add_peer_addrs(ctx.peer_id, list(cap.listen_addrs))
        return JoinAccepted(run_id=self.run_id, learner_peer_id=self.identity.peer_id, version=self.published,
                            staleness_bound=self.policy.staleness, heartbeat_s=self.policy.heartbeat_s,
                            incarnation=self.incarnation)

    async def on_lease(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, LeaseRequest)
        peer = self._peer(ctx)
        peer.version = msg.version
        if self.banned(ctx.peer_id):
            raise ProtocolError(ErrorCode.LOGPROB_MISMATCH,
                                f"refused: {self.mismatches[ctx.peer_id]} behaviour log-prob mismatches")
        pol = self.policy
        try:
            wait = self.admission.lease_wait(ctx.peer_id, len(self.book.held_by(ctx.peer_id)))
        except ProtocolError:
            self.counters["leases_refused"] += 1
            raise
        if wait > 0:
            return self._deferred("paced", retry_after_s=min(wait, 3600.0))
        if self.stopping:
            return self._deferred("stopping", retry_after_s=1.0)
        if self.is_standby(ctx.peer_id):
            return self._deferred("standby", retry_after_s=pol.activation_interval_s)
        if msg.incarnation not in (None, self.incarnation):  # weights of a branch this learner abandoned
            return self._deferred("weights_unknown", want_version=self.published)
        min_version = pol.min_version(self.version, self.published)
        if msg.version < min_version:
            return self._deferred("weights_too_old", want_version=min_version)
        if msg.version > self.published:
            return self._deferred("weights_unknown", want_version=self.published)
        if not self.admission.holds(msg.version, self.published):  # e.g. published before a resume:
            return self._deferred("weights_too_old", want_version=self.published)  # never acceptable
        room = pol.room(self.version, msg.version, len(self.buffer) + self.book.outstanding_prompts())
        n = min(msg.max_prompts, pol.prompts_per_lease, room)
        if not self.admission.measured(ctx.peer_id):
            n = min(n, self.admission.unmeasured_room(pol.in_flight_cap, pol.prompts_per_lease,
                                                              self.book.active.values()))
        if n <= 0:
            return self._deferred("paced", retry_after_s=0.05)
        prompts = self.buffer.next_prompts(self.task, n)
        timeout_s = self.admission.deadline(ctx.peer_id, n, pol.group_size, pol.sampling.max_new_tokens,
                                            pol.lease_timeout_s, float(peer.capability.tokens_per_s))
        rec = self.book.issue(ctx.peer_id, prompts, pol.group_size, min_version, time.monotonic(), timeout_s)
        return Lease(lease_id=rec.lease_id, run_id=self.run_id,
                     prompts=[LeasePrompt(prompt_id=p.prompt_id, text=p.text, episode=episode_spec(self.task, p))
                              for p in prompts],
                     group_size=pol.group_size, sampling=pol.sampling, min_version=min_version,
                     deadline_s=timeout_s)

    def _deferred(self, reason: str, want_version: int = -1, retry_after_s: float = 0.0) -> LeaseDeferred:
        return LeaseDeferred(run_id=self.run_id, reason=reason, want_version=want_version, retry_after_s=retry_after_s)

    async def on_submit(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, Submit)
        try:
            if msg.run_id != self.run_id:
                raise ProtocolError(ErrorCode.SCHEMA, f"run {msg.run_id!r} is not served here")
            await trio.to_thread.run_sync(wire.verify, msg, ctx.peer_id)
        except ProtocolError:
            self.counters["rollouts_rejected_invalid"] += 1
            raise
        self.counters["signatures_verified"] += 1
        rec = self._open_lease(msg, ctx)
        peer = self._peer(ctx)
        b = msg.behaviour_version
        if msg.incarnation not in (None, self.incarnation):
            self._settle_refused(rec, msg.nonce, "stale")
            self.counters["submissions_rejected_stale"] += 1
            raise ProtocolError(ErrorCode.WRONG_INCARNATION, f"v{b} is of a branch this learner abandoned")
        if self.version - b > self.policy.staleness or b < rec.min_version:
            self._settle_refused(rec, msg.nonce, "stale")
            self.counters["submissions_rejected_stale"] += 1
            raise ProtocolError(ErrorCode.STALE_VERSION,
                                f"behaviour version {b} vs learner {self.version}, bound {self.policy.staleness}")
        try:
            self.admission.check_version(b, self.published)
            groups = await trio.to_thread.run_sync(self._convert, msg, rec)
        except ProtocolError as exc:
            self._settle_refused(rec, msg.nonce, exc.code.value)
            key = {ErrorCode.UNPUBLISHED_VERSION: "submissions_rejected_unpublished",
                   ErrorCode.BAD_ROLLOUT: "rollouts_rejected_bad"}.get(exc.code, "rollouts_rejected_invalid")
            self.counters[key] += 1
            raise
        if self.spot is not None and self.spot.should_check(ctx.peer_id):
            await self._spot_check(groups, b, rec, msg.nonce, ctx.peer_id)
        try:  # the verifier (episodes: the replay), off the event loop
            rewards = await trio.to_thread.run_sync(self.buffer.score, groups)
        except ReplayMismatch as exc:
            self.counters["rollouts_rejected_env"] += 1
            self._count_against(ctx.peer_id, rec, msg.nonce, "env_mismatch")
            log.warning("replay refused an episode of %s: %s", short_id(ctx.peer_id), exc)
            raise ProtocolError(ErrorCode.ENV_MISMATCH, f"episode differs from the learner's replay: {exc}"[:512]) from None
        # the spot check and the verifier ran in worker threads: the lease may have been settled
        # meanwhile (expired, returned, or a concurrent submission for it), so look again
        rec = self._open_lease(msg, ctx)
        self.book.settle(rec.lease_id, "result", msg.nonce)
        self.admission.on_result(ctx.peer_id, len(groups), rec.issued_at)
        kept = [g for g, r in zip(groups, rewards) if self.buffer.offer(g, self.version, r) == Verdict.ACCEPTED]
        accepted = len(kept)
        for g in kept:
            self.admission.note_contributor(g.prompt_id, ctx.peer_id)
        self.counters["submissions_accepted"] += 1
        self.counters["groups_received"] += len(groups)
        peer.leases_done += 1
        peer.groups_accepted += accepted
        tokens = sum(len(s.token_ids) for g in msg.groups for s in g.samples)
        peer.generate_seconds += self.admission.generate_seconds(msg.generate_seconds, tokens)
        peer.groups_generated += len(groups)
        peer.version = max(peer.version, b)
        self.accepted.set()
        receipt = await self.ledger.issue(ctx.peer_id, rec.lease_id, len(groups), kept, b, self.version)
        return SubmitAccepted(lease_id=rec.lease_id, accepted=accepted, version=self.version, receipt=receipt)

    def _open_lease(self, msg: Submit, ctx: RequestContext) -> LeaseRecord:
        """The still-open lease this submission answers; refused (and counted) if the nonce was
        seen or the lease is unknown, settled, expired or someone else's."""
        try:
            self.book.check_nonce(msg.nonce)
            return self.book.lookup(msg.lease_id, ctx.peer_id)
        except ProtocolError as exc:
            key = "submissions_rejected_replay" if exc.code == ErrorCode.REPLAY else "submissions_rejected_unknown_lease"
            self.counters[key] += 1
            raise

    def _convert(self, msg: Submit, rec: LeaseRecord) -> list[ActorGroup]:
        return convert_submission(msg, rec, self.policy.sampling, self.tokenizer, self.vocab_size, self.admission,
                                  self.task)

    async def on_return(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, LeaseReturn)
        self._peer(ctx)
        returned = self.book.return_leases(ctx.peer_id, list(msg.lease_ids))
        for rec in returned:
            self.buffer.requeue(rec.prompts)
        return LeaseReturn(run_id=self.run_id, lease_ids=[r.lease_id for r in returned])

    async def on_status(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, StatusRequest)
        return self.status(msg.cursor or 0, min(msg.limit or limits.DEFAULT_STATUS_PAGE, limits.MAX_STATUS_PAGE))

    def status(self, cursor: int = 0, limit: int = limits.DEFAULT_STATUS_PAGE) -> Status:
        now = time.monotonic()
        learner = {"peer_id": self.identity.peer_id, "version": self.version, "staleness_bound": self.policy.staleness,
                   "buffer": len(self.buffer), "leases_active": len(self.book.active),
                   "leases_expired": self.book.expired, **self.counters, **self.roster.counters,
                   "spot_check_fraction": self.spot.fraction if self.spot is not None else 0.0,
                   "spot_check_seconds": round(self.spot_check_seconds, 4),
                   "spot_check_passed_max_abs_diff": self.spot_check_passed_max_abs_diff}
        learner.update({k: v for k, v in self.summary().items() if isinstance(v, (int, float, str, bool)) or v is None})
        learner.update(self.activation_metrics())
        learner.update(self.ledger.metrics(self.peers.values(), self.version, self.policy.group_size))
        peers = []
        for p in list(self.peers.values())[cursor:cursor + limit]:
            c = p.capability
            peers.append({"peer_id": p.peer_id, "device": c.device, "engine": c.engine, "version": p.version,
                          "tokens_per_s": round(c.tokens_per_s, 1), "price_per_hour": c.price_per_hour,
                          "leases": len(self.book.held_by(p.peer_id)), "leases_done": p.leases_done,
                          "groups_accepted": p.groups_accepted, "rollouts_per_s": round(p.rollouts_per_s, 3),
                          "last_seen_s": round(now - p.last_seen, 2), "alive": p.alive, "reachable": c.reachable,
                          "logprob_mismatches": self.mismatches.get(p.peer_id, 0), "banned": self.banned(p.peer_id),
                          "standby": self.is_standby(p.peer_id), **self.ledger.peer_fields(p.peer_id)})
        return Status(run_id=self.run_id, learner=finite_row(learner), peers=[finite_row(p) for p in peers],
                      total_peers=len(self.peers),
                      next_cursor=cursor + limit if cursor + limit < len(self.peers) else None)

    def broadcast_nodes(self, window_s: float = 60.0) -> list[Any]:
        """The joined nodes a version is broadcast to: alive, heard from recently and chosen by
        the roster (workers and a few newcomers, ``learner/roster.py``). Once some node has
        worked, newcomers are leaves: an identity that never worked relays nothing to others."""
        from echorl.broadcast.broadcaster import NodeInfo

        chosen = self.roster.plan(self.active_peers(window_s))
        any_worker = any(self.roster.is_worker(p) for p in chosen)
        return [NodeInfo(p.peer_id, bool(p.capability.reachable), tuple(p.capability.listen_addrs),
                         leaf=any_worker and not self.roster.is_worker(p)) for p in chosen]

    # --- cost-aware activation (architecture §7) ---------------------------------------------------
    def is_standby(self, peer_id: str) -> bool:
        """True if the current decision parks this peer (only with ``activation == "cost"``)."""
        return self.policy.activation == "cost" and self.activation is not None and peer_id in self.activation.standby

    def activation_metrics(self) -> dict[str, Any]:
        """``activation``, ``nodes_standby`` and ``activation_target_per_s`` for metrics/status."""
        act = self.activation if self.policy.activation == "cost" else None
        return {"activation": self.policy.activation, "nodes_standby": len(act.standby) if act else 0,
                "activation_target_per_s": act.target_per_s if act else None}

    def reactivate(self, now: float | None = None) -> Activation | None:
        """Re-make the activation decision from the live peers' prices and measured throughput
        and the current required throughput; a no-op (None) unless ``activation == "cost"``."""
        pol = self.policy
        if pol.activation != "cost":
            return None
        now = time.monotonic() if now is None else now
        while self.losses and now - self.losses[0][0] > pol.activation_loss_window_s:
            self.losses.popleft()
        live = self.active_peers()
        offers = [NodeOffer(p.peer_id, float(p.capability.price_per_hour), p.rollouts_per_s, p.rollouts_per_s > 0)
                  for p in live]
        seen = {p.peer_id for p in self.active_peers(pol.activation_loss_window_s)} | {pid for _, pid in self.losses}
        margin = preemption_margin(len(self.losses), len(seen), pol.activation_margin)
        try:
            required = self.required_fn()
        except Exception:  # a broken estimate must not stop the learner: everyone works
            log.exception("required throughput unavailable; all nodes active")
            required = None
        before = self.activation
        decision = choose_active(offers, required, margin)
        if before is not None and decision.standby & before.active:
            # hysteresis: park an active node only if the cheaper set also meets a larger target,
            # so a requirement hovering around one node's throughput does not flap the set
            # (a larger target picks a longer prefix of the same order: a superset of active nodes)
            decision = choose_active(offers, required, margin + pol.activation_hysteresis)
        self.activation = decision
        self._last_decision = now
        changed = bool(offers) if before is None else (before.active, before.standby) != (decision.active, decision.standby)
        if changed:
            log.info("activation: %d active, %d standby (target %s/s, margin %.2f)", len(self.activation.active),
                     len(self.activation.standby),
                     "-" if self.activation.target_per_s is None else f"{self.activation.target_per_s:.2f}", margin)
        return self.activation

    def _lost(self, peer_id: str) -> None:
        """A peer failed its liveness probe: count the loss; re-decide at once if it was active."""
        self.losses.append((time.monotonic(), peer_id))
        if self.policy.activation == "cost" and not self.is_standby(peer_id):
            self.reactivate()

    # --- maintenance --------------------------------------------------------------------------
    def active_peers(self, window_s: float = 30.0) -> list[PeerRecord]:
        now = time.monotonic()
        return [p for p in self.peers.values() if p.alive and now - p.last_seen < window_s]

    async def maintain(self, interval_s: float = 0.5) -> None:
        """Forever: expire overdue leases; ping every live peer not heard from lately and, if it
        does not answer, expire its leases at once and drop it from broadcast plans (a SIGKILLed
        or frozen node is noticed in seconds, not at the lease deadline);
        with cost-aware activation, re-decide the active set every ``activation_interval_s``."""
        while True:
            if self.policy.activation == "cost" and time.monotonic() - self._last_decision >= self.policy.activation_interval_s:
                self.reactivate()
            for rec in self.book.expire_due(time.monotonic()):
                log.info("lease %s of %s expired", rec.lease_id, short_id(rec.peer_id))
                self.buffer.requeue(rec.prompts)
                self.admission.on_expired(rec.peer_id)
            self._drop_idle()
            await self._close_refused()
            now = time.monotonic()
            quiet = [pid for pid, p in self.peers.items()
                     if p.alive and now - p.last_seen > self.policy.liveness_after_s]
            if quiet and self.host is not None:
                async with trio.open_nursery() as nursery:
                    for pid in quiet:
                        nursery.start_soon(self._probe, pid)
            await trio.sleep(interval_s)

    def _drop_idle(self) -> None:
        """Forget members that never worked and joined long ago or stopped answering."""
        busy = {r.peer_id for r in self.book.active.values()} | {p for p in self.peers if self.is_standby(p)}
        for pid in self.roster.drop_idle(self.peers, busy):
            self.members.instances.pop(pid, None)

    async def _close_refused(self) -> None:
        """Close the connections of joiners the roster refused (after their answer went out)."""
        refused = self.roster.take_refused()
        if refused and self.host is not None:
            async with trio.open_nursery() as nursery:
                for pid in refused:
                    if pid not in self.peers:
                        nursery.start_soon(self.host.disconnect, pid)

    async def _probe(self, peer_id: str) -> None:
        assert self.host is not None
        try:
            await self.host.ping(peer_id, timeout=self.policy.ping_timeout_s)
            self.peers[peer_id].last_seen = time.monotonic()
        except PeerUnavailable as exc:
            gone = self.book.expire_peer(peer_id)
            for rec in gone:
                self.buffer.requeue(rec.prompts)
            if peer_id not in self.peers:
                return
            self.peers[peer_id].alive = False
            log.warning("peer %s unresponsive (%s): %d leases expired", short_id(peer_id), exc, len(gone))
            self._lost(peer_id)

