"""Lease book of the learner: single-use lease ids, deadlines, per-peer ownership, replay guard.

A lease is issued to one peer for a list of prompts. It is settled exactly once (a result,
a refusal of that result, a return, or expiry); afterwards its id is remembered so a repeated
or late submission is refused (``replay`` if it was settled by a result, ``unknown_lease`` if
it expired or was returned). Submission nonces are remembered too (bounded memory).

``LeasePolicy``: how much work a node at version b may be leased, and for how long.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from pydantic import Field

from echorl.learner.config import LeaseFields
from echorl.learner.loop import leasable_min_version, version_lag
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import SamplingSpec
from echorl.tasks.base import Prompt


@dataclass
class LeaseRecord:
    lease_id: str
    peer_id: str
    prompts: list[Prompt]
    group_size: int
    min_version: int
    issued_at: float
    deadline: float


class LeaseBook:
    MAX_REMEMBERED = 200_000

    def __init__(self) -> None:
        self.active: dict[str, LeaseRecord] = {}
        self._settled: OrderedDict[str, str] = OrderedDict()  # lease id -> how it ended
        self._nonces: OrderedDict[bytes, None] = OrderedDict()
        self._counter = itertools.count()
        self._salt = secrets.token_hex(4)
        self.issued = 0
        self.expired = 0
        self.returned = 0

    def issue(self, peer_id: str, prompts: list[Prompt], group_size: int, min_version: int,
              now: float, timeout_s: float) -> LeaseRecord:
        lease_id = f"L{self._salt}-{next(self._counter)}"
        rec = LeaseRecord(lease_id, peer_id, prompts, group_size, min_version, now, now + timeout_s)
        self.active[lease_id] = rec
        self.issued += 1
        return rec

    def check_nonce(self, nonce: bytes) -> None:
        if nonce in self._nonces:
            raise ProtocolError(ErrorCode.REPLAY, "nonce already used")

    def lookup(self, lease_id: str, peer_id: str) -> LeaseRecord:
        """The active lease ``lease_id`` held by ``peer_id``, or a refusal."""
        rec = self.active.get(lease_id)
        if rec is None:
            how = self._settled.get(lease_id)
            if how == "result":
                raise ProtocolError(ErrorCode.REPLAY, f"lease {lease_id} already settled")
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} is {how or 'unknown'}")
        if rec.peer_id != peer_id:
            raise ProtocolError(ErrorCode.UNKNOWN_LEASE, f"lease {lease_id} belongs to another peer")
        return rec

    def settle(self, lease_id: str, how: str, nonce: bytes | None = None) -> LeaseRecord | None:
        rec = self.active.pop(lease_id, None)
        self._remember(self._settled, lease_id, how)
        if nonce is not None:
            self._remember(self._nonces, nonce, None)
        return rec

    def expire_due(self, now: float) -> list[LeaseRecord]:
        due = [r for r in self.active.values() if r.deadline <= now]
        for r in due:
            self.settle(r.lease_id, "expired")
        self.expired += len(due)
        return due

    def expire_peer(self, peer_id: str) -> list[LeaseRecord]:
        """Expire every lease of a peer found dead (before their deadline)."""
        gone = [r for r in self.active.values() if r.peer_id == peer_id]
        for r in gone:
            self.settle(r.lease_id, "expired")
        self.expired += len(gone)
        return gone

    def return_leases(self, peer_id: str, lease_ids: list[str]) -> list[LeaseRecord]:
        out = []
        for lid in lease_ids:
            rec = self.active.get(lid)
            if rec is not None and rec.peer_id == peer_id:
                self.settle(lid, "returned")
                out.append(rec)
        self.returned += len(out)
        return out

    def held_by(self, peer_id: str) -> list[LeaseRecord]:
        return [r for r in self.active.values() if r.peer_id == peer_id]

    def outstanding_prompts(self) -> int:
        return sum(len(r.prompts) for r in self.active.values())

    def _remember(self, table: OrderedDict, key, value) -> None:  # type: ignore[type-arg]
        table[key] = value
        while len(table) > self.MAX_REMEMBERED:
            table.popitem(last=False)


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
        return version_lag(self.staleness)

    @property
    def in_flight_cap(self) -> int:
        """Buffered + leased prompts allowed, so results stay within the staleness bound."""
        return self.prompts_per_step * max(1, self.staleness - self.version_lag)

    def min_version(self, learner_version: int, published: int) -> int:
        """Oldest node version still leased work (the rule shared with train-local)."""
        return leasable_min_version(learner_version, published, self.staleness)

    def room(self, learner_version: int, node_version: int, in_flight: int) -> int:
        """Prompts a node at version b may be leased now. Groups are trained in arrival order,
        B per step, so a prompt with X prompts in flight before it (itself included) is trained
        at version t + ⌈X/B⌉ − 1; its staleness stays ≤ S iff X ≤ B·(S + 1 − (t − b)); the
        margin takes one step off, and ``in_flight_cap`` bounds X for fresh nodes."""
        steps_left = self.staleness + 1 - self.version_lag - (learner_version - node_version)
        return min(self.in_flight_cap, self.prompts_per_step * steps_left) - in_flight
