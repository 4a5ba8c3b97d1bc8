"""Broadcast planning: who relays which chunks of a version to whom (architecture §6).

``plan_broadcast`` is a pure, deterministic function of (learner, peers with reachability,
fan-out k, seed). It builds ``k`` stripes (SplitStream-style): chunk ``i`` travels down stripe
``i mod k``; the learner sends each stripe to one stripe root; inside a stripe, interior nodes
forward to up to ``k`` children. Reachable peers are split into ``k`` groups and group ``j``
supplies the interior nodes of stripe ``j``, so each peer is interior in (at most) one stripe
and uploads about one copy of the snapshot (``k`` children × 1/k of the chunks), while the
learner uploads one copy in all. Depth is at most ⌈log_k N⌉ + 1 hops from the learner.

Peers that cannot be dialled (behind NAT) are leaves that dial their parent, unless they
``push``: such a peer may be interior with *reachable* children only, which it dials and pushes
its stripe to, so NAT'd uplinks carry traffic too. No edge joins two unreachable peers (neither
could dial the other); a pusher's own parent is reachable or the learner. When
a stripe's group is short, it borrows spare child slots of peers whose stripes need fewer
(each peer has k slots in all = one copy); when reachable peers are too few, parents exceed
their slots, and as a last resort the learner adopts the remaining peers directly.
``striped=False`` gives a single pipelined k-ary tree.
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
    pushes: bool = False  # unreachable, but dials out to reachable children (ignored if reachable)


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
    unreachable: frozenset[str] = field(default=frozenset())

    def stripe_of_chunk(self, chunk_index: int) -> int:
        return chunk_index % len(self.stripes)

    def parent(self, peer_id: str, stripe: int) -> str:
        return self.stripes[stripe].parent_of()[peer_id]

    def children(self, peer_id: str, stripe: int) -> tuple[str, ...]:
        return self.stripes[stripe].children.get(peer_id, ())

    @property
    def depth(self) -> int:
        return max((max(s.depth_of(self.learner).values()) for s in self.stripes), default=0)

    def pushed(self, parent: str, child: str) -> bool:
        """True when ``parent`` cannot be dialled and so dials ``child`` and pushes to it."""
        return parent != self.learner and parent in self.unreachable and child not in self.unreachable

    def upload_copies(self, peer_id: str) -> float:
        """Copies of the snapshot ``peer_id`` forwards (children × stripe share), for large
        snapshots where each stripe carries 1/k of the chunks."""
        return sum(len(s.children.get(peer_id, ())) for s in self.stripes) / len(self.stripes)


AUTO_CHUNK_MIN = 64 * 1024
AUTO_CHUNK_MAX = 1024 * 1024


def expected_depth(n_peers: int, fanout: int) -> int:
    """Hops from the learner to the deepest peer of a striped plan over ``n_peers``."""
    if n_peers <= 1 or fanout <= 1:
        return max(n_peers, 1)
    return 1 + math.ceil(math.log(n_peers) / math.log(fanout) - 1e-9)


def auto_chunk_bytes(payload_bytes: int, n_peers: int, fanout: int) -> int:
    """A chunk size for one version: a power of two near W / (16·k·depth), in [64 KiB, 1 MiB].

    A relay forwards a chunk once it has all of it, so the last chunk reaches the deepest peer
    (depth − 1) chunk-times after the learner sent it, a chunk-time being c / (B/k) (a stripe's
    share of an uplink). With c = W / (16·k·depth) that fill is under 1/16 of W/B; smaller
    chunks cost per-chunk work (a frame, a hash, a manifest entry) without buying time."""
    depth = expected_depth(n_peers, fanout)
    target = payload_bytes / (16 * max(fanout, 1) * depth)
    size = AUTO_CHUNK_MIN
    while size * 2 <= min(target, AUTO_CHUNK_MAX):
        size *= 2
    return size


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
    pushers = [p.peer_id for p in order if not p.reachable and p.pushes]
    unreachable = frozenset(p.peer_id for p in order if not p.reachable)
    # every group gets reachable peers and pushers alike: a pusher needs reachable neighbours
    groups = [reachable[j::n_stripes] + pushers[j::n_stripes] for j in range(n_stripes)]
    # Child slots each peer has left across all stripes: k slots = one copy of the snapshot.
    budget = {p: fanout * n_stripes if n_stripes == 1 else fanout for p in reachable + pushers}
    needed = math.ceil(max(len(order) - 1, 0) / fanout)  # parents needed in a full k-ary stripe
    stripes: dict[int, Stripe] = {}
    # Stripes whose own group suffices go first; short ones then borrow leftover slots.
    for j in sorted(range(n_stripes), key=lambda j: (len(groups[j]) < needed, j)):
        interior = _interior_for_stripe(groups, j, len(order), fanout, budget, set(stripes), unreachable)
        stripes[j] = _build_stripe(j, learner, order, interior, fanout, budget, unreachable)
    return BroadcastPlan(learner, fanout, tuple(stripes[j] for j in range(n_stripes)), tuple(sorted(ids)), unreachable)


def _interior_for_stripe(
    groups: list[list[str]],
    j: int,
    n_peers: int,
    fanout: int,
    budget: dict[str, int],
    built: set[int],
    unreachable: frozenset[str] = frozenset(),
) -> list[str]:
    """Stripe j's interior peers: its own group, then, if their slots cannot host the other
    peers, just enough borrowed peers to cover the shortfall: first the spare slots of groups
    whose stripes are built, then peers of groups still to come (most slots left first). The
    unreachable peers can only hang under reachable ones, so reachable slots are counted apart
    (and borrowed first while they fall short)."""
    interior = list(groups[j])

    def slots(p: str) -> int:
        return min(max(budget[p], 0), fanout) or fanout  # exhausted peers exceed budget

    shortfall = max(n_peers - 1, 0) - sum(min(budget[p], fanout) for p in interior)
    short_reachable = len(unreachable) - sum(min(budget[p], fanout) for p in interior if p not in unreachable)
    own = set(interior)
    candidates = sorted(
        (p in unreachable, g not in built, -budget[p], i, p)
        for g, grp in enumerate(groups)
        for i, p in enumerate(grp)
        if p not in own
    )
    if unreachable:
        for *_, p in candidates:
            if short_reachable <= 0 or p in unreachable:
                break
            interior.append(p)
            short_reachable -= slots(p)
            shortfall -= slots(p)
            own.add(p)
    for *_, p in sorted(c[1:] for c in candidates if c[-1] not in own):
        if shortfall <= 0:
            break
        interior.append(p)
        shortfall -= slots(p)
    return interior


def _build_stripe(
    j: int,
    learner: str,
    order: list[PlanPeer],
    interior: list[str],
    fanout: int,
    budget: dict[str, int],
    unreachable: frozenset[str] = frozenset(),
) -> Stripe:
    """Breadth-first placement: interior peers first (shallow), each parent taking up to its
    remaining slots (at most k); if slots run out, parents exceed their budget (up to k here),
    and only then does the learner adopt the rest. With pushers among the interior, a reachable
    root, then pushers and reachable peers in turn (``_alternate``), and unreachable leaves
    before reachable ones (they can only hang under reachable parents; pushers take the rest)."""
    interior_set = set(interior)
    leaves = [p.peer_id for p in order if p.peer_id not in interior_set]
    if interior_set & unreachable:
        interior = _alternate(interior, unreachable)
        leaves = sorted(leaves, key=lambda p: p not in unreachable)
    placement = interior + leaves
    if not placement:
        return Stripe(j, {learner: ()})
    if placement[0] not in interior_set:  # nobody can relay: the learner serves everyone itself
        return Stripe(j, {learner: tuple(placement)})
    children: dict[str, list[str]] = {learner: [placement[0]]}
    slots = _Slots(children, fanout, budget, unreachable)
    unplaced = slots.place(placement[1:], [placement[0]], interior_set, strict=True)
    if unplaced:
        relays = [p for p in placement if p in interior_set and p not in unplaced]
        unplaced = slots.place(unplaced, relays, interior_set, strict=False)
    children[learner].extend(unplaced)
    return Stripe(j, {p: tuple(cs) for p, cs in children.items() if cs})


def _alternate(interior: list[str], unreachable: frozenset[str]) -> list[str]:
    """A reachable root, then pushers and reachable peers in turn: each pusher then finds a
    reachable parent, each reachable peer a pusher's slot (useless to anyone else)."""
    reach = [p for p in interior if p not in unreachable]
    push = [p for p in interior if p in unreachable]
    out = reach[:1]
    rest = reach[1:]
    for i in range(max(len(push), len(rest))):
        out += push[i : i + 1] + rest[i : i + 1]
    return out


