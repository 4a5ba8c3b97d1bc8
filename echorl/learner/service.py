"""The learner's network handlers: join, lease, submit, return and status.

``LearnerService`` wires components that each own one thing and hands them what they need
through their constructors (no component writes another's fields):

- ``peers`` (``learner/peers.py``): every per-peer fact and the one ``forget``;
- ``leases`` (``learner/leases.py``): single-use leases, nonces;
- ``admission`` (``learner/admission.py``, ``pace.py``): lease limits, deadlines, back-off, held versions;
- ``checks`` (``learner/checks.py``): every submission check, as one ordered table;
- ``police`` (``learner/policing.py``): spot checks, flags and bans;
- ``roster`` (``learner/roster.py``): per-IP join slots, broadcast plans, idle members;
- ``activator`` (``learner/activation.py``): cost-aware activation (standby nodes: ``lease_deferred``);
- ``members`` (``learner/membership.py``): one live process per key, dial-back, the run's end;
- ``ledger`` (``learner/ledger.py``): signed receipts, rejections by reason, cost;
- ``upkeep`` (``learner/upkeep.py``): the maintenance loop (lease expiry, idle members, liveness
  pings, activation).

Each component reads its section of the one settings object (``ServiceFields``) and reports its
figures through ``metrics()`` (the status reply and the metrics row); every staleness rule is the
run's ``StalenessRule``. Flags, bans, accounts and node addresses survive ``--resume``.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import trio

from echorl.actor.types import RolloutGroup as ActorGroup
from echorl.learner.activation import Activator
from echorl.learner.admission import Admission, finite_row, sample_tokens, submit_cap
from echorl.learner.checks import STALE, Submission, SubmitChecks
from echorl.learner.config import ServiceFields
from echorl.learner.leases import LeaseBook, LeaseRecord
from echorl.learner.ledger import Ledger, carries_signal, count_tokens
from echorl.learner.membership import Members
from echorl.learner.peers import ACTIVE_WINDOW_S, PeerBook, PeerRecord
from echorl.learner.policing import Police
from echorl.learner.resume import decode_service_state, encode_service_state
from echorl.learner.roster import Roster
from echorl.learner.upkeep import Upkeep
from echorl.net.host import Host, RequestContext
from echorl.protocol import limits, routes, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity, short_id
from echorl.protocol.messages import (
    JoinAccepted,
    JoinRequest,
    Lease,
    LeaseDeferred,
    LeasePrompt,
    LeaseRequest,
    LeaseReturn,
    Message,
    SamplingSpec,
    Status,
    StatusRequest,
    Submit,
    SubmitAccepted,
)
from echorl.rl.buffer import StalenessBuffer, Verdict
from echorl.rl.replay import episode_spec
from echorl.rl.staleness import StalenessRule

if TYPE_CHECKING:
    from echorl.broadcast.broadcaster import NodeInfo
    from echorl.learner.spot_check import SpotChecker
    from echorl.rl.seams import Tokenizer
    from echorl.tasks.base import Task

__all__ = ["LearnerService", "PeerRecord"]
log = logging.getLogger(__name__)

DeferReason = Literal["weights_too_old", "weights_unknown", "paced", "stopping", "standby"]
"""Why a lease request is answered ``LeaseDeferred`` (the message's ``reason``)."""
NO_WORK_RETRY_S = 0.5
"""When a node asks again after an empty prompt source (sampling requests come when clients send
them: short, so a request waits little for a node; each ask is one small stream)."""
DEFAULT_SAMPLING = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=5, stop=[])
"""What leases ask for when the caller gives no sampling spec (tests; the learner passes the loop's)."""


