"""Every check a submission passes, as one ordered table (:data:`CHECKS`).

A SUBMIT is checked row by row; the first row that refuses answers the node with its
``ErrorCode``, counts the refusal under the row's counter for that code, and, for a row that
settles, settles the lease as refused and re-queues its prompts (if it is still open: a check
that ran in a worker thread may find it expired meanwhile). A refusal changes nothing else;
rows 10 and 11 also count against the peer (``learner/policing.py``: flagged, then banned).
Adding a check is one row and one method of :class:`SubmitChecks`; the counters come from the
table. docs/protocol.md ("The learner checks a Submit in this order") lists the same rows in the
same order with the same codes (``tests/learner/test_checks.py`` keeps it so).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import trio

from echorl.actor.types import RolloutGroup as ActorGroup
from echorl.learner.admission import Admission, convert_submission
from echorl.learner.leases import LeaseBook, LeaseRecord
from echorl.learner.peers import PeerBook
from echorl.learner.policing import Police, Refuse
from echorl.learner.spot_check import SeedProof, SpotResult
from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import SamplingSpec, Submit
from echorl.rl.buffer import StalenessBuffer
from echorl.rl.replay import REPLAY_CPU_BUDGET_S, ReplayBudget, ReplayMismatch, ReplayOverBudget
from echorl.rl.staleness import StalenessRule

if TYPE_CHECKING:
    from echorl.rl.seams import Tokenizer
    from echorl.tasks.base import Task

CHECK_THREADS = 2
"""Worker threads the checks of all submissions share (signature, conversion, reward replay). They
are Python under the GIL, so more threads check no faster, but each one takes the GIL from the trio
loop for a switch interval (5 ms) at a time: at 1,000 peers a burst of submissions ran in up to
trio's default 40 threads, the loop woke 0.1-0.3 s late, and leases, whose handling takes several
loop rounds, waited seconds (``bench/swarm.py``, issue 27)."""

T = TypeVar("T")

INLINE_CHECK_BYTES = 8 * 1024
"""A submission whose request body is at most this size has its signature verified and its
completions converted on the trio loop, not in a worker thread: both take well under a millisecond
there (a 1.9 KB body: 0.23 ms to verify), less than a hand-off to a thread costs the loop, which
waits for the GIL while the thread runs and wakes for its result (at 1,000 peers with ~650-byte
bodies, the loop spent 11 % of its samples releasing a worker, and a burst queued seconds at
``CHECK_THREADS``; ``bench/swarm.py``, issue 27). A larger body (4 prompts × 8 samples × 256
tokens: 84 KB, 3.3 ms to verify) goes to the threads, as does every reward (a task's verifier may
cost anything). ``net/serving.py`` decodes bodies up to 64 KiB on the loop by the same reasoning."""

CHECK_TURNS = 4
"""Submissions whose rows up to the spot check (``TURN_ROWS``) run at once; the others wait their
turn, first come first served. trio runs every ready task in each round of its loop, so a burst of
submissions checked at once makes every round long, and a lease request, which takes several
rounds, waits for all of them; in turns a round holds at most this many submissions' checks and
leases pass between them. The spot check and the reward, which may take long, run outside the turn."""

log = logging.getLogger(__name__)

INVALID = "rollouts_rejected_invalid"
REPLAYED = "submissions_rejected_replay"
UNKNOWN = "submissions_rejected_unknown_lease"
STALE = "submissions_rejected_stale"


@dataclass
class Submission:
    """One submission as the checks fill it in: the lease it answers, its groups, their rewards."""

    msg: Submit
    peer_id: str
    lease: LeaseRecord | None = None
    groups: list[ActorGroup] = field(default_factory=list)
    rewards: list[list[float] | None] = field(default_factory=list)
    spot: SpotResult | None = None  # the spot check's result, when one ran
    claimed: bool = False  # this submission holds the lease's check (LeaseBook.claim)
    body_bytes: int | None = None  # its request's encoded size (None: unknown, checked as a large one)

    @property
    def small(self) -> bool:
        """Its signature and conversion are checked on the loop (``INLINE_CHECK_BYTES``)."""
        return self.body_bytes is not None and self.body_bytes <= INLINE_CHECK_BYTES

    @property
    def open_lease(self) -> LeaseRecord:
        assert self.lease is not None, "the lease row runs first"
        return self.lease


@dataclass(frozen=True)
class Check:
    """One row: ``run`` refuses with a ``ProtocolError``; ``counters`` maps each code it refuses
    with to its counter (None: not counted; a code not listed counts under the first);
    ``settle``: a refusal settles the lease as this (``""``: as the error code; None: not)."""

    name: str
    run: Callable[[SubmitChecks, Submission], Awaitable[None]]
    counters: dict[ErrorCode, str | None]
    settle: str | None
    doc: str
    passed: str | None = None  # counted when the row passes


class SubmitChecks:
    """The components the rows read (the service's), and the counters of their refusals.
    ``replay_budget_s`` / ``replay_clock``: the CPU budget of one submission's episode replay and
    the clock it is measured on (``rl/replay.py``: ``ReplayBudget``)."""

    replay_budget_s: float = REPLAY_CPU_BUDGET_S
    replay_clock: Callable[[], float] = staticmethod(time.thread_time)

    def __init__(
        self,
        *,
        run_id: str,
        incarnation: bytes,
        version: Callable[[], int],
        published: Callable[[], int],
        rule: StalenessRule,
        book: PeerBook,
        leases: LeaseBook,
        admission: Admission,
        buffer: StalenessBuffer,
        police: Police,
        refuse: Refuse,
        sampling: SamplingSpec,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        task: Task,
    ) -> None:
        self.run_id, self.incarnation = run_id, incarnation
        self.version, self.published, self.rule = version, published, rule
        self.book, self.leases, self.admission, self.buffer = book, leases, admission, buffer
        self.police, self.refuse = police, refuse
        self.sampling, self.tokenizer, self.vocab_size, self.task = sampling, tokenizer, vocab_size, task
        self.counters = {"signatures_verified": 0} | {c: 0 for row in CHECKS for c in row.counters.values() if c}
        self.threads = trio.CapacityLimiter(CHECK_THREADS)  # every check's worker thread (CHECK_THREADS)
        self.turns = trio.CapacityLimiter(CHECK_TURNS)  # submissions in the rows before the spot check

    def metrics(self) -> dict[str, int]:
        return dict(self.counters)

    def signature_verified(self) -> None:
        """A signed request (a join) verified outside this table."""
        self.counters["signatures_verified"] += 1

    async def run(self, sub: Submission) -> None:
        """Every row in order; the first refusal is counted, settles the lease if the row says
        so, and is raised."""
        try:
            async with self.turns:
                await self._rows(sub, CHECKS[:TURN_ROWS])
            await self._rows(sub, CHECKS[TURN_ROWS:])
        finally:
            if sub.claimed:
                self.leases.release(sub.msg.lease_id)

    async def _rows(self, sub: Submission, rows: tuple[Check, ...]) -> None:
        for row in rows:
            try:
                await row.run(self, sub)
            except ProtocolError as exc:
                counter = row.counters.get(exc.code, next(iter(row.counters.values())))
                if counter:
                    self.counters[counter] += 1
                if row.settle is not None and sub.lease is not None:
                    self.refuse(sub.lease, sub.msg.nonce, row.settle or exc.code.value)
                raise
            if row.passed:
                self.counters[row.passed] += 1

    # --- the rows, in table order -------------------------------------------------------------
    async def run_id_matches(self, sub: Submission) -> None:
        if sub.msg.run_id != self.run_id:
            raise ProtocolError(ErrorCode.SCHEMA, f"run {sub.msg.run_id!r} is not served here")

    async def _off_loop(self, sub: Submission, fn: Callable[[], T]) -> T:
        """``fn()`` on the loop for a small submission (``INLINE_CHECK_BYTES``), else in one of
        the checks' worker threads."""
        if sub.small:
            return fn()
        return await trio.to_thread.run_sync(fn, limiter=self.threads)

    async def signed_by_sender(self, sub: Submission) -> None:
        await self._off_loop(sub, lambda: wire.verify(sub.msg, sub.peer_id))

    async def nonce_unseen(self, sub: Submission) -> None:
        self.leases.check_nonce(sub.msg.nonce)

    async def lease_open(self, sub: Submission) -> None:
        sub.lease = self.leases.lookup(sub.msg.lease_id, sub.peer_id)
        self.leases.claim(sub.msg.lease_id)
        sub.claimed = True

    async def still_member(self, sub: Submission) -> None:
        self.book.touch(sub.peer_id)

    async def same_incarnation(self, sub: Submission) -> None:
        if sub.msg.incarnation not in (None, self.incarnation):
            b = sub.msg.behaviour_version
            raise ProtocolError(ErrorCode.WRONG_INCARNATION, f"v{b} is of a branch this learner abandoned")

    async def fresh(self, sub: Submission) -> None:
        b, t = sub.msg.behaviour_version, self.version()
        if not self.rule.accepts(t, b) or b < sub.open_lease.min_version:
            raise ProtocolError(
                ErrorCode.STALE_VERSION, f"behaviour version {b} vs learner {t}, bound {self.rule.bound}"
            )

    async def version_held(self, sub: Submission) -> None:
        self.admission.check_version(sub.msg.behaviour_version, self.published())

    async def groups_match(self, sub: Submission) -> None:
        lease, tokenizer = sub.open_lease, self.tokenizer
        if tokenizer is None:  # a service built without one (tests of leasing) reads no completions
            raise ProtocolError(ErrorCode.SCHEMA, "this learner reads no completions")
        sub.groups = await self._off_loop(
            sub,
            lambda: convert_submission(
                sub.msg, lease, self.sampling, tokenizer, self.vocab_size, self.admission, self.task
            ),
        )

    async def spot_check(self, sub: Submission) -> None:
        if self.police.should_check(sub.peer_id):
            sub.spot = await self.police.spot_check(
                sub.groups, sub.msg.behaviour_version, sub.open_lease, sub.msg.nonce, sub.peer_id, self._proof(sub)
            )

    async def sampled(self, sub: Submission) -> None:
        if sub.spot is not None and not sub.spot.sampled:
            raise self.police.not_sampled(sub.peer_id, sub.open_lease, sub.msg.nonce, sub.spot)

    def _proof(self, sub: Submission) -> SeedProof | None:
        lease = sub.open_lease
        if lease.sampling_seed is None:  # the learner runs without sampling proofs (--no-sampling-proofs)
            return None
        index = {p.prompt_id: k for k, p in enumerate(lease.prompts)}
        return SeedProof(lease.sampling_seed, self.sampling.top_p, index, lease.group_size)

    async def rewards(self, sub: Submission) -> None:
        budget = ReplayBudget(self.replay_budget_s, self.replay_clock)
        try:  # the verifier (episodes: the replay, within its CPU budget), off the event loop
            sub.rewards = await trio.to_thread.run_sync(self.buffer.score, sub.groups, budget, limiter=self.threads)
        except ReplayOverBudget as exc:  # the learner could not check it: not counted against the peer
            log.info("replay of a submission of %s stopped: %s", short_id(sub.peer_id), exc)
            raise ProtocolError(ErrorCode.UNVERIFIABLE, f"{exc}; lease re-queued") from None
        except ReplayMismatch as exc:
            self.police.count_against(sub.peer_id, sub.open_lease, sub.msg.nonce, ErrorCode.ENV_MISMATCH)
            log.warning("replay refused an episode of %s: %s", short_id(sub.peer_id), exc)
            raise ProtocolError(
                ErrorCode.ENV_MISMATCH, f"episode differs from the learner's replay: {exc}"[:512]
            ) from None

    async def still_open(self, sub: Submission) -> None:
        """The spot check and the verifier ran in worker threads: the lease may have been settled
        meanwhile (expired, returned, or a concurrent submission for it), so look again."""
        self.leases.check_nonce(sub.msg.nonce)
        sub.lease = self.leases.lookup(sub.msg.lease_id, sub.peer_id)


E = ErrorCode
CHECKS: tuple[Check, ...] = (
    Check("run", SubmitChecks.run_id_matches, {E.SCHEMA: INVALID}, None, "`run_id` matches (`schema`)."),
    Check(
        "signature",
        SubmitChecks.signed_by_sender,
        {E.WRONG_SIGNER: INVALID, E.BAD_SIGNATURE: INVALID, E.SCHEMA: INVALID},
        None,
        "The signature by the stream's remote peer (§5: `wrong_signer`, `schema`, `bad_signature`).",
        passed="signatures_verified",
    ),
    Check("nonce", SubmitChecks.nonce_unseen, {E.REPLAY: REPLAYED}, None, "The nonce has not been seen (`replay`)."),
    Check(
        "lease",
        SubmitChecks.lease_open,
        {E.UNKNOWN_LEASE: UNKNOWN, E.REPLAY: REPLAYED},
        None,
        "The lease is active and held by this peer (`replay` once settled by a result or while another "
        "submission for it is being checked, `unknown_lease` if expired, returned, never issued or another "
        "peer's, §6).",
    ),
    Check(
        "member",
        SubmitChecks.still_member,
        {E.NOT_FOUND: None},
        None,
        "The peer is still a member (`not_found`: dropped meanwhile; join again).",
    ),
    Check(
        "incarnation",
        SubmitChecks.same_incarnation,
        {E.WRONG_INCARNATION: STALE},
        "stale",
        "`incarnation`, if present, is this learner's (`wrong_incarnation`).",
    ),
    Check(
        "staleness",
        SubmitChecks.fresh,
        {E.STALE_VERSION: STALE},
        "stale",
        "Staleness (`stale_version`): refused if `current − behaviour_version > S` or "
        "`behaviour_version < min_version`.",
    ),
    Check(
        "published",
        SubmitChecks.version_held,
        {E.UNPUBLISHED_VERSION: "submissions_rejected_unpublished"},
        "",
        "`behaviour_version` was published by this learner and is still held (`unpublished_version`).",
    ),
    Check(
        "groups",
        SubmitChecks.groups_match,
        {E.SCHEMA: INVALID, E.BAD_ROLLOUT: "rollouts_rejected_bad"},
        "",
        "The groups match the lease (`schema`): the set of `prompt_id`s equals the lease's prompts, every "
        "group has exactly `group_size` samples, no completion is longer than `max_new_tokens`, every token "
        "id is < the vocabulary size; every completion ends at its first EOS / stop string (`bad_rollout`).",
    ),
    Check(
        "spot_check",
        SubmitChecks.spot_check,
        {E.LOGPROB_MISMATCH: "rollouts_rejected_logprob", E.UNVERIFIABLE: "submissions_rejected_unverifiable"},
        "",
        "Spot check of behaviour log-probs, for a fraction of submissions and every one of a flagged peer, "
        "of a peer from a proven cheat's address and of a newcomer's first 3 (`logprob_mismatch`; "
        "`unverifiable` if it cannot run: never accepted unchecked).",
    ),
    Check(
        "sampled",
        SubmitChecks.sampled,
        {E.NOT_SAMPLED: "submissions_rejected_not_sampled"},
        "",
        "On a spot-checked submission, the same prefill replays the lease's seeded sampling: each model "
        "token must be the Gumbel-max choice of `sampling_seed` within the calibrated tolerance "
        "(`not_sampled`; the peer's other leases are expired).",
    ),
    Check(
        "rewards",
        SubmitChecks.rewards,
        {E.ENV_MISMATCH: "rollouts_rejected_env", E.UNVERIFIABLE: "submissions_rejected_unverifiable"},
        "",
        "Rewards: a completion is scored by the task's verifier; an episode is replayed (`env_mismatch`; "
        "`unverifiable` if the replay spends its CPU budget: re-queued, not counted against the peer).",
    ),
    Check(
        "still_open",
        SubmitChecks.still_open,
        {E.UNKNOWN_LEASE: UNKNOWN, E.REPLAY: REPLAYED},
        None,
        "The lease is still open after the checks that ran in worker threads (`replay` / `unknown_lease`).",
    ),
)
TURN_ROWS = next(i for i, row in enumerate(CHECKS) if row.name == "spot_check")
"""The rows before the spot check: the ones a submission's turn covers (``CHECK_TURNS``)."""
