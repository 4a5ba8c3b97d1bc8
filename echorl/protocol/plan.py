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

Uplink weights (``PlanPeer.weight``, the learner's measurement of each relay's upload, never a
peer's claim): the k·R child slots of the R peers that may relay are shared in proportion to
their weights (``relay_slots``: at most ``MAX_COPIES`` copies each; weight 0 or a share under
one slot: a leaf); groups are filled to balance their slots, each group fastest first (shallow),
and a peer may put all its slots into its one stripe. Equal weights (or none) give the plan
above exactly; a weighted plan more than ``WEIGHTED_DEPTH_SLACK`` hops deeper than that bound
(one-slot relays chain) is replaced by the plan without weights.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections import deque
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class PlanPeer:
    peer_id: str
    reachable: bool = True
    pushes: bool = False  # unreachable, but dials out to reachable children (ignored if reachable)
    weight: int | None = None  # relative uplink, 0..MAX_WEIGHT; None: the median of those given


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

    def order_of(self, learner: str) -> dict[str, int]:
        """Each member's place in the stripe's breadth-first order, the learner 0 (parent before
        child, earlier before later among children; a depth before the next): streams that go
        only forward in it cannot wait on each other (``VersionState.adopt``)."""
        return {p: i for i, p in enumerate(self.depth_of(learner))}


@dataclass(frozen=True)
class BroadcastPlan:
    learner: str
    fanout: int
    stripes: tuple[Stripe, ...]
    peers: tuple[str, ...] = field(default=())
    unreachable: frozenset[str] = field(default=frozenset())
    slots: dict[str, int] = field(default_factory=dict, compare=False)  # relay -> child slots planned (all stripes)

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

    def streams(self, peer_id: str) -> int:
        """Child streams ``peer_id`` forwards, over all stripes."""
        return sum(len(s.children.get(peer_id, ())) for s in self.stripes)

    def upload_copies(self, peer_id: str) -> float:
        """Copies of the snapshot ``peer_id`` forwards (children × stripe share), for large
        snapshots where each stripe carries 1/k of the chunks."""
        return self.streams(peer_id) / len(self.stripes)


AUTO_CHUNK_MIN = 64 * 1024
MAX_WEIGHT = 2**16 - 1  # a weight is an integer in [0, MAX_WEIGHT] (PlanMember.weight)
MAX_COPIES = 8  # no peer is given more than MAX_COPIES · k child slots (8 copies of a version)
AUTO_CHUNK_MAX = 1024 * 1024
WEIGHTED_DEPTH_SLACK = 1
"""Hops a weighted plan may go past a full k-ary tree over the same peers (``expected_depth``)
before the plan without weights is used instead: uneven slots leave a stripe whose relays have
one slot each, and those chain (weights 1, 1, 1, 1, 1, 4 at k = 2: depth 6 for 6 peers); each
hop costs a chunk-time, so a chain as long as the swarm costs what the weights save."""


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


def relay_slots(peers: list[PlanPeer], fanout: int) -> dict[str, int]:
    """Child slots across all stripes of each peer that may relay (reachable or pushing). With
    no weights, or all equal, k each (one copy of the snapshot). Else the k·R slots of the R
    such peers go in proportion to weight: the reachable ones get their weights' share, but at
    least k per unreachable member (those hang under reachable parents only), the pushers the
    rest, each pool shared by ``_divide``. A missing weight is the (lower) median of those
    given; a weight is clamped to [0, ``MAX_WEIGHT``]."""
    relays = [p for p in peers if p.reachable or p.pushes]
    given = sorted(min(max(p.weight, 0), MAX_WEIGHT) for p in relays if p.weight is not None)
    default = given[(len(given) - 1) // 2] if given else 1
    weight = {p.peer_id: default if p.weight is None else min(max(p.weight, 0), MAX_WEIGHT) for p in relays}
    if len(set(weight.values())) <= 1 and default > 0:
        return dict.fromkeys(weight, fanout)
    reach = [p.peer_id for p in relays if p.reachable]
    push = [p.peer_id for p in relays if not p.reachable]
    total, w_reach, w_all = fanout * len(relays), sum(weight[p] for p in reach), sum(weight.values())
    n_unreachable = sum(not p.reachable for p in peers)
    if w_all == w_reach:
        t_reach = total
    else:
        t_reach = min(total, max(total * w_reach // w_all, fanout * n_unreachable)) if w_reach else 0
    cap = MAX_COPIES * fanout
    return _divide(reach, weight, t_reach, cap) | _divide(push, weight, total - t_reach, cap)


def _divide(members: list[str], weight: dict[str, int], total: int, cap: int) -> dict[str, int]:
    """``total`` slots among ``members`` by greatest divisors (D'Hondt: each next slot to the
    member with the largest weight / (its slots + 1); ties: the earlier in ``members``), which
    makes the largest slots / weight as small as it can be; at most ``cap`` each. It starts
    from ⌊total · weight / Σ weight⌋ (capped), which every such division gives at least. The
    quotients are compared as floats: exact here (weights < 2¹⁶, slots ≤ 8 · 64)."""
    w_sum = sum(weight[p] for p in members)
    if w_sum == 0 or total <= 0:
        return dict.fromkeys(members, 0)
    slots = {p: min(total * weight[p] // w_sum, cap) for p in members}
    heap = [(-weight[p] / (slots[p] + 1), i, p) for i, p in enumerate(members) if slots[p] < cap and weight[p]]
    heapq.heapify(heap)
    for _ in range(total - sum(slots.values())):
        if not heap:
            break
        _, i, p = heapq.heappop(heap)
        slots[p] += 1
        if slots[p] < cap:
            heapq.heappush(heap, (-weight[p] / (slots[p] + 1), i, p))
    return slots


def _grouped(members: list[str], slots: dict[str, int], n_groups: int) -> list[list[str]]:
    """Each member (in order) to the group with the fewest slots so far (ties: the lowest
    index), then each group by slots, most first (stable): round-robin when slots are equal."""
    groups: list[list[str]] = [[] for _ in range(n_groups)]
    held = [0] * n_groups
    for p in members:
        j = min(range(n_groups), key=lambda g: (held[g], g))
        groups[j].append(p)
        held[j] += slots[p]
    return [sorted(g, key=lambda p: -slots[p]) for g in groups]


def plan_broadcast(
    learner: str, peers: list[PlanPeer], fanout: int, seed: int = 0, striped: bool = True
) -> BroadcastPlan:
    """The relay trees for one version. Same inputs (in any order) → same plan. A weighted plan
    deeper than ``WEIGHTED_DEPTH_SLACK`` hops past a full k-ary tree gives way to the plan
    without weights when that one is shallower."""
    plan = _plan(learner, peers, fanout, seed, striped)
    if plan.depth <= expected_depth(len(peers), fanout) + WEIGHTED_DEPTH_SLACK:
        return plan
    if all(p.weight is None for p in peers):
        return plan
    even = _plan(learner, [replace(p, weight=None) for p in peers], fanout, seed, striped)
    return even if even.depth < plan.depth else plan


def _plan(learner: str, peers: list[PlanPeer], fanout: int, seed: int, striped: bool) -> BroadcastPlan:
    if fanout < 1:
        raise ValueError("fanout must be at least 1")
    ids = [p.peer_id for p in peers]
    if len(set(ids)) != len(ids) or learner in ids:
        raise ValueError("peer ids must be unique and must not include the learner")
    order = _shuffled(peers, seed)
    # With fewer peers than the fan-out, one stripe per peer: each root then serves all the
    # others directly (depth 2, (n−1)/n copies) instead of borrowing spare slots into a chain.
    n_stripes = min(fanout, len(order)) if striped and len(order) > 1 else 1
    # Child slots each peer has across all stripes (k = one copy of the snapshot); 0: a leaf.
    budget = {p: n for p, n in relay_slots(order, fanout).items() if n > 0}
    reachable = [p.peer_id for p in order if p.reachable and p.peer_id in budget]
    pushers = [p.peer_id for p in order if not p.reachable and p.peer_id in budget]
    unreachable = frozenset(p.peer_id for p in order if not p.reachable)
    # every group gets reachable peers and pushers alike: a pusher needs reachable neighbours
    groups = [r + q for r, q in zip(_grouped(reachable, budget, n_stripes), _grouped(pushers, budget, n_stripes))]
    cap = dict(budget)  # children a peer may take in one stripe: all its slots (k unless weighted)
    slots = dict(budget)  # (``budget`` is spent as the stripes are built)
    needed = math.ceil(max(len(order) - 1, 0) / fanout)  # parents needed in a full k-ary stripe
    stripes: dict[int, Stripe] = {}
    # Stripes whose own group suffices go first; short ones then borrow leftover slots.
    for j in sorted(range(n_stripes), key=lambda j: (sum(budget[p] for p in groups[j]) < needed * fanout, j)):
        interior = _interior_for_stripe(groups, j, len(order), cap, budget, set(stripes), unreachable)
        stripes[j] = _build_stripe(j, learner, order, interior, cap, budget, unreachable)
    trees = tuple(stripes[j] for j in range(n_stripes))
    return BroadcastPlan(learner, fanout, trees, tuple(sorted(ids)), unreachable, slots)


def _interior_for_stripe(
    groups: list[list[str]],
    j: int,
    n_peers: int,
    cap: dict[str, int],
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
        return min(max(budget[p], 0), cap[p]) or cap[p]  # exhausted peers exceed budget

    shortfall = max(n_peers - 1, 0) - sum(min(budget[p], cap[p]) for p in interior)
    short_reachable = len(unreachable) - sum(min(budget[p], cap[p]) for p in interior if p not in unreachable)
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
    cap: dict[str, int],
    budget: dict[str, int],
    unreachable: frozenset[str] = frozenset(),
) -> Stripe:
    """Breadth-first placement: interior peers first (shallow), each parent taking up to its
    remaining slots (at most its ``cap``, k unless weighted); if slots run out, parents exceed
    their budget (up to their cap here),
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
    slots = _Slots(children, cap, budget, unreachable)
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
        self, children: dict[str, list[str]], cap: dict[str, int], budget: dict[str, int], unreachable: frozenset[str]
    ) -> None:
        self.children, self.cap, self.budget, self.unreachable = children, cap, budget, unreachable

    def _room(self, parent: str, strict: bool) -> bool:
        mine = len(self.children.get(parent, ()))
        return mine < self.cap[parent] and (not strict or self.budget[parent] > 0)

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
