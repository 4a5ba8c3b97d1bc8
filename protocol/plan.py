"""Broadcast planning: who relays which chunks of a version to whom (architecture §6).

``plan_broadcast`` is a pure, deterministic function of (learner, peers with reachability,
fan-out k, seed). It builds ``k`` stripes (SplitStream-style): chunk ``i`` travels down stripe
``i mod k``; the learner sends each stripe to one stripe root; inside a stripe, interior nodes
forward to up to ``k`` children. Reachable peers are split into ``k`` groups and group ``j``
supplies the interior nodes of stripe ``j``, so each peer is interior in (at most) one stripe
and uploads about one copy of the snapshot (``k`` children × 1/k of the chunks), while the
learner uploads one copy in all. Depth is at most ⌈log_k N⌉ + 1 hops from the learner.

Peers that cannot be dialled are never interior: they are leaves that dial their parent. When
a stripe's group is short, it borrows spare child slots of peers whose stripes need fewer
(each peer has k slots in all = one copy); when reachable peers are too few, parents exceed
their slots, and as a last resort the learner adopts the remaining peers directly. ``striped=False`` gives a single pipelined k-ary tree.
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
    # With fewer peers than the fan-out, one stripe per peer: each root then serves all the
    # others directly (depth 2, (n−1)/n copies) instead of borrowing spare slots into a chain.
    n_stripes = min(fanout, len(order)) if striped and len(order) > 1 else 1
    reachable = [p.peer_id for p in order if p.reachable]
    groups = [reachable[j::n_stripes] for j in range(n_stripes)]
    # Child slots each peer has left across all stripes: k slots = one copy of the snapshot.
    budget = {p: fanout * n_stripes if n_stripes == 1 else fanout for p in reachable}
    needed = math.ceil(max(len(order) - 1, 0) / fanout)  # parents needed in a full k-ary stripe
    stripes: dict[int, Stripe] = {}
    # Stripes whose own group suffices go first; short ones then borrow leftover slots.
    for j in sorted(range(n_stripes), key=lambda j: (len(groups[j]) < needed, j)):
        interior = _interior_for_stripe(groups, j, len(order), fanout, budget, set(stripes))
        stripes[j] = _build_stripe(j, learner, order, interior, fanout, budget)
    return BroadcastPlan(learner, fanout, tuple(stripes[j] for j in range(n_stripes)), tuple(sorted(ids)))


def _interior_for_stripe(
    groups: list[list[str]], j: int, n_peers: int, fanout: int, budget: dict[str, int], built: set[int]
) -> list[str]:
    """Stripe j's interior peers: its own group, then, if their slots cannot host the other
    peers, just enough borrowed peers to cover the shortfall: first the spare slots of groups
    whose stripes are built, then peers of groups still to come (most slots left first)."""
    interior = list(groups[j])
    shortfall = max(n_peers - 1, 0) - sum(min(budget[p], fanout) for p in interior)
    own = set(interior)
    candidates = [(g not in built, -budget[p], i, p) for g, grp in enumerate(groups) for i, p in enumerate(grp)]
    for *_, p in sorted(c for c in candidates if c[3] not in own):
        if shortfall <= 0:
            break
        interior.append(p)
        shortfall -= min(max(budget[p], 0), fanout) or fanout  # exhausted peers exceed budget
    return interior


def _build_stripe(
    j: int, learner: str, order: list[PlanPeer], interior: list[str], fanout: int, budget: dict[str, int]
) -> Stripe:
    """Breadth-first placement: interior peers first (shallow), each parent taking up to its
    remaining slots (at most k); if slots run out, parents exceed their budget (up to k here),
    and only then does the learner adopt the rest."""
    interior_set = set(interior)
    placement = interior + [p.peer_id for p in order if p.peer_id not in interior_set]
    if not placement:
        return Stripe(j, {learner: ()})
    if placement[0] not in interior_set:  # nobody can relay: the learner serves everyone itself
        return Stripe(j, {learner: tuple(placement)})
    children: dict[str, list[str]] = {learner: [placement[0]]}
    unplaced = _place(placement[1:], [placement[0]], interior_set, children, fanout, budget, strict=True)
    if unplaced:
        relays = [p for p in placement if p in interior_set and p not in unplaced]
        unplaced = _place(unplaced, relays, interior_set, children, fanout, budget, strict=False)
    children[learner].extend(unplaced)
    return Stripe(j, {p: tuple(cs) for p, cs in children.items() if cs})


def _place(
    peers: list[str], parents: list[str], interior: set[str], children: dict[str, list[str]],
    fanout: int, budget: dict[str, int], strict: bool,
) -> list[str]:
    """Attach ``peers`` in order to the first parent with room; return those left over."""
    def room(parent: str) -> bool:
        mine = len(children.get(parent, ()))
        return mine < fanout and (not strict or budget[parent] > 0)

    queue = deque(p for p in parents if room(p))
    left = []
    for peer in peers:
        while queue and not room(queue[0]):
            queue.popleft()
        if not queue:
            left.append(peer)
            continue
        parent = queue[0]
        children.setdefault(parent, []).append(peer)
        budget[parent] -= 1
        if peer in interior and room(peer):
            queue.append(peer)
    return left
