"""Every rule the staleness bound S implies, in one place (architecture §4).

A rollout group generated with policy version b is used at learner step t iff ``t − b ≤ S``
(:meth:`StalenessRule.accepts`). Everything else follows from that and from B, the groups per
step:

- the publication period κ (:meth:`StalenessRule.kappa`): ``publish_every`` or max(1, S − 1),
  at most max(1, S), so a published version is always recent enough to be leased work;
- the version lag (:attr:`StalenessRule.lag`): one step of margin for S ≥ 2, because a fresher
  actor's lease can overtake an older one and its result arrive a step later than in-order
  accounting says;
- the oldest leasable version (:meth:`StalenessRule.min_version`): t − S + lag, never newer than
  the last published version;
- the in-flight bound (:meth:`StalenessRule.in_flight_cap`): buffered + leased prompts at most
  ``B·max(1, S − lag)``, so results stay within the bound; :meth:`StalenessRule.room` is what a
  node at version b may be leased on top.

The buffer (``rl/buffer.py``), the training loop (``rl/loop.py``), train-local's actor source
(``rl/local.py``) and the learner's lease and submit handlers (``learner/service.py``,
``learner/checks.py``) all ask one :class:`StalenessRule`; none computes these itself.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessRule:
    """The staleness bound ``bound`` (S) and the batch size ``prompts_per_step`` (B) of a run."""

    bound: int
    prompts_per_step: int = 1

    def __post_init__(self) -> None:
        if self.bound < 0:
            raise ValueError(f"staleness must be >= 0, got {self.bound}")
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")

    def accepts(self, learner_version: int, behaviour_version: int) -> bool:
        """The accept test ``t − b ≤ S``: a group of version b may be trained at step t. (A
        version newer than t is not stale: the buffer refuses it as invalid, the learner as
        unpublished.)"""
        return learner_version - behaviour_version <= self.bound

    def kappa(self, publish_every: int | None = None) -> int:
        """Publication period κ: ``publish_every`` or max(1, S−1), at most max(1, S)."""
        s = self.bound
        return max(1, min(publish_every or max(1, s - 1), max(1, s)))

    @property
    def lag(self) -> int:
        """Safety margin in steps (S ≥ 2): results may arrive one step later than in-order
        accounting says (a fresher actor's lease can overtake), so plan for one step less."""
        return 0 if self.bound <= 1 else 1

    def min_version(self, learner_version: int, published: int) -> int:
        """Oldest policy version still leased work: t − S + lag, but never newer than the last
        published version (an actor cannot hold weights that were not published yet)."""
        return max(0, min(published, learner_version - self.bound + self.lag))

    @property
    def in_flight_cap(self) -> int:
        """Buffered + leased prompts allowed at once, so results stay within the bound:
        ``B·max(1, S − lag)``."""
        return self.prompts_per_step * max(1, self.bound - self.lag)

    def room(self, learner_version: int, node_version: int, in_flight: int) -> int:
        """Prompts a node at version b may be leased now. Groups are trained in arrival order,
        B per step, so a prompt with X prompts in flight before it (itself included) is trained
        at version t + ⌈X/B⌉ − 1; its staleness stays ≤ S iff X ≤ B·(S + 1 − (t − b)); the lag
        takes one step off, and :attr:`in_flight_cap` bounds X for fresh nodes."""
        steps_left = self.bound + 1 - self.lag - (learner_version - node_version)
        return min(self.in_flight_cap, self.prompts_per_step * steps_left) - in_flight

    def held_versions(self) -> int:
        """Published versions the learner keeps for checks: every version a rollout may still
        claim (S + 1 of them) and one being published."""
        return self.bound + 2