class _Slots:
    """Parents with free child slots, in breadth-first order, kept in two queues (reachable
    parents, pushers) so that an unreachable peer only ever gets a reachable parent."""

    def __init__(
        self, children: dict[str, list[str]], fanout: int, budget: dict[str, int], unreachable: frozenset[str]
    ) -> None:
        self.children, self.fanout, self.budget, self.unreachable = children, fanout, budget, unreachable

    def _room(self, parent: str, strict: bool) -> bool:
        mine = len(self.children.get(parent, ()))
        return mine < self.fanout and (not strict or self.budget[parent] > 0)

    def place(self, peers: list[str], parents: list[str], interior: set[str], strict: bool) -> list[str]:
        """Attach ``peers`` in order to the first compatible parent with room (a pusher, for a
        reachable peer, while one has room); return those left over."""
        queues: tuple[deque, deque] = (deque(), deque())  # (order, parent): reachable, pushers
        seq = iter(range(1 << 62))

        def enqueue(parent: str) -> None:
            if self._room(parent, strict):
                queues[parent in self.unreachable].append((next(seq), parent))

        def head(q: deque) -> tuple[int, str] | None:
            while q and not self._room(q[0][1], strict):
                q.popleft()
            return q[0] if q else None

        for p in parents:
            enqueue(p)
        left = []
        for peer in peers:
            # a reachable peer takes a pusher's slot first: only reachable peers can use those
            best = (None if peer in self.unreachable else head(queues[1])) or head(queues[0])
            if best is None:
                left.append(peer)
                continue
            parent = best[1]
            self.children.setdefault(parent, []).append(peer)
            self.budget[parent] -= 1
            if peer in interior:
                enqueue(peer)
        return left
