"""What the learner admits from a volunteer beyond the wire schema: the checks that keep one
joined, correctly signing node from poisoning, starving or fooling a run (docs/threat-model.md).

* Behaviour versions: a submission may claim only a version the learner published and still
  holds (``unpublished_version`` otherwise), so its spot check can always run.
* Completions: every sample ends at its first EOS token / stop string (``bad_rollout`` if tokens
  follow), has 1..``max_new_tokens`` tokens and in-vocabulary ids.
* Numbers a node reports are floored or capped where they enter (``generate_seconds`` ≥ the time
  ``MAX_TOKENS_PER_S`` would need), so no derived rate is infinite.
* Leases: a peer holds one lease until it is proven (its last ``PROVEN_LEASES`` leases answered in
  time, lease issue → accepted result on the learner's clock), then ``max_leases_per_peer``; the peers of one
  address hold at most ``max_leases_per_ip``. Deadlines come from the fleet's pace
  (``learner/pace.py``: never the peer's own rate, never the node's declared tokens/s alone;
  before anyone is measured at most ``unmeasured_deadline_factor`` × the base timeout); a peer
  whose leases keep expiring, coming back late or stale is backed off exponentially, then
  refused (``refused``) for the rest of the run. Untrusted peers (not proven: fewer than
  ``PROVEN_LEASES`` leases in a row answered in time) hold one lease each and together at most
  the newcomer budget (``learner/newcomers.py``: half of the in-flight budget before anyone is
  proven, then a lease per four proven peers plus the leases newcomers earned by answering in
  time), shared equally by the addresses that have an unproven member asking for work.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from echorl.actor.types import RolloutGroup as ActorGroup
from echorl.actor.types import Sample as ActorSample
from echorl.learner.config import AdmissionFields
from echorl.learner.grants import GrantPace
from echorl.learner.leases import LeaseRecord
from echorl.learner.newcomers import Newcomers
from echorl.learner.pace import DEADLINE_FACTOR, LATE_FACTOR, MAX_DEADLINE_BASES, FleetPace, is_proven
from echorl.learner.peers import PeerBook, PeerLoad
from echorl.protocol import limits
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import SamplingSpec, Submit

if TYPE_CHECKING:
    from echorl.rl.seams import Tokenizer
    from echorl.tasks.base import Task

PROVEN_RETRY_S = 0.05
"""``retry_after_s`` of a ``paced`` deferral to a proven peer: it is kept room and should take it
soon after it frees."""
EARLY_SLACK_S = 0.02
"""A lease request this much before the ``retry_after_s`` the peer was given is early: an honest
node sleeps the whole of it after the reply arrives, so its next request comes later still."""
EARLY_ASKS_STRUCK = 3
"""Early lease requests within ``EARLY_WINDOW_S`` that strike the identity off at the last of
them: a node's one lease loop sleeps each ``retry_after_s`` from when the reply reached it, so it
is never early, while identities polling every second through retries of up to 5 s (issue 24,
``sybil_flood``: ~230 early asks per 30 s window) stayed under the host's generic limit (32
refusals in 10 s) for ever."""
EARLY_WINDOW_S = 60.0
"""The window ``EARLY_ASKS_STRUCK`` counts in: a peer that polls on its own clock is early now
and then, so a count in a row would miss it."""


class Admission:
    """Per-run admission state: published versions still held, contributors of buffered groups;
    the peers' lease loads are the peer book's (``learner/peers.py``), the tunables the
    :class:`AdmissionFields` section of the learner's config."""

    CONTRIBUTORS_KEPT = 100_000

    def __init__(
        self, book: PeerBook | None = None, policy: AdmissionFields | None = None, held_versions: int = 8
    ) -> None:
        self.book = book if book is not None else PeerBook()
        self.policy = policy if policy is not None else AdmissionFields()
        self.held: deque[int] = deque(maxlen=max(2, held_versions))
        self.weights_bytes = 0  # the newest full snapshot's size
        self.contributors: OrderedDict[str, str] = OrderedDict()  # prompt id -> peer id of its buffered group
        self.leases_refused = 0
        self.leases_late = 0  # results that came back later than the fleet's pace allows
        self.pace = FleetPace(self.book)
        self.newcomers = Newcomers(self.book, self.pace)  # the unproven peers' share (newcomers.py)
        self.grants = GrantPace()  # no faster than the loop checks the results (grants.py)

    def metrics(self) -> dict[str, int]:
        counts = {"leases_refused": self.leases_refused, "leases_late": self.leases_late}
        return counts | self.newcomers.counters | self.grants.metrics()

    # --- versions -------------------------------------------------------------------------------
    def note_published(self, version: int, weights_bytes: int = 0) -> None:
        if weights_bytes > 0:
            self.weights_bytes = weights_bytes
        if version not in self.held:
            self.held.append(version)

    def holds(self, version: int, published: int) -> bool:
        """Whether rollouts made with ``version`` can be accepted (and spot-checked)."""
        return version == published or version in self.held

    def check_version(self, version: int, published: int) -> None:
        """Refuse a behaviour version the learner did not publish (or no longer holds)."""
        if not self.holds(version, published):
            raise ProtocolError(
                ErrorCode.UNPUBLISHED_VERSION,
                f"behaviour version {version} was not published or is no longer held "
                f"(held: {sorted(set(self.held) | {published})})",
            )

    # --- completions ----------------------------------------------------------------------------
    @staticmethod
    def check_completion(
        token_ids: list[int],
        *,
        max_new_tokens: int,
        vocab_size: int,
        eos_ids: set[int],
        stop: list[str],
        tokenizer: Tokenizer | None,
    ) -> None:
        """A completion an honest actor could have produced: 1..max_new_tokens in-vocabulary ids,
        no EOS before the last token, no stop string in the text before the last token."""
        if not 1 <= len(token_ids) <= max_new_tokens:
            raise ProtocolError(
                ErrorCode.SCHEMA, f"completion has {len(token_ids)} tokens, lease allows 1..{max_new_tokens}"
            )
        if any(t >= vocab_size for t in token_ids):
            raise ProtocolError(ErrorCode.SCHEMA, "token id out of vocabulary")
        if eos_ids and any(t in eos_ids for t in token_ids[:-1]):
            raise ProtocolError(ErrorCode.BAD_ROLLOUT, "tokens after EOS")
        if stop and len(token_ids) > 1 and tokenizer is not None:
            head = tokenizer.decode(token_ids[:-1], skip_special_tokens=True)
            if any(s and s in head for s in stop):
                raise ProtocolError(ErrorCode.BAD_ROLLOUT, "tokens after a stop string")

    @staticmethod
    def generate_seconds(claimed: float, tokens: int) -> float:
        """The node's generation time, floored at what ``MAX_TOKENS_PER_S`` would need (and 1 ms)."""
        return max(float(claimed), tokens / limits.MAX_TOKENS_PER_S, 1e-3)

    # --- leases ---------------------------------------------------------------------------------
    def load(self, peer_id: str) -> PeerLoad:
        return self.book.load(peer_id)

    def refused(self, peer_id: str) -> bool:
        n = self.policy.refuse_after_expiries
        return n > 0 and self.load(peer_id).expiries_in_row >= n

    def lease_wait(self, peer_id: str, held: int, now: float | None = None) -> float:
        """Seconds the peer must wait before another lease (0: may have one now); raises
        ``refused`` for a peer whose leases expired ``refuse_after_expiries`` times in a row."""
        now = time.monotonic() if now is None else now
        load = self.load(peer_id)
        if self.refused(peer_id):
            self.leases_refused += 1
            raise ProtocolError(ErrorCode.REFUSED, f"{load.expiries_in_row} leases in a row expired unanswered")
        if now < load.backoff_until:
            return load.backoff_until - now
        cap = self.policy.max_leases_per_peer if self.trusted(peer_id) else 1
        return 0.0 if held < max(1, cap) else 0.5

    def lease_prompts(
        self,
        peer_id: str,
        wanted: int,
        room: int,
        held: Mapping[str, int],
        active: Collection[LeaseRecord],
        in_flight_cap: int,
        per_lease: int,
        now: float,
    ) -> int:
        """Prompts ``peer_id`` may be leased now (≤ 0: none): at most ``wanted``, within the
        in-flight budget's ``room`` less what the fleet's pace keeps for others
        (``FleetPace.reserved``), and for an unproven peer within its share of the newcomer budget
        (``Newcomers.room``). ``held``: open leases by holder; ``active``: the lease records;
        ``per_lease``: the run's prompts per lease."""
        max_leases = self.policy.max_leases_per_peer
        room -= self.pace.reserved(peer_id, per_lease, now, held, max_leases, self.newcomers.asking_now(now))
        n = min(wanted, room)
        if not self.trusted(peer_id):
            n = min(n, self.newcomers.room(peer_id, in_flight_cap, per_lease, active, now))
            if n > 0:
                self.newcomers.grant(peer_id, n, now)
        return n

    def retry_s(self, peer_id: str, now: float) -> float:
        """``retry_after_s`` for a deferred peer: short for a proven one; for an unproven one the
        newcomers' shared clock (``Newcomers.retry_s``)."""
        return PROVEN_RETRY_S if self.trusted(peer_id) else self.newcomers.retry_s(now)

    def told_to_wait(self, peer_id: str, retry_after_s: float, now: float) -> None:
        """The peer was told not to ask for a lease for ``retry_after_s``."""
        self.load(peer_id).not_before = now + retry_after_s

    def asked_early(self, peer_id: str, now: float) -> float:
        """Seconds early this lease request came, by the last ``retry_after_s`` the peer was
        given (0: not early); counts the early ones (``struck_for_early``)."""
        load = self.book.loads.get(peer_id)
        early = 0.0 if load is None else load.not_before - now
        if load is None or early <= EARLY_SLACK_S:
            return 0.0
        if now - load.early_since > EARLY_WINDOW_S:
            load.early_since, load.early_asks = now, 0
        load.early_asks += 1
        return early

    def struck_for_early(self, peer_id: str) -> bool:
        """Whether the peer asked early ``EARLY_ASKS_STRUCK`` times within ``EARLY_WINDOW_S``."""
        load = self.book.loads.get(peer_id)
        return load is not None and load.early_asks >= EARLY_ASKS_STRUCK

    def measured(self, peer_id: str) -> bool:
        return self.load(peer_id).groups_per_s > 0

    def trusted(self, peer_id: str) -> bool:
        """Proven: its last ``PROVEN_LEASES`` leases were answered in time (it may hold
        ``max_leases_per_peer``; a fast opening answer alone proves nothing)."""
        return is_proven(self.load(peer_id))

    def address_full(self, ip_key: str, held_there: int) -> bool:
        """Whether the members whose joins came from ``ip_key`` hold ``max_leases_per_ip`` leases
        (``held_there``: their open leases, ``LeaseBook.held_at``; "": an unknown address is not
        counted)."""
        cap = self.policy.max_leases_per_ip
        return cap > 0 and bool(ip_key) and held_there >= cap

    def deadline(
        self,
        peer_id: str,
        n_prompts: int,
        group_size: int,
        max_new_tokens: int,
        base_s: float,
        declared_tokens_per_s: float,
        steps_left: int | None = None,
    ) -> float:
        """A lease's deadline (``learner/pace.py``): 4× what the fleet takes for ``n_prompts``, at
        least ``lease_min_s``, at most 20× ``base_s`` and the staleness horizon (``steps_left``
        steps at the learner's pace); before anyone is measured, 4× the time at the declared
        tokens/s, at least ``base_s`` and at most ``unmeasured_deadline_factor`` × ``base_s``. Plus
        the time to load one version at ``apply_bytes_per_s``, since a version published while the
        node works is loaded into its engine before the lease's next sample (0.02 s for the 2 MB
        default model, 10 min for 60 GB: a measured generation rate says nothing about that)."""
        apply_s = self.weights_bytes / self.policy.apply_bytes_per_s
        horizon = self.pace.horizon_s(steps_left)
        expected = self.pace.expected_s(n_prompts)
        if expected > 0:
            bound = min(DEADLINE_FACTOR * expected, MAX_DEADLINE_BASES * base_s, horizon)
            return max(bound, self.policy.lease_min_s) + apply_s
        declared = n_prompts * group_size * max_new_tokens / max(declared_tokens_per_s, 1e-3)
        bound = min(max(base_s, DEADLINE_FACTOR * declared), self.policy.unmeasured_deadline_factor * base_s)
        return max(min(bound, horizon), self.policy.lease_min_s) + apply_s

    def late_after(self, n_prompts: int) -> float:
        """Seconds after issue past which a result counts against the peer (0: never; the
        fleet is not measured yet): ``LATE_FACTOR`` × the fleet's time, at least half of
        ``lease_min_s``, plus one version's load time."""
        expected = self.pace.expected_s(n_prompts)
        if expected <= 0:
            return 0.0
        apply_s = self.weights_bytes / self.policy.apply_bytes_per_s
        return max(LATE_FACTOR * expected, self.policy.lease_min_s / 2) + apply_s

    def on_result(
        self, peer_id: str, groups: int, issued_at: float, now: float | None = None, late_after_s: float = 0.0
    ) -> float:
        """An accepted result of a lease of ``groups`` prompts issued at ``issued_at``: measured;
        if it came back more than ``late_after_s`` after issue (0: never late) it counts against
        the peer like an expiry (``leases_late``). Returns the seconds of work to bill: the time
        it took, at most what the fleet takes for such a lease (``pace.expected_s``), so a slow
        answer is never billed more than a fast one."""
        now = time.monotonic() if now is None else now
        self.grants.note_submission()
        load, seconds, pol = self.load(peer_id), max(1e-3, now - issued_at), self.policy
        fair, in_row = self.pace.expected_s(groups), load.on_time_in_row
        if 0 < late_after_s < seconds:
            self.leases_late += 1
            self.newcomers.walked()
            load.late(groups, seconds, now, pol.expiry_backoff_s, pol.expiry_backoff_max_s)
        else:
            if not is_proven(load):
                self.newcomers.answered(in_row, now)
            load.answered(groups, seconds)
            load.worked_at = now
        self.pace.changed()
        return min(seconds, fair) if fair > 0 else seconds

    def on_expired(self, peer_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        pol, load = self.policy, self.load(peer_id)
        self.newcomers.walked()
        load.expired(now, pol.expiry_backoff_s, pol.expiry_backoff_max_s)
        self.pace.changed()

    # --- contributors ---------------------------------------------------------------------------
    def note_contributor(self, prompt_id: str, peer_id: str) -> None:
        self.contributors[prompt_id] = peer_id
        self.contributors.move_to_end(prompt_id)
        while len(self.contributors) > self.CONTRIBUTORS_KEPT:
            self.contributors.popitem(last=False)

    def batch_room(self, peer_id: str, buffered: list[str] | Callable[[], list[str]], batch: int) -> int:
        """Groups ``peer_id`` may still add to the buffer (``buffered``: its prompt ids, the
        groups waiting for batches, or what lists them: read only when the share is on, since a
        scan per submission is O(B)). While others have groups buffered, one peer's, and one
        address's (``PeerBook.address_of``: IPv4 address, IPv6 /64, so many identities of one
        host get one share between them), stay within ``max_batch_share`` of the buffer (at least
        that share of one ``batch``, rounded up); with none buffered by others there is no bound:
        a lone contributor crowds out nobody, and idle identities (nothing buffered) cannot stall it."""
        share = self.policy.max_batch_share
        if share >= 1.0:  # off (the default): no scan of the buffer per submission, O(B) each
            return limits.MAX_PROMPTS_PER_LEASE  # never binding: no submission has more groups
        ids = buffered() if callable(buffered) else buffered
        owners = [self.contributors.get(pid) for pid in ids]
        mine, address_of = self.book.address_of(peer_id), self.book.address_of
        by_peer = sum(1 for o in owners if o == peer_id)
        by_address = sum(1 for o in owners if o is not None and address_of(o) == mine)
        return min(_share_room(share, by_peer, len(ids), batch), _share_room(share, by_address, len(ids), batch))

    def buffered_by(self, peer_id: str, buffered: list[str]) -> list[str]:
        """The prompt ids among ``buffered`` whose group ``peer_id`` contributed."""
        return [pid for pid in buffered if self.contributors.get(pid) == peer_id]

    def contributors_of(self, prompt_ids: list[str]) -> set[str]:
        return {self.contributors.pop(p) for p in prompt_ids if p in self.contributors}


def _share_room(share: float, held: int, total: int, batch: int) -> int:
    """Groups one holder of ``held`` of the ``total`` buffered may add within ``share`` (see
    ``Admission.batch_room``; unbounded while no one else holds any)."""
    others = total - held
    if others == 0:
        return limits.MAX_PROMPTS_PER_LEASE
    # held ≤ share · (held + others)  ⇔  held ≤ share / (1 − share) · others
    limit = max(math.ceil(share * batch), math.floor(share / (1.0 - share) * others))
    return max(0, limit - held)


def convert_submission(
    msg: Submit,
    rec: LeaseRecord,
    sampling: SamplingSpec,
    tokenizer: Tokenizer,
    vocab_size: int,
    admission: Admission,
    task: Task | None = None,
) -> list[ActorGroup]:
    """Wire groups → actor groups for lease ``rec``; every completion checked
    (:meth:`Admission.check_completion`; an episode's turn boundaries are checked by its replay
    instead). The learner tokenizes prompts and decodes completions itself (the node's text and
    rewards are never trusted). Runs in a worker thread."""
    from echorl.tasks.env import is_episodic

    by_id = {p.prompt_id: p for p in rec.prompts}
    if sorted(g.prompt_id for g in msg.groups) != sorted(by_id):
        raise ProtocolError(ErrorCode.SCHEMA, "groups do not match the lease's prompts")
    stop = list(sampling.stop)
    episodic = task is not None and is_episodic(task)
    limit = sample_tokens(task, sampling)
    eos = getattr(tokenizer, "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    out = []
    for g in msg.groups:
        if len(g.samples) != rec.group_size:
            raise ProtocolError(
                ErrorCode.SCHEMA, f"group {g.prompt_id}: {len(g.samples)} samples, lease says {rec.group_size}"
            )
        prompt = by_id[g.prompt_id]
        samples = []
        for s in g.samples:
            if (s.model_mask is not None) != episodic:
                raise ProtocolError(ErrorCode.SCHEMA, "an episode needs a model_mask, a completion has none")
            admission.check_completion(
                list(s.token_ids),
                max_new_tokens=limit,
                vocab_size=vocab_size,
                eos_ids=set() if episodic else eos_ids,
                stop=[] if episodic else stop,
                tokenizer=tokenizer,
            )
            text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
            cuts = [text.find(x) for x in stop if x in text]
            text = text[: min(cuts)] if cuts and not episodic else text
            samples.append(
                ActorSample(
                    list(s.token_ids),
                    list(s.logprobs),
                    s.finish_reason,
                    text,
                    mask=None if s.model_mask is None else list(s.model_mask),
                    reward=float(s.reward_hint) if episodic else None,
                )
            )
        ids = prompt.token_ids or list(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
        out.append(
            ActorGroup(
                prompt.prompt_id,
                prompt.text,
                ids,
                samples,
                msg.behaviour_version,
                [s.reward_hint for s in g.samples],
                {"generate_s": msg.generate_seconds},
            )
        )
    return out


def sample_tokens(task: Task | None, sampling: SamplingSpec) -> int:
    """Most tokens one sample may carry: a completion's ``max_new_tokens``, an episode's whole
    transcript (``max_episode_tokens``, many turns of ``max_new_tokens``). The completion check
    and the submit cap both read it, so an honest episode is never refused ``oversized``."""
    from echorl.tasks.env import is_episodic

    if task is not None and is_episodic(task):
        return int(getattr(task, "max_episode_tokens", 0))
    return sampling.max_new_tokens


def submit_cap(max_new_tokens: int, group_size: int, prompts_per_lease: int) -> int:
    """Largest Submit body a lease can need (msgpack: ≤ 9 B per token id and per log-prob, plus
    per-sample and per-group overhead); the SUBMIT route's frame cap, so a bigger frame is
    refused before it is read."""
    per_sample = 128 + 18 * max_new_tokens
    per_group = 1024 + group_size * per_sample
    return min(limits.MAX_FRAME_BYTES, 4 * limits.KiB + prompts_per_lease * per_group)


def finite_row(row: dict[str, Any]) -> dict[str, Any]:
    """A status row with every non-finite float as None: no value can make status unanswerable."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