class LearnerService:
    """``version`` (the trainer's newest version t), ``required`` (the provisioning rule's Σμ),
    ``summary`` (the run's headline figures for status) and ``learner_rate`` (the learner's own
    generation rate, samples/s) are read from the trainer. ``holds_versions``: the trainer
    publishes no version while a lease is out (``echorl serve --swarm``'s turns), so a lease's
    deadline has no staleness horizon (the pace of versions says nothing about a lease's life)."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        task: Task,
        tokenizer: Tokenizer | None,
        buffer: StalenessBuffer,
        settings: ServiceFields,
        vocab_size: int,
        *,
        sampling: SamplingSpec = DEFAULT_SAMPLING,
        version: Callable[[], int] = lambda: 0,
        published: int = 0,
        required: Callable[[], float | None] = lambda: None,
        summary: Callable[[], dict[str, Any]] = dict,
        learner_rate: Callable[[], float] = lambda: 0.0,
        spot: SpotChecker | None = None,
        incarnation: bytes | None = None,
        peers: PeerBook | None = None,
        holds_versions: bool = False,
    ) -> None:
        self.identity, self.run_id, self.task, self.buffer = identity, run_id, task, buffer
        self.settings, self.sampling, self.holds_versions = settings, sampling, holds_versions
        self.incarnation = incarnation or secrets.token_bytes(16)  # the broadcaster's: signed into manifests
        self.rule = StalenessRule(settings.staleness, settings.prompts_per_step)
        self._version = version
        self.published = published  # newest version handed to the broadcast (and the fetch fallback)
        self.summary = summary
        self.stopping = False  # no new leases (the learner is checkpointing and exiting)
        self.accepted = trio.Event()
        self.host: Host | None = None
        self.submissions = {"submissions_accepted": 0, "groups_received": 0, "groups_over_batch_share": 0}
        # the components, one owner each
        self.peers = peers if peers is not None else PeerBook()
        self.leases = LeaseBook()
        self.admission = Admission(self.peers, settings, held_versions=self.rule.held_versions())
        self.roster = Roster(self.peers, settings)
        self.activator = Activator(self.peers, settings, required)
        self.upkeep = Upkeep(
            self.peers, self.leases, self.admission, self.roster, self.activator, buffer, settings, lambda: self.version
        )
        self.members = Members(identity, run_id)
        self.ledger = Ledger(
            identity, run_id, self.peers, price_per_hour=settings.price_per_hour, learner_rate=learner_rate
        )
        self.police = Police(
            self.peers, self.leases, self.admission, self._refuse, self.buffer, spot, settings.spot_check_ban_after
        )
        self.checks = SubmitChecks(
            run_id=run_id,
            incarnation=self.incarnation,
            version=lambda: self.version,
            published=lambda: self.published,
            rule=self.rule,
            book=self.peers,
            leases=self.leases,
            admission=self.admission,
            buffer=buffer,
            police=self.police,
            refuse=self._refuse,
            sampling=sampling,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            task=task,
        )

    @property
    def version(self) -> int:
        return self._version()

    @property
    def counters(self) -> dict[str, int]:
        """Every count of refusals and work: the checks', the police's, the admission's, the liveness
        sweep's, and the accepted submissions."""
        parts = (self.checks.metrics(), self.submissions, self.admission.metrics(), self.police.counters)
        return {k: v for part in (*parts, self.upkeep.liveness.counters) for k, v in part.items()}

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

    async def end_run(self, version: int, grace_s: float) -> None:
        """Training is over: every lease request is answered with a signed ``RunEnded`` until each
        live node has been told (at most ``grace_s``)."""
        live = lambda: [p.peer_id for p in self.peers.active(10.0)]
        await self.members.run_end.announce(version, version, live, grace_s=grace_s)

    def step_skipped(self, batch: list[ActorGroup], why: str) -> None:
        """The trainer skipped a batch: after a non-finite step its contributors are flagged."""
        self.police.step_skipped(batch, why)

    def state_dict(self) -> dict[str, Any]:
        """Flags, accounts, recent nodes' addresses and the receipt sequence (``learner/resume.py``)."""
        return {**encode_service_state(self.peers), **self.ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore flags (and bans), accounts, receipts and the addresses to re-dial."""
        saved = decode_service_state(state)
        self.peers.restore_flags(saved.mismatches, saved.addrs, saved.cheat_addrs)
        self.peers.restore_accounts(saved.accounts)
        self.ledger.load_state_dict(state)
        if saved.mismatches:
            banned = sum(self.police.banned(p) for p in saved.mismatches)
            log.info("restored spot-check flags of %d peers (%d banned)", len(saved.mismatches), banned)
        if saved.accounts:
            log.info("restored the accounts of %d nodes (%d receipts issued)", len(saved.accounts), self.ledger.seq)

    # --- wiring -------------------------------------------------------------------------------
    def install(self, host: Host) -> None:
        self.host = host
        joined = {routes.LEASE: self.admits, routes.SUBMIT: self.admits, routes.RETURN: self.admits}
        s = self.settings
        host.serve(
            {
                routes.JOIN: self.on_join,
                routes.LEASE: self.members.lease_or_end(self.on_lease, self.peers),
                routes.SUBMIT: self.ledger.counting(self.on_submit),
                routes.RETURN: self.on_return,
                routes.STATUS: self.on_status,
                routes.DIALBACK: self.members.dial_back_handler(host),
            },
            # joins, dial-backs and the run's end: learner/membership.py
            admit=joined,
            max_request_bytes={
                routes.SUBMIT: submit_cap(sample_tokens(self.task, self.sampling), s.group_size, s.prompts_per_lease)
            },
        )

    def admits(self, peer_id: str) -> bool:
        """Whether a peer's lease/submit/return bodies are read at all: only once it joined."""
        return self.peers.is_member(peer_id)

    def reads_weights(self, peer_id: str) -> bool:
        """Whether a peer may catch up and fetch chunks: a joined node, or a doctor's probe."""
        return self.peers.is_member(peer_id) or self.members.probing(peer_id)

    def _refuse(self, rec: LeaseRecord, nonce: bytes, how: str) -> None:
        """Settle a lease as refused and re-queue its prompts, if it is still open."""
        if self.leases.refuse(rec, nonce, how):
            self.buffer.requeue(rec.prompts)

    # --- handlers -----------------------------------------------------------------------------
    async def on_join(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, JoinRequest)
        if msg.run_id != self.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"run {msg.run_id!r} is not served here")
        wire.verify(msg, expected_signer=ctx.peer_id)
        if abs(msg.timestamp - time.time()) > limits.MAX_CLOCK_SKEW_S:
            raise ProtocolError(ErrorCode.REPLAY, "join timestamp outside the clock-skew window")
        self.leases.check_nonce(msg.nonce)
        self.leases.settle(f"join:{msg.nonce.hex()}", "join", msg.nonce)
        self.checks.signature_verified()
        if self.members.probe(msg, ctx.peer_id):  # `echorl doctor`: may read weights, is never counted as a node
            return self._accepted()
        ip = self.host.remote_ip(ctx.peer_id) if self.host is not None else None
        self.roster.check_join(ctx.peer_id, ip, self.leases.held_per_peer())
        cap = await self.members.admit(msg, ctx.peer_id, self.peers, self.host, self.settings)
        self.peers.join(ctx.peer_id, cap, msg.version, ip, msg.instance or b"")
        if self.host is not None:
            self.host.add_peer_addrs(ctx.peer_id, list(cap.listen_addrs))
        return self._accepted()

    def _accepted(self) -> JoinAccepted:
        return JoinAccepted(
            run_id=self.run_id,
            learner_peer_id=self.identity.peer_id,
            version=self.published,
            staleness_bound=self.rule.bound,
            heartbeat_s=self.settings.heartbeat_s,
            incarnation=self.incarnation,
        )

    async def on_lease(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, LeaseRequest)
        peer = self.peers.touch(ctx.peer_id, version=msg.version)
        self.police.check_not_banned(ctx.peer_id)
        s, rule, now = self.settings, self.rule, time.monotonic()
        self.admission.pace.note_version(self.version, now)
        if early := self.admission.asked_early(ctx.peer_id, now):
            await self._strike_if_repeated(ctx.peer_id, "early asks", self.admission.struck_for_early(ctx.peer_id))
            raise ProtocolError(ErrorCode.RATE_LIMITED, f"asked {early:.2f} s before the retry_after_s it was given")
        held = self.leases.held_per_peer()
        wait = self.admission.lease_wait(ctx.peer_id, held.get(ctx.peer_id, 0))
        if wait > 0:
            return self._wait(ctx.peer_id, "paced", min(wait, 3600.0), now)
        if self.admission.address_full(peer.ip_key, self.leases.held_at(peer.ip_key)):
            return self._wait(ctx.peer_id, "paced", 0.5, now)
        if self.stopping:
            return self._deferred("stopping", retry_after_s=1.0)
        if self.activator.is_standby(ctx.peer_id):
            return self._wait(ctx.peer_id, "standby", s.activation_interval_s, now)
        if msg.incarnation not in (None, self.incarnation):  # weights of a branch this learner abandoned
            return self._deferred("weights_unknown", want_version=self.published)
        min_version = rule.min_version(self.version, self.published)
        if msg.version < min_version:  # an unproven peer waits like a paced one: no free polls
            retry = 0.0 if self.admission.trusted(ctx.peer_id) else self.admission.retry_s(ctx.peer_id, now)
            return self._wait(ctx.peer_id, "weights_too_old", retry, now, want_version=self.published)
        if msg.version > self.published:
            return self._deferred("weights_unknown", want_version=self.published)
        if not self.admission.holds(msg.version, self.published):  # e.g. published before a resume:
            return self._deferred("weights_too_old", want_version=self.published)  # never acceptable
        room = rule.room(self.version, msg.version, len(self.buffer) + self.leases.outstanding_prompts())
        active = self.leases.active.values()
        wanted, per_lease = min(msg.max_prompts, s.prompts_per_lease), s.prompts_per_lease
        n = self.admission.lease_prompts(ctx.peer_id, wanted, room, held, active, rule.in_flight_cap, per_lease, now)
        if n <= 0:
            return self._wait(ctx.peer_id, "paced", self.admission.retry_s(ctx.peer_id, now), now)
        if (grant_wait := self.admission.grants.wait_s(now)) > 0:  # as fast as results can be checked
            return self._wait(ctx.peer_id, "paced", grant_wait, now)
        prompts = self.buffer.next_prompts(self.task, self.admission.pace.sized(ctx.peer_id, n))
        if not prompts:  # a source that can run dry (``echorl serve``'s sampling requests): ask again soon
            return self._wait(ctx.peer_id, "paced", NO_WORK_RETRY_S, now)
        timeout_s = self.admission.deadline(
            ctx.peer_id,
            n,
            s.group_size,
            self.sampling.max_new_tokens,
            s.lease_timeout_s,
            float(peer.capability.tokens_per_s),
            steps_left=None if self.holds_versions else msg.version + rule.bound + 1 - self.version,
        )
        late, seeded = self.admission.late_after(n), s.sampling_proofs
        rec = self.leases.issue(
            ctx.peer_id, prompts, s.group_size, min_version, now, timeout_s, late, seeded, address=peer.ip_key
        )
        return Lease(
            lease_id=rec.lease_id,
            run_id=self.run_id,
            prompts=[
                LeasePrompt(
                    prompt_id=p.prompt_id, text=p.text, episode=episode_spec(self.task, p), token_ids=p.token_ids
                )
                for p in prompts
            ],
            group_size=s.group_size,
            sampling=self.sampling,
            min_version=min_version,
            deadline_s=timeout_s,
            sampling_seed=rec.sampling_seed,
        )

    def _wait(
        self, peer_id: str, reason: DeferReason, retry_after_s: float, now: float, want_version: int = -1
    ) -> LeaseDeferred:
        self.admission.told_to_wait(peer_id, retry_after_s, now)  # asking before then is refused
        return self._deferred(reason, want_version, retry_after_s)

    def _deferred(self, reason: DeferReason, want_version: int = -1, retry_after_s: float = 0.0) -> LeaseDeferred:
        return LeaseDeferred(run_id=self.run_id, reason=reason, want_version=want_version, retry_after_s=retry_after_s)

    async def on_submit(self, msg: Message, ctx: RequestContext) -> Message:
        """Every check of ``learner/checks.py`` in table order, then the groups go to the buffer
        and the node gets a signed receipt for those accepted."""
        assert isinstance(msg, Submit)
        sub = Submission(msg, ctx.peer_id, body_bytes=ctx.body_bytes)
        self.admission.pace.note_version(self.version, time.monotonic())
        try:
            await self.checks.run(sub)
        except ProtocolError as exc:
            await self._count_against(exc.code, sub)
            raise
        rec, b, groups = sub.open_lease, msg.behaviour_version, sub.groups
        self.leases.settle(rec.lease_id, "result", msg.nonce)
        work_s = self.admission.on_result(ctx.peer_id, len(groups), rec.issued_at, late_after_s=rec.late_after_s)
        room = self._batch_room(ctx.peer_id)
        if len(groups) > room:  # one peer's share of a batch is bounded: the rest is re-queued, unpaid
            self.submissions["groups_over_batch_share"] += len(groups) - room
            out = self.buffer.outstanding
            self.buffer.requeue([out[g.prompt_id] for g in groups[room:] if g.prompt_id in out])
        offered = zip(groups[:room], sub.rewards)
        kept = [g for g, r in offered if self.buffer.offer(g, self.version, r) == Verdict.ACCEPTED]
        for g in kept:
            self.admission.note_contributor(g.prompt_id, ctx.peer_id)
        self.submissions["submissions_accepted"] += 1
        self.submissions["groups_received"] += len(groups)
        seconds = self.admission.generate_seconds(msg.generate_seconds, count_tokens(groups))
        self.peers.record_generation(ctx.peer_id, len(groups), seconds, b)
        self.accepted.set()
        proven = sub.spot is not None and sub.spot.replayed > 0 and sub.spot.sampled
        paid = [g for g in kept if carries_signal(g)]  # duplicates (e.g. all-EOS) teach nothing: no pay
        receipt = await self.ledger.issue(ctx.peer_id, rec.lease_id, len(groups), paid, b, self.version, proven, work_s)
        return SubmitAccepted(lease_id=rec.lease_id, accepted=len(kept), version=self.version, receipt=receipt)

    async def _count_against(self, code: ErrorCode, sub: Submission) -> None:
        """A stale result counts like an expiry; a bad signature strikes the identity off at once (no
        honest node's signature fails, and each forged one costs a maximal frame): the refusal is
        answered, every later stream of the identity is reset unread for ``ban_s``."""
        if code == ErrorCode.STALE_VERSION and sub.lease is not None:
            self.admission.on_expired(sub.peer_id)
        elif code in (ErrorCode.BAD_SIGNATURE, ErrorCode.WRONG_SIGNER) and (host := self.host) is not None:
            host.strikes.strike_off(sub.peer_id, trio.current_time())
            self._forget_struck(sub.peer_id, f"a submission refused {code.value}")

    async def _strike_if_repeated(self, peer_id: str, what: str, at_once: bool = False) -> None:
        """One refusal; past the host's strike limit, or ``at_once``, the identity is struck off and disconnected."""
        host, now = self.host, trio.current_time()
        if host is None or not (at_once or host.strikes.refuse(peer_id, now)):
            return
        if at_once:
            host.strikes.strike_off(peer_id, now)
        self._forget_struck(peer_id, f"repeated {what}")
        await host.disconnect(peer_id)

    def _forget_struck(self, peer_id: str, why: str) -> None:
        """Struck off: its leases re-queued, its membership forgotten (later bodies unread)."""
        log.warning("%s: %s: struck off", short_id(peer_id), why)
        self.upkeep.requeue(self.leases.expire_peer(peer_id))
        self.peers.forget(peer_id)

    def _batch_room(self, peer_id: str) -> int:
        return self.admission.batch_room(peer_id, self.buffer.buffered_ids, self.settings.prompts_per_step)

    async def on_return(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, LeaseReturn)
        self.peers.touch(ctx.peer_id)
        returned = self.leases.return_leases(ctx.peer_id, list(msg.lease_ids))
        self.upkeep.requeue(returned)
        return LeaseReturn(run_id=self.run_id, lease_ids=[r.lease_id for r in returned])

    async def on_status(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, StatusRequest)
        return self.status(msg.cursor or 0, min(msg.limit or limits.DEFAULT_STATUS_PAGE, limits.MAX_STATUS_PAGE))

    # --- figures ------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """The service's part of a metrics row, from each component's ``metrics()``."""
        stale = int(self.buffer.rollouts_rejected_stale) + self.checks.counters[STALE]
        return {
            **self.counters,
            **self.police.metrics(),
            **self.roster.metrics(),
            **self.leases.metrics(),
            **self.peers.metrics(),
            **self.activator.metrics(),
            **self.upkeep.liveness.lag.metrics(),
            "rollouts_rejected_stale": stale,  # refused at submission, or dropped by the buffer
            "published_version": self.published,
            **self.ledger.row(self.version, self.settings.group_size),
        }

    def status(self, cursor: int = 0, limit: int = limits.DEFAULT_STATUS_PAGE) -> Status:
        learner = {
            "peer_id": self.identity.peer_id,
            "version": self.version,
            "staleness_bound": self.rule.bound,
            "buffer": len(self.buffer),
            **self.leases.metrics(),
            **self.counters,
            **self.roster.metrics(),
            **self.police.metrics(),
            **self.upkeep.liveness.lag.metrics(),
        }
        learner["spot_check_seconds"] = round(self.police.spot_check_seconds, 4)
        learner.update({k: v for k, v in self.summary().items() if isinstance(v, (int, float, str, bool)) or v is None})
        learner.update(self.activator.metrics())
        learner.update(self.ledger.metrics(self.version, self.settings.group_size))
        page = self.peers.values()[cursor : cursor + limit]
        return Status(
            run_id=self.run_id,
            learner=finite_row(learner),
            peers=[finite_row(self._peer_row(p)) for p in page],
            total_peers=len(self.peers),
            next_cursor=cursor + limit if cursor + limit < len(self.peers) else None,
        )

    def _peer_row(self, p: PeerRecord) -> dict[str, Any]:
        return {
            **p.status_fields(time.monotonic()),
            "leases": len(self.leases.held_by(p.peer_id)),
            "logprob_mismatches": self.peers.mismatches.get(p.peer_id, 0),
            "banned": self.police.banned(p.peer_id),
            "standby": self.activator.is_standby(p.peer_id),
            **self.ledger.peer_fields(p.peer_id),
        }

    def active_peers(self, window_s: float = ACTIVE_WINDOW_S) -> list[PeerRecord]:
        return self.peers.active(window_s)

    def broadcast_nodes(self, window_s: float = 60.0) -> list[NodeInfo]:
        """The joined nodes a version is broadcast to (``Roster.broadcast_nodes``)."""
        return self.roster.broadcast_nodes(self.peers.active(window_s))

    # --- maintenance (learner/upkeep.py) -------------------------------------------------------
    async def maintain(self, interval_s: float = 0.5) -> None:
        """Forever: lease expiry, idle members, liveness pings, activation (``Upkeep``)."""
        await self.upkeep.run(self.host, interval_s)
