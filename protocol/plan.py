"""Broadcast planning: who relays which chunks of a version to whom (DESIGN §6).

``plan_broadcast`` is a pure, deterministic function of (learner, peers with reachability,
fan-out k, seed). It builds ``k`` stripes (SplitStream-style): chunk ``i`` travels down stripe
``i mod k``; the learner sends each stripe to one stripe root; inside a stripe, interior nodes
forward to up to ``k`` children. Reachable peers are split into ``k`` groups and group ``j``
supplies the interior nodes of stripe ``j``, so each peer is interior in (at most) one stripe
and uploads about one copy of the snapshot (``k`` children × 1/k of the chunks), while the
learner uploads one copy in all. Depth is at most ⌈log_k N⌉ + 1 hops from the learner.

Peers that cannot be dialled are never interior: they are leaves that dial their parent. When
too few reachable peers exist to host everyone, interior duty is borrowed from other stripes'
groups (those peers then upload more than one copy), and as a last resort the learner adopts
the remaining peers directly. ``striped=False`` gives a single pipelined k-ary tree.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PlanPeer:
    peer_id: str
    reachable: bool = True


@dataclass(frozen=True)
class Stripe:
    index: int
    children: dict[str, tuple[str, ...]]  # parent (learner included) -> children, in order

    def parent_of(self) -> dict[str, str]:
        return {c: p for p, cs in self.children.items() for c in cs}

    def depth_of(self, learner: str) -> dict[str, int]:
        depth = {learner: 0}
        queue = deque([learner])
        while queue:
            parent = queue.popleft()
            for child in self.children.get(parent, ()):
                depth[child] = depth[parent] + 1
                queue.append(child)
        return depth


@dataclass(frozen=True)
class BroadcastPlan:
    learner: str
    fanout: int
    stripes: tuple[Stripe, ...]
    peers: tuple[str, ...] = field(default=())

    def stripe_of_chunk(self, chunk_index: int) -> int:
        return chunk_index % len(self.stripes)

    def parent(self, peer_id: str, stripe: int) -> str:
        return self.stripes[stripe].parent_of()[peer_id]

    def children(self, peer_id: str, stripe: int) -> tuple[str, ...]:
        return self.stripes[stripe].children.get(peer_id, ())

    @property
    def depth(self) -> int:
        return max((max(s.depth_of(self.learner).values()) for s in self.stripes), default=0)

    def upload_copies(self, peer_id: str) -> float:
        """Copies of the snapshot ``peer_id`` forwards (children × stripe share), for large
        snapshots where each stripe carries 1/k of the chunks."""
        return sum(len(s.children.get(peer_id, ())) for s in self.stripes) / len(self.stripes)


def _shuffled(peers: list[PlanPeer], seed: int) -> list[PlanPeer]:
    def key(p: PlanPeer) -> bytes:
        return hashlib.sha256(f"{seed}:{p.peer_id}".encode()).digest()

    return sorted(peers, key=key)


def plan_broadcast(
    learner: str, peers: list[PlanPeer], fanout: int, seed: int = 0, striped: bool = True
) -> BroadcastPlan:
    """The relay trees for one version. Same inputs (in any order) → same plan."""
    if fanout < 1:
        raise ValueError("fanout must be at least 1")
    ids = [p.peer_id for p in peers]
    if len(set(ids)) != len(ids) or learner in ids:
        raise ValueError("peer ids must be unique and must not include the learner")
    order = _shuffled(peers, seed)
    n_stripes = fanout if striped and len(order) > 1 else 1
    reachable = [p.peer_id for p in order if p.reachable]
    groups = [reachable[j::n_stripes] for j in range(n_stripes)]
    interior_load = {p: 0 for p in reachable}
    stripes = []
    for j in range(n_stripes):
        interior = _interior_for_stripe(groups, j, len(order), fanout, interior_load)
        for p in interior:
            interior_load[p] += 1
        stripes.append(_build_stripe(j, learner, order, interior, fanout))
    return BroadcastPlan(learner, fanout, tuple(stripes), tuple(sorted(ids)))


def _interior_for_stripe(
    groups: list[list[str]], j: int, n: int, fanout: int, load: dict[str, int]
) -> list[str]:
    """Stripe j's interior peers: its own group first, then borrowed (least-loaded first)."""
    needed = math.ceil(max(n - 1, 0) / fanout)  # parents needed under the stripe root
    interior = list(groups[j])[: max(needed, 1)]
    if len(interior) < max(needed, 1):
        others = [p for g in groups for p in g if p not in interior]
        others.sort(key=lambda p: load[p])
        interior += others[: max(needed, 1) - len(interior)]
    return interior


def _build_stripe(j: int, learner: str, order: list[PlanPeer], interior: list[str], fanout: int) -> Stripe:
    interior_set = set(interior)
    rest = [p.peer_id for p in order if p.peer_id not in interior_set]
    placement = interior + rest
    children: dict[str, list[str]] = {learner: []}
    if not placement:
        return Stripe(j, {learner: ()})
    root, *others = placement
    if root in interior_set:
        children[learner].append(root)
        parents = deque([root])
    else:  # nobody can relay: the learner serves everyone itself
        children[learner].extend(placement)
        return Stripe(j, {learner: tuple(placement)})
    for peer in others:
        if parents:
            parent = parents[0]
            children.setdefault(parent, []).append(peer)
            if len(children[parent]) >= fanout:
                parents.popleft()
        else:
            children[learner].append(peer)
        if peer in interior_set:
            parents.append(peer)
    return Stripe(j, {p: tuple(cs) for p, cs in children.items() if cs})
