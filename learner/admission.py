"""What the learner admits from a volunteer beyond the wire schema: the checks that keep one
joined, correctly signing node from poisoning, starving or fooling a run (docs/threat-model.md).

* Behaviour versions: a submission may claim only a version the learner published and still
  holds (``unpublished_version`` otherwise), so its spot check can always run.
* Completions: every sample ends at its first EOS token / stop string (``bad_rollout`` if tokens
  follow), has 1..``max_new_tokens`` tokens and in-vocabulary ids.
* Numbers a node reports are floored or capped where they enter (``generate_seconds`` ≥ the time
  ``MAX_TOKENS_PER_S`` would need), so no derived rate is infinite.
* Leases: a peer holds one lease until the learner has measured its throughput itself (lease issue
  → accepted result, on the learner's clock), then ``max_leases_per_peer``; deadlines come from
  that measurement, never from the node's declared tokens/s alone (unmeasured: at most
  ``unmeasured_deadline_factor`` × the base timeout); a peer whose leases keep expiring is backed
  off exponentially, then refused (``refused``) for the rest of the run. Unmeasured peers
  together hold at most half of the in-flight budget (at least one lease).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from echorl.actor.types import RolloutGroup as ActorGroup
from echorl.actor.types import Sample as ActorSample
from echorl.protocol import limits
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import SamplingSpec, Submit


@dataclass
class AdmissionPolicy:
    max_leases_per_peer: int = 2  # outstanding leases of a peer whose throughput was measured
    unmeasured_deadline_factor: float = 4.0  # unmeasured peer: deadline ≤ this × lease_timeout_s
    expiry_backoff_s: float = 2.0  # after the k-th expiry in a row: wait this × 2^(k-1) ...
    expiry_backoff_max_s: float = 120.0  # ... at most this long
    refuse_after_expiries: int = 6  # expiries in a row after which the peer is refused (0: never)
    apply_bytes_per_s: float = 100e6  # slowest weight load a lease waits for (bytes/s): see ``deadline``


@dataclass
class PeerLoad:
    """The learner's own view of one peer's lease history."""

    measured_groups: int = 0
    measured_seconds: float = 0.0
    expiries_in_row: int = 0
    backoff_until: float = 0.0

    @property
    def groups_per_s(self) -> float:
        """Groups per second from lease issue to accepted result (0: not measured yet)."""
        return self.measured_groups / self.measured_seconds if self.measured_seconds > 0 else 0.0


class Admission:
    """Per-run admission state: published versions still held, per-peer lease load, contributors."""

    CONTRIBUTORS_KEPT = 100_000

    def __init__(self, policy: AdmissionPolicy | None = None, held_versions: int = 8) -> None:
        self.policy = policy or AdmissionPolicy()
        self.held: deque[int] = deque(maxlen=max(2, held_versions))
        self.weights_bytes = 0  # the newest full snapshot's size
        self.loads: dict[str, PeerLoad] = {}
        self.contributors: OrderedDict[str, str] = OrderedDict()  # prompt id -> peer id of its buffered group

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
            raise ProtocolError(ErrorCode.UNPUBLISHED_VERSION,
                                f"behaviour version {version} was not published or is no longer held "
                                f"(held: {sorted(set(self.held) | {published})})")

    # --- completions ----------------------------------------------------------------------------
    @staticmethod
    def check_completion(token_ids: list[int], *, max_new_tokens: int, vocab_size: int, eos_ids: set[int],
                         stop: list[str], tokenizer: Any) -> None:
        """A completion an honest actor could have produced: 1..max_new_tokens in-vocabulary ids,
        no EOS before the last token, no stop string in the text before the last token."""
        if not 1 <= len(token_ids) <= max_new_tokens:
            raise ProtocolError(ErrorCode.SCHEMA, f"completion has {len(token_ids)} tokens, lease allows 1..{max_new_tokens}")
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
        rec = self.loads.get(peer_id)
        if rec is None:
            rec = self.loads[peer_id] = PeerLoad()
        return rec

    def refused(self, peer_id: str) -> bool:
        n = self.policy.refuse_after_expiries
        return n > 0 and self.load(peer_id).expiries_in_row >= n

    def lease_wait(self, peer_id: str, held: int, now: float | None = None) -> float:
        """Seconds the peer must wait before another lease (0: may have one now); raises
        ``refused`` for a peer whose leases expired ``refuse_after_expiries`` times in a row."""
        now = time.monotonic() if now is None else now
        load = self.load(peer_id)
        if self.refused(peer_id):
            raise ProtocolError(ErrorCode.REFUSED, f"{load.expiries_in_row} leases in a row expired unanswered")
        if now < load.backoff_until:
            return load.backoff_until - now
        cap = self.policy.max_leases_per_peer if load.groups_per_s > 0 else 1
        return 0.0 if held < max(1, cap) else 0.5

    def unmeasured_room(self, in_flight_cap: int, prompts_per_lease: int, active: Any) -> int:
        """Prompts one more unmeasured peer may be leased: unmeasured peers together hold at most
        half of the in-flight budget (at least one lease), so identities that take a lease and
        never answer cannot starve the measured, working nodes. ``active``: the lease records."""
        held = sum(len(r.prompts) for r in active if self.load(r.peer_id).groups_per_s <= 0)
        return max(prompts_per_lease, in_flight_cap // 2) - held

    def measured(self, peer_id: str) -> bool:
        return self.load(peer_id).groups_per_s > 0

    def deadline(self, peer_id: str, n_prompts: int, group_size: int, max_new_tokens: int,
                 base_s: float, declared_tokens_per_s: float) -> float:
        """A lease's deadline: 4× the expected time, at least ``base_s``; expected from the
        learner-measured rate (at most 20× ``base_s``), else from the declared tokens/s but at
        most ``unmeasured_deadline_factor`` × ``base_s``; plus the time to load one version at
        ``apply_bytes_per_s``, since a version published while the node works is loaded into its
        engine before the lease's next sample (0.02 s for the 2 MB default model, 10 min for
        60 GB: a measured generation rate says nothing about that)."""
        apply_s = self.weights_bytes / self.policy.apply_bytes_per_s
        rate = self.load(peer_id).groups_per_s
        if rate > 0:
            return min(max(base_s, 4.0 * n_prompts / rate), 20.0 * base_s) + apply_s
        expected = n_prompts * group_size * max_new_tokens / max(declared_tokens_per_s, 1e-3)
        return min(max(base_s, 4.0 * expected), self.policy.unmeasured_deadline_factor * base_s) + apply_s

    def on_result(self, peer_id: str, groups: int, issued_at: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        load = self.load(peer_id)
        load.measured_groups += groups
        load.measured_seconds += max(1e-3, now - issued_at)
        load.expiries_in_row = 0
        load.backoff_until = 0.0

    def on_expired(self, peer_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        load = self.load(peer_id)
        load.expiries_in_row += 1
        pol = self.policy
        wait = min(pol.expiry_backoff_s * 2 ** (load.expiries_in_row - 1), pol.expiry_backoff_max_s)
        load.backoff_until = max(load.backoff_until, now + wait)

    # --- contributors ---------------------------------------------------------------------------
    def note_contributor(self, prompt_id: str, peer_id: str) -> None:
        self.contributors[prompt_id] = peer_id
        self.contributors.move_to_end(prompt_id)
        while len(self.contributors) > self.CONTRIBUTORS_KEPT:
            self.contributors.popitem(last=False)

    def contributors_of(self, prompt_ids: list[str]) -> set[str]:
        return {self.contributors.pop(p) for p in prompt_ids if p in self.contributors}


def convert_submission(msg: Submit, rec: Any, sampling: SamplingSpec, tokenizer: Any, vocab_size: int,
                       admission: Admission, task: Any = None) -> list[ActorGroup]:
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
    limit = task.max_episode_tokens if episodic else sampling.max_new_tokens
    eos = getattr(tokenizer, "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    out = []
    for g in msg.groups:
        if len(g.samples) != rec.group_size:
            raise ProtocolError(ErrorCode.SCHEMA, f"group {g.prompt_id}: {len(g.samples)} samples, lease says {rec.group_size}")
        prompt = by_id[g.prompt_id]
        samples = []
        for s in g.samples:
            if (s.model_mask is not None) != episodic:
                raise ProtocolError(ErrorCode.SCHEMA, "an episode needs a model_mask, a completion has none")
            admission.check_completion(list(s.token_ids), max_new_tokens=limit, vocab_size=vocab_size,
                                       eos_ids=set() if episodic else eos_ids, stop=[] if episodic else stop,
                                       tokenizer=tokenizer)
            text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
            cuts = [text.find(x) for x in stop if x in text]
            text = text[: min(cuts)] if cuts and not episodic else text
            samples.append(ActorSample(list(s.token_ids), list(s.logprobs), s.finish_reason, text,
                                       mask=None if s.model_mask is None else list(s.model_mask),
                                       reward=float(s.reward_hint) if episodic else None))
        ids = list(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
        out.append(ActorGroup(prompt.prompt_id, prompt.text, ids, samples, msg.behaviour_version,
                              [s.reward_hint for s in g.samples], {"generate_s": msg.generate_seconds}))
    return out


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
