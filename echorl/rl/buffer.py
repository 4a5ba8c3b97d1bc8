"""Staleness-bounded rollout buffer with prompt leasing and re-queueing.

Rule: at learner step t (the current policy version), a rollout group of behaviour version b
is usable iff ``0 <= t - b <= S`` (a version newer than t is invalid; ``t − b ≤ S`` is the
run's :class:`~echorl.rl.staleness.StalenessRule`). The rule is checked when a group arrives
(:meth:`offer`) and again when it is drawn for a step (:meth:`take`), because the version may
have advanced while it waited. Once the batch size is known, :meth:`offer` also refuses a group
that its place in the queue would make stale before its batch comes (:meth:`trains_at`), so a
group accepted here is trained, and a receipt for it pays for work that trains: a drop at
:meth:`take` (``rollouts_dropped_stale``) is then left to a buffer that does not know its batch
size yet (``batch`` 0 and no batch taken). A rejected group's prompt goes back to the queue,
so hard prompts are not starved; prompts of expired leases come back through :meth:`requeue`.
One "rollout" here is one group (G samples of one prompt, all from one version).

Idempotency: a prompt is outstanding from :meth:`register` (or :meth:`next_prompts`) until its
group is accepted, rejected or re-queued; a group whose prompt is not outstanding (a duplicate
or a late result of an expired lease) is discarded and counted as ``rollouts_rejected_unknown``,
never counted twice. Not thread-safe: use it from one thread (or under a lock).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from enum import Enum
from itertools import islice
from typing import Protocol

from echorl.actor.types import RolloutGroup
from echorl.rl.checkpoint import check_state_keys
from echorl.rl.replay import ReplayBudget, ReplayMismatch
from echorl.rl.staleness import StalenessRule
from echorl.tasks.base import Prompt


class Verdict(str, Enum):
    """Outcome of :meth:`StalenessBuffer.offer` (compares equal to its string value)."""

    ACCEPTED = "accepted"
    REJECTED_STALE = "rejected_stale"
    REJECTED_UNKNOWN = "rejected_unknown"
    REJECTED_INVALID = "rejected_invalid"


class PromptSource(Protocol):
    def next_prompts(self, n: int) -> list[Prompt]: ...


Scorer = Callable[[Prompt, str], float]
GroupScorer = Callable[[Prompt, RolloutGroup, ReplayBudget | None], list[float]]


class StalenessBuffer:
    """Accepts groups at most ``staleness`` versions old; optional ``scorer(prompt, text)``
    recomputes every accepted group's rewards (the actor's rewards are only a hint).
    ``group_scorer(prompt, group)`` replaces it for episodic tasks (``learner/replay.py``: it
    replays the episodes and raises ``ReplayMismatch`` on a forged one). ``batch``: the groups
    each step takes (0: learnt from the first :meth:`take`), for :meth:`trains_at`.
    ``consumer``: accepted groups go to it at once instead of waiting for a batch (``echorl
    serve``'s sampling requests, which nothing trains on)."""

    def __init__(
        self,
        staleness: int,
        scorer: Scorer | None = None,
        group_scorer: GroupScorer | None = None,
        batch: int = 0,
        consumer: Callable[[RolloutGroup], None] | None = None,
    ) -> None:
        self.rule = StalenessRule(int(staleness))  # raises on a negative bound
        self.staleness = self.rule.bound
        self.scorer = scorer
        self.group_scorer = group_scorer
        self.consumer = consumer
        self.outstanding: dict[str, Prompt] = {}
        self.requeued: deque[Prompt] = deque()
        self._withdrawn: set[str] = set()  # withdrawn while out on a lease (:meth:`withdraw`)
        self._ready: deque[RolloutGroup] = deque()
        self._prompts: dict[str, Prompt] = {}  # prompts of buffered (accepted, unused) groups
        self.rollouts_accepted = 0
        self.rollouts_rejected_stale = 0
        self.rollouts_rejected_unknown = 0
        self.rollouts_rejected_invalid = 0
        self.rollouts_dropped_stale = 0  # accepted, then stale before a batch took them
        self.staleness_max = 0
        self._staleness_sum = 0
        self._batch = batch  # groups per step (the last batch taken's size; 0: not known yet)
        self._next_take = 0  # the version the next batch is trained at, at least (last take + 1)
        self._scan: tuple[int, int, int] | None = None  # trains_at's (first, groups scanned, ahead)
        self._checked = (-1, 0)  # take's (version, the oldest groups found fresh at it)

    # -- prompts -------------------------------------------------------------------------
    def register(self, prompts: list[Prompt]) -> None:
        """Mark prompts as leased out (their groups may now be offered)."""
        for p in prompts:
            self.outstanding[p.prompt_id] = p

    def next_prompts(self, source: PromptSource, n: int) -> list[Prompt]:
        """Up to ``n`` prompts: re-queued ones first, then fresh ones from ``source``;
        all are registered as outstanding."""
        out: list[Prompt] = []
        while self.requeued and len(out) < n:
            out.append(self.requeued.popleft())
        if len(out) < n:
            out.extend(source.next_prompts(n - len(out)))
        self.register(out)
        return out

    def requeue(self, prompts: list[Prompt]) -> None:
        """Hand prompts back (expired lease): they are served again before fresh ones."""
        for p in prompts:
            self.outstanding.pop(p.prompt_id, None)
            if p.prompt_id in self._withdrawn:
                self._withdrawn.discard(p.prompt_id)
                continue
            self.requeued.append(p)

    def withdraw(self, prompt_ids: set[str]) -> None:
        """Forget prompts no longer wanted (a sampling request the server answered itself): out of
        the queue and the outstanding set, so a late group for one is refused as unknown, and one
        out on a lease does not come back when the lease expires or is returned."""
        for pid in prompt_ids:
            if self.outstanding.pop(pid, None) is not None:
                self._withdrawn.add(pid)  # until its lease ends: requeue or a late group clears it
        if any(p.prompt_id in prompt_ids for p in self.requeued):
            self.requeued = deque(p for p in self.requeued if p.prompt_id not in prompt_ids)

    def pending_prompts(self) -> list[Prompt]:
        """Prompts not yet trained on: re-queued, outstanding and buffered (for checkpoints)."""
        seen: dict[str, Prompt] = {p.prompt_id: p for p in self.requeued}
        seen.update(self.outstanding)
        for pid, p in self._prompts.items():
            seen.setdefault(pid, p)
        return list(seen.values())

    # -- groups --------------------------------------------------------------------------
    def is_fresh(self, behaviour_version: int, current_version: int) -> bool:
        """The acceptance rule ``0 <= current - behaviour <= S``."""
        return behaviour_version <= current_version and self.rule.accepts(current_version, behaviour_version)

    def score(self, groups: list[RolloutGroup], budget: ReplayBudget | None = None) -> list[list[float] | None]:
        """The verifier's rewards for each group's samples (None: prompt not outstanding, or no
        scorer). Reads only; safe to run in a worker thread, so a slow verifier never blocks the
        learner's event loop; pass the result to ``offer``. ``budget``: one for all the groups'
        episode replays (``rl/replay.py``: ``ReplayOverBudget`` once spent)."""
        out: list[list[float] | None] = []
        for group in groups:
            prompt = self.outstanding.get(group.prompt_id)
            out.append(None if prompt is None else self._rewards(prompt, group, budget))
        return out

    def _rewards(self, prompt: Prompt, group: RolloutGroup, budget: ReplayBudget | None = None) -> list[float] | None:
        if self.group_scorer is not None:
            return [float(r) for r in self.group_scorer(prompt, group, budget)]
        if self.scorer is None:
            return None
        return [float(self.scorer(prompt, s.text)) for s in group.samples]

    def offer(self, group: RolloutGroup, current_version: int, rewards: list[float] | None = None) -> Verdict:
        """Accept or reject a returned group (see the module docstring); ``rewards`` from
        ``score`` if already computed, else the scorer runs here."""
        prompt = self.outstanding.get(group.prompt_id)
        if prompt is None:
            self._withdrawn.discard(group.prompt_id)
            self.rollouts_rejected_unknown += 1
            return Verdict.REJECTED_UNKNOWN
        if (
            not group.samples
            or any(len(s.token_ids) != len(s.logprobs) for s in group.samples)
            or (group.behaviour_version > current_version)
        ):
            del self.outstanding[group.prompt_id]
            self.requeued.append(prompt)
            self.rollouts_rejected_invalid += 1
            return Verdict.REJECTED_INVALID
        if not self.is_fresh(group.behaviour_version, self.trains_at(current_version)):
            del self.outstanding[group.prompt_id]
            self.requeued.append(prompt)
            self.rollouts_rejected_stale += 1
            return Verdict.REJECTED_STALE
        if rewards is None or len(rewards) != len(group.samples):
            try:
                rewards = self._rewards(prompt, group)
            except ReplayMismatch:
                del self.outstanding[group.prompt_id]
                self.requeued.append(prompt)
                self.rollouts_rejected_invalid += 1
                return Verdict.REJECTED_INVALID
        del self.outstanding[group.prompt_id]
        if rewards is not None:
            group.rewards = list(rewards)
        if self.consumer is not None:
            self.consumer(group)
            return Verdict.ACCEPTED
        self._prompts[group.prompt_id] = prompt
        self._ready.append(group)
        return Verdict.ACCEPTED

    def __len__(self) -> int:
        return len(self._ready)

    def buffered_ids(self) -> list[str]:
        """Prompt ids of the accepted groups waiting for a batch, oldest first."""
        return [g.prompt_id for g in self._ready]

    def drop(self, prompt_ids: list[str]) -> int:
        """Remove these buffered groups before any batch takes them (their contributor was proven
        to cheat); their prompts are re-queued. Returns the groups removed."""
        ids = set(prompt_ids)
        gone = [g for g in self._ready if g.prompt_id in ids]
        if gone:
            self._ready, self._scan = deque(g for g in self._ready if g.prompt_id not in ids), None
            self._checked = (-1, 0)
            self.requeued.extend(self._prompts.pop(g.prompt_id) for g in gone)
        return len(gone)

    def trains_at(self, current_version: int) -> int:
        """The version a group offered now would be trained at. Batches are taken oldest first,
        ``n`` groups each, at most one version apart, and a group stale when its batch comes is
        dropped then; so a group behind ``k`` groups that are still fresh when their batches come
        is trained at ``first + k // n`` at the latest, where ``first`` is the current version, or
        the next one while a taken batch trains. Batch size not known: the current version.

        Groups are only appended between takes and drops, so the scan resumes where the last one
        stopped (``_scan``) unless ``first`` moved: one call per offered group is O(1), not
        O(buffer) — at 1,000 peers with a large buffer the full scan was 14 % of the learner."""
        if self._batch <= 0:
            return current_version
        first = max(current_version, self._next_take)
        scan = self._scan
        if scan is None or scan[0] != first or scan[1] > len(self._ready):
            scan = (first, 0, 0)
        _, done, ahead = scan
        for g in islice(self._ready, done, None):
            ahead += self.is_fresh(g.behaviour_version, first + ahead // self._batch)
        self._scan = (first, len(self._ready), ahead)
        return first + ahead // self._batch

    def take(self, n: int, current_version: int) -> list[RolloutGroup] | None:
        """Drop groups that became stale (re-queueing their prompts); then return the ``n``
        oldest usable groups, or None (and keep them) if fewer than ``n`` are ready. The groups a
        call at the same version already found fresh are not looked at again (``_checked``): the
        trainer asks after every submission, and a scan of the whole buffer each time was 5 % of
        the learner at 1,000 peers."""
        version, done = self._checked
        start = done if version == current_version and done <= len(self._ready) else 0
        stale = [g for g in islice(self._ready, start, None) if not self.is_fresh(g.behaviour_version, current_version)]
        if stale:
            gone = {id(g) for g in stale}
            self._ready, self._scan = deque(g for g in self._ready if id(g) not in gone), None
            for g in stale:
                self.rollouts_rejected_stale += 1
                self.rollouts_dropped_stale += 1
                self.requeued.append(self._prompts.pop(g.prompt_id))
        self._checked = (current_version, len(self._ready))
        if len(self._ready) < n:
            return None
        self._batch, self._next_take = n, current_version + 1
        batch = [self._ready.popleft() for _ in range(n)]
        self._scan, self._checked = None, (current_version, len(self._ready))
        for g in batch:
            s = current_version - g.behaviour_version
            self.staleness_max = max(self.staleness_max, s)
            self._staleness_sum += s
            self._prompts.pop(g.prompt_id, None)
        self.rollouts_accepted += len(batch)
        return batch

    @property
    def staleness_mean(self) -> float:
        """Mean staleness of all groups used so far."""
        return self._staleness_sum / self.rollouts_accepted if self.rollouts_accepted else 0.0

    _COUNTERS = (
        "rollouts_accepted",
        "rollouts_rejected_stale",
        "rollouts_rejected_unknown",
        "rollouts_rejected_invalid",
        "rollouts_dropped_stale",
        "staleness_max",
    )

    def state_dict(self) -> dict[str, object]:
        """Every prompt not trained yet (re-queued first on load, so none is skipped or
        repeated) and the counters, so a resumed run's totals continue."""
        return {
            "pending": [p.to_dict() for p in self.pending_prompts()],
            "counters": {**{k: getattr(self, k) for k in self._COUNTERS}, "staleness_sum": self._staleness_sum},
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Re-queue the saved pending prompts and restore the counters (into a fresh buffer)."""
        state = check_state_keys("buffer", state, {"pending", "counters"})
        counters = check_state_keys("buffer counters", state.get("counters", {}), {*self._COUNTERS, "staleness_sum"})
        pending = state.get("pending", [])
        if not isinstance(pending, list):
            raise ValueError(f"buffer pending must be a list, not {type(pending).__name__}")
        self.requeue([Prompt.from_dict(d) for d in pending])
        for k in self._COUNTERS:
            setattr(self, k, int(counters.get(k, 0)))
        self._staleness_sum = int(counters.get("staleness_sum", 0))

    def counters(self) -> dict[str, float]:
        return {
            "rollouts_accepted": self.rollouts_accepted,
            "rollouts_rejected_stale": self.rollouts_rejected_stale,
            "rollouts_rejected_unknown": self.rollouts_rejected_unknown,
            "rollouts_rejected_invalid": self.rollouts_rejected_invalid,
            "rollouts_dropped_stale": self.rollouts_dropped_stale,
            "staleness_max": self.staleness_max,
            "staleness_mean": self.staleness_mean,
        }
