"""The learner's network handlers: join, lease, submit, return, status, and the liveness sweep.

Every submission is checked in this order, and a refusal changes only rejection counters:
run id → signature by the stream's remote peer (``wrong_signer`` / ``bad_signature``) → nonce
not seen (``replay``) → lease active and held by that peer (``replay`` once settled by a result,
``unknown_lease`` if expired/returned/never issued) → groups match the lease (``schema``) →
staleness ``t − b ≤ S`` (``stale_version``; the lease is settled and its prompts re-queued) →
behaviour log-probs spot check (``logprob_mismatch``; DESIGN §3, ``learner/spot_check.py``) →
rewards by the task verifier, for episodes by replay (``env_mismatch``, ``learner/replay.py``,
counted against the peer like a log-prob mismatch). Accepted groups go to the ``StalenessBuffer``.

Spot checks: a random ``fraction`` of submissions (every submission of a flagged peer) is
recomputed with the snapshot of the claimed behaviour version (the broadcaster's store keeps
every version within S of the newest); if that snapshot is gone the check is skipped and
counted (``spot_checks_skipped``). A mismatch beyond tolerance settles the lease as refused
(its prompts are re-queued), counts ``rollouts_rejected_logprob`` (submissions), flags the
peer (from then on all its submissions are checked) and answers ``logprob_mismatch``. After
``ban_after`` mismatches (default 3; 0: never) the peer is banned for the rest of the run: its
leases are expired (prompts re-queued) and every later lease request is refused with
``logprob_mismatch``. Flags and bans are kept by peer ID across re-joins and, through the
learner's checkpoint (``learner/resume.py``), across a learner restart with ``--resume``.

Cost-aware activation (``policy.activation == "cost"``, DESIGN §7, ``learner/activation.py``): every
``activation_interval_s`` (in ``maintain``), and at once when an active node is found dead, the
learner keeps the cheapest set of live nodes (ascending price per unit of measured throughput)
whose Σμ meets the required throughput (``required_fn``, from the trainer's EMAs) × (1 + margin)
active, the margin growing with the observed loss rate (parking a node that is active now needs
an extra ``activation_hysteresis``, so the set does not flap); the rest are standby: their lease
requests are answered ``lease_deferred`` / ``standby`` (they keep receiving broadcasts). With
``"all"`` (default) every node is leased work, as before.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from pydantic import Field

from echorl.actor.types import RolloutGroup as ActorGroup
from echorl.actor.types import Sample as ActorSample
from echorl.learner.buffer import StalenessBuffer, Verdict
from echorl.learner.config import LeaseFields
from echorl.learner.replay import ReplayMismatch, episode_spec
from echorl.protocol import limits, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import (
    Capability, JoinAccepted, JoinRequest, Lease, LeaseDeferred, LeasePrompt, LeaseRequest, LeaseReturn, Message,
    SamplingSpec, Status, StatusRequest, Submit, SubmitAccepted,
)
from echorl.tasks.env import is_episodic

from echorl.protocol import routes
from echorl.learner.activation import Activation, NodeOffer, choose_active, preemption_margin
from echorl.net.host import Host, PeerUnavailable, RequestContext
from echorl.learner.leases import LeaseBook, LeaseRecord
from echorl.learner.ledger import Ledger
from echorl.learner.spot_check import SpotChecker
from echorl.protocol.identity import short_id

log = logging.getLogger("echorl.node.learner")


class LeasePolicy(LeaseFields):
    """The lease service's settings: the :class:`LeaseFields` section of the learner's config
    plus the sampling spec leases carry (taken from the task and the trainer)."""

    sampling: SamplingSpec = Field(default_factory=lambda: SamplingSpec(
        temperature=1.0, top_p=1.0, max_new_tokens=5, stop=[]))
    """what every lease asks the node to sample with"""

    @classmethod
    def of(cls, cfg: LeaseFields, sampling: SamplingSpec) -> "LeasePolicy":
        """The policy of a learner config, field by field (no field is named here)."""
        return cls(**cfg.model_dump(include=set(LeaseFields.model_fields)), sampling=sampling)

    @property
    def version_lag(self) -> int:
        """Safety margin in steps (S ≥ 2): results may arrive one step later than in-order
        accounting says (a fresher node's lease can overtake), so plan for one step less."""
        return 0 if self.staleness <= 1 else 1

    @property
    def in_flight_cap(self) -> int:
        """Buffered + leased prompts allowed, so results stay within the staleness bound."""
        return self.prompts_per_step * max(1, self.staleness - self.version_lag)

    def min_version(self, learner_version: int) -> int:
        """Oldest node version that is still leased work (t − S + margin): with a publication
        period κ ≤ S − margin the last published version always qualifies."""
        return max(0, learner_version - self.staleness + self.version_lag)

    def lease_seconds(self, n_prompts: int, groups_per_s: float, tokens_per_s: float) -> float:
        """A lease's deadline: ``lease_timeout_s``, or 4× the node's expected time for it when
        that is longer (measured group throughput, else its declared tokens/s at full length),
        at most 20× ``lease_timeout_s``. A dead holder is found by the liveness sweep long before."""
        if groups_per_s > 0:
            expected = n_prompts / groups_per_s
        else:
            expected = n_prompts * self.group_size * self.sampling.max_new_tokens / max(tokens_per_s, 1e-3)
        return min(max(self.lease_timeout_s, 4.0 * expected), 20.0 * self.lease_timeout_s)

    def room(self, learner_version: int, node_version: int, in_flight: int) -> int:
        """Prompts a node at version b may be leased now. Groups are trained in arrival order,
        B per step, so a prompt with X prompts in flight before it (itself included) is trained
        at version t + ⌈X/B⌉ − 1; its staleness stays ≤ S iff X ≤ B·(S + 1 − (t − b)); the
        margin takes one step off, and ``in_flight_cap`` bounds X for fresh nodes."""
        steps_left = self.staleness + 1 - self.version_lag - (learner_version - node_version)
        return min(self.in_flight_cap, self.prompts_per_step * steps_left) - in_flight


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


class LearnerService:
    def __init__(self, identity: Identity, run_id: str, task: Any, tokenizer: Any,
                 buffer: StalenessBuffer, policy: LeasePolicy, vocab_size: int) -> None:
        self.identity = identity
        self.run_id = run_id
        self.task = task
        self.tokenizer = tokenizer
        self.buffer = buffer
        self.policy = policy
        self.vocab_size = vocab_size
        self.book = LeaseBook()
        self.peers: dict[str, PeerRecord] = {}
        self.version = 0  # the trainer's newest version t
        self.published = 0  # newest version handed to the broadcast (and the fetch fallback)
        self.stopping = False  # no new leases (the learner is checkpointing and exiting)
        self.accepted = trio.Event()
        self.counters: dict[str, int] = {
            "signatures_verified": 0, "rollouts_rejected_invalid": 0, "submissions_rejected_replay": 0,
            "submissions_rejected_unknown_lease": 0, "submissions_rejected_stale": 0,
            "submissions_accepted": 0, "groups_received": 0,
        }
        self.learner_summary: dict[str, Any] = {}  # filled by the trainer loop for status
        self.host: Host | None = None
        self.spot: SpotChecker | None = None  # set by the learner when spot checks are on
        self.ban_after = 3  # mismatches before a peer is refused leases (0: never)
        self.mismatches: dict[str, int] = {}  # peer id -> spot-check mismatches (flags survive re-joins)
        self.counters.update({"spot_checks": 0, "spot_checks_skipped": 0, "rollouts_rejected_logprob": 0,
                              "rollouts_rejected_env": 0, "peers_flagged": 0, "peers_banned": 0})
        self.spot_check_seconds = 0.0
        self.spot_check_passed_max_abs_diff = 0.0  # largest max |Δ| of a passing check: headroom to the tolerance
        # cost-aware activation: the current decision (None: everyone active), the required Σμ
        # (set by the learner from the trainer's EMAs; None: unbounded or unknown) and recent losses
        self.activation: Activation | None = None
        self.required_fn: Callable[[], float | None] = lambda: None
        self.losses: deque[tuple[float, str]] = deque()  # (monotonic time, peer id) of liveness expiries
        self._last_decision = 0.0
        self.ledger = Ledger(identity, run_id)  # receipts, per-peer rejections by reason, cost

    # --- wiring -------------------------------------------------------------------------------
    def install(self, host: Host) -> None:
        self.host = host
        host.serve({routes.JOIN: self.on_join, routes.LEASE: self.on_lease, routes.SUBMIT: self.ledger.counting(self.on_submit),
                    routes.RETURN: self.on_return, routes.STATUS: self.on_status})

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
        now = time.monotonic()
        old = self.peers.get(ctx.peer_id)
        rec = PeerRecord(ctx.peer_id, msg.capability, now, now, msg.version)
        if old is not None:  # a re-join keeps the throughput history
            rec.leases_done, rec.groups_accepted = old.leases_done, old.groups_accepted
            rec.generate_seconds, rec.groups_generated = old.generate_seconds, old.groups_generated
        self.peers[ctx.peer_id] = rec
        if self.host is not None:
            self.host.add_peer_addrs(ctx.peer_id, list(msg.capability.listen_addrs))
        log.info("joined: %s (%s, %.0f tok/s)", short_id(ctx.peer_id), msg.capability.device, msg.capability.tokens_per_s)
        return JoinAccepted(run_id=self.run_id, learner_peer_id=self.identity.peer_id, version=self.published,
                            staleness_bound=self.policy.staleness, heartbeat_s=self.policy.heartbeat_s)

    async def on_lease(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, LeaseRequest)
        peer = self._peer(ctx)
        peer.version = msg.version
        if self.banned(ctx.peer_id):
            raise ProtocolError(ErrorCode.LOGPROB_MISMATCH,
                                f"refused: {self.mismatches[ctx.peer_id]} behaviour log-prob mismatches")
        pol = self.policy
        if self.stopping:
            return self._deferred("stopping", retry_after_s=1.0)
        if self.is_standby(ctx.peer_id):
            return self._deferred("standby", retry_after_s=pol.activation_interval_s)
        min_version = pol.min_version(self.version)
        if msg.version < min_version:
            return self._deferred("weights_too_old", want_version=min_version)
        if msg.version > self.published:
            return self._deferred("weights_unknown", want_version=self.published)
        room = pol.room(self.version, msg.version, len(self.buffer) + self.book.outstanding_prompts())
        n = min(msg.max_prompts, pol.prompts_per_lease, room)
        if n <= 0:
            return self._deferred("paced", retry_after_s=0.05)
        prompts = self.buffer.next_prompts(self.task, n)
        timeout_s = pol.lease_seconds(n, peer.rollouts_per_s, float(peer.capability.tokens_per_s))
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
        try:
            groups = self._convert(msg, rec)
        except ProtocolError:
            self._settle_refused(rec, msg.nonce, "invalid")
            self.counters["rollouts_rejected_invalid"] += 1
            raise
        b = msg.behaviour_version
        if self.version - b > self.policy.staleness or b < rec.min_version:
            self._settle_refused(rec, msg.nonce, "stale")
            self.counters["submissions_rejected_stale"] += 1
            raise ProtocolError(ErrorCode.STALE_VERSION,
                                f"behaviour version {b} vs learner {self.version}, bound {self.policy.staleness}")
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
        kept = [g for g, r in zip(groups, rewards) if self.buffer.offer(g, self.version, r) == Verdict.ACCEPTED]
        accepted = len(kept)
        self.counters["submissions_accepted"] += 1
        self.counters["groups_received"] += len(groups)
        peer.leases_done += 1
        peer.groups_accepted += accepted
        peer.generate_seconds += msg.generate_seconds
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

    async def _spot_check(self, groups: list[ActorGroup], version: int, rec: LeaseRecord, nonce: bytes,
                          peer_id: str) -> None:
        """Recompute the behaviour log-probs; on a mismatch refuse, flag (and maybe ban)."""
        assert self.spot is not None
        try:
            cap = self.peers[peer_id].capability  # joined: the submit handler looked it up
            res = await self.spot.check(groups, version, cap.engine, cap.dtype)
        except Exception:  # noqa: BLE001 - a failing check must not refuse an honest node
            log.exception("spot check of v%d failed to run; counted as skipped", version)
            self.counters["spot_checks_skipped"] += 1
            return
        self.spot_check_seconds += res.seconds
        if res.skipped:
            self.counters["spot_checks_skipped"] += 1
            return
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

    def banned(self, peer_id: str) -> bool:
        return self.ban_after > 0 and self.mismatches.get(peer_id, 0) >= self.ban_after

    def _settle_refused(self, rec: LeaseRecord, nonce: bytes, how: str) -> None:
        self.book.settle(rec.lease_id, how, nonce)
        self.buffer.requeue(rec.prompts)

    def _convert(self, msg: Submit, rec: LeaseRecord) -> list[ActorGroup]:
        """Wire groups → actor groups; the learner tokenizes prompts and decodes completions
        itself (the node's text and rewards are never trusted)."""
        by_id = {p.prompt_id: p for p in rec.prompts}
        if sorted(g.prompt_id for g in msg.groups) != sorted(by_id):
            raise ProtocolError(ErrorCode.SCHEMA, "groups do not match the lease's prompts")
        stop = self.policy.sampling.stop
        episodic = is_episodic(self.task)
        limit = self.task.max_episode_tokens if episodic else self.policy.sampling.max_new_tokens
        out = []
        for g in msg.groups:
            if len(g.samples) != rec.group_size:
                raise ProtocolError(ErrorCode.SCHEMA, f"group {g.prompt_id}: {len(g.samples)} samples, lease says {rec.group_size}")
            prompt = by_id[g.prompt_id]
            samples = []
            for s in g.samples:
                if len(s.token_ids) > limit or any(t >= self.vocab_size for t in s.token_ids):
                    raise ProtocolError(ErrorCode.SCHEMA, "completion too long or token id out of vocabulary")
                if (s.model_mask is not None) != episodic:
                    raise ProtocolError(ErrorCode.SCHEMA, "an episode needs a model_mask, a completion has none")
                text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                cuts = [text.find(x) for x in stop if x in text]
                text = text[: min(cuts)] if cuts and not episodic else text
                samples.append(ActorSample(list(s.token_ids), list(s.logprobs), s.finish_reason, text,
                                           mask=None if s.model_mask is None else list(s.model_mask),
                                           reward=float(s.reward_hint) if episodic else None))
            ids = list(self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
            out.append(ActorGroup(prompt.prompt_id, prompt.text, ids, samples, msg.behaviour_version,
                                  [s.reward_hint for s in g.samples], {"generate_s": msg.generate_seconds}))
        return out

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
                   "leases_expired": self.book.expired, **self.counters,
                   "spot_check_fraction": self.spot.fraction if self.spot is not None else 0.0,
                   "spot_check_seconds": round(self.spot_check_seconds, 4),
                   "spot_check_passed_max_abs_diff": self.spot_check_passed_max_abs_diff}
        learner.update({k: v for k, v in self.learner_summary.items() if isinstance(v, (int, float, str, bool)) or v is None})
        learner.update(self.activation_metrics())
        learner.update(self.ledger.metrics(self.peers.values(), self.version, self.policy.group_size))
        peers = []
        for p in list(self.peers.values())[cursor:cursor + limit]:
            c = p.capability
            peers.append({"peer_id": p.peer_id, "device": c.device, "engine": c.engine, "version": p.version,
                          "tokens_per_s": round(c.tokens_per_s, 1), "price_per_hour": c.price_per_hour,
                          "leases": len(self.book.held_by(p.peer_id)), "leases_done": p.leases_done,
                          "groups_accepted": p.groups_accepted, "rollouts_per_s": round(p.rollouts_per_s, 3),
                          "last_seen_s": round(now - p.last_seen, 2), "alive": p.alive,
                          "logprob_mismatches": self.mismatches.get(p.peer_id, 0), "banned": self.banned(p.peer_id),
                          "standby": self.is_standby(p.peer_id), **self.ledger.peer_fields(p.peer_id)})
        return Status(run_id=self.run_id, learner=learner, peers=peers, total_peers=len(self.peers),
                      next_cursor=cursor + limit if cursor + limit < len(self.peers) else None)

    def broadcast_nodes(self, window_s: float = 60.0) -> list[Any]:
        """The joined nodes a version is broadcast to: alive and heard from recently."""
        from echorl.broadcast.broadcaster import NodeInfo

        return [NodeInfo(p.peer_id, bool(p.capability.reachable), tuple(p.capability.listen_addrs))
                for p in self.active_peers(window_s)]

    # --- cost-aware activation (DESIGN §7) ---------------------------------------------------
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
            now = time.monotonic()
            quiet = [pid for pid, p in self.peers.items()
                     if p.alive and now - p.last_seen > self.policy.liveness_after_s]
            if quiet and self.host is not None:
                async with trio.open_nursery() as nursery:
                    for pid in quiet:
                        nursery.start_soon(self._probe, pid)
            await trio.sleep(interval_s)

    async def _probe(self, peer_id: str) -> None:
        assert self.host is not None
        try:
            await self.host.ping(peer_id, timeout=self.policy.ping_timeout_s)
            self.peers[peer_id].last_seen = time.monotonic()
        except PeerUnavailable as exc:
            gone = self.book.expire_peer(peer_id)
            for rec in gone:
                self.buffer.requeue(rec.prompts)
            self.peers[peer_id].alive = False
            log.warning("peer %s unresponsive (%s): %d leases expired", short_id(peer_id), exc, len(gone))
            self._lost(peer_id)
