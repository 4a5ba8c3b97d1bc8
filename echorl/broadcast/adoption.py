"""Whom an orphan asks for the rest of a stripe when its plan parent fails, and whom a relay
streams to off the plan (issue 27, self-repair under churn; ``broadcast/stripe_feed.py`` asks,
``VersionState.adopt`` answers). One rule for the relay and for the flow-level simulator
(``bench/flowsim.py``), which calls these functions.

An orphan asks, in order: its ancestors above the failed parent, nearest first; then its
uncles (the parent's siblings: a depth above it, they hold more of the stripe than it does),
each orphan of one parent starting at a different one so they spread over the uncles; the
learner last. The orphans of a striped plan's stripe head (no ancestor but the learner, no
uncles) ask the siblings listed before them first, nearest first: a chain, each fed by the one
before, which the learner feeds once, not ``fanout`` times. The learner's uplink is the one
every peer shares: in the namespace lab, when a relay and its parent died together their
orphans all went to the learner (8 adoptions, 1.96 copies in one run).

A relay adopts up to ``fanout`` of its descendants and later siblings per stripe, the learner
anyone (an extra copy of a stripe at most); a relay adopts at most ``adoption_slots`` nephews
per stripe: the child slots the plan gave it and it does not use, and as many more as keep each
of its planned streams at ``ADOPT_FLOOR`` of its rate or more.
An adopter streams the rest of the stripe to the orphan's whole subtree, so a slow one slows
all of it for the rest of the version, where an orphan no one adopts pulls from several
holders. A plan gives each relay streams in proportion to its uplink (with weights; equal
uplinks, equal streams), so a relay's planned per-stream rate is about its parent's, and its own
stream count is what it needs.
"""

from __future__ import annotations

from echorl.protocol.plan import BroadcastPlan

ADOPT_FLOOR = 0.8
"""The least share of its planned per-stream rate a relay keeps when it adopts nephews: with
``n`` planned streams it adopts ⌊n (1/0.8 − 1)⌋ = ⌊n/4⌋ a stripe (a full fanout-4 relay one,
a relay of three streams or fewer none). In the simulator (1,000 peers on 5–100 Mbit/s, 40 %
leaving, 3 seeds) relays adopting any later member up to ``fanout`` a stripe made it 4.1 × the
bound (slow adopters hold whole subtrees back), against 1.5 × for ancestors alone; with this
floor, 1.5 × (docs/broadcast-notes.md, "Churn with adoption")."""


def adopters(plan: BroadcastPlan, s: int, me: str) -> list[str]:
    """Whom ``me`` asks to adopt it in stripe ``s``, in order (see the module docstring), the
    learner last. Empty if ``me`` has no parent in ``s``."""
    up = plan.stripes[s].parent_of()
    parent = up.get(me)
    if parent is None:
        return []
    above = []
    a = up.get(parent)
    while a is not None and a != plan.learner and len(above) <= len(plan.peers):
        above.append(a)
        a = up.get(a)
    children = plan.stripes[s].children
    grandparent = up.get(parent)
    siblings = children.get(parent, ())
    mine = siblings.index(me)
    uncles = (
        [u for u in children.get(grandparent, ()) if u != parent and adoption_slots(plan, u)] if grandparent else []
    )
    k = mine % max(len(uncles), 1)
    earlier = list(reversed(siblings[:mine])) if not above and not uncles else []
    return [*above, *uncles[k:], *uncles[:k], *earlier, plan.learner]


def adoption_slots(plan: BroadcastPlan, relay: str) -> int:
    """Nephews ``relay`` (not the learner) may adopt a stripe: the plan's child slots it does not
    use (``BroadcastPlan.slots``: the planner counted that uplink free; in the lab a relay of
    three streams of four slots was otherwise a dead end and its nephews went to the learner),
    plus as many as leave each of its planned streams ``ADOPT_FLOOR`` of its uplink share."""
    streams = plan.streams(relay)
    return int(streams * (1 / ADOPT_FLOOR - 1) + 1e-9) + max(plan.slots.get(relay, 0) - streams, 0)


def may_adopt(order: dict[str, int], me: str, peer: str) -> bool:
    """Whether ``me`` may stream a stripe to ``peer`` off the plan at all: ``peer`` comes after
    ``me`` in the stripe's breadth-first order (``Stripe.order_of``), so streams go only forward
    in it and no two peers can wait on each other."""
    return order.get(me, len(order)) < order.get(peer, -1)


def is_nephew(up: dict[str, str], learner: str, me: str, peer: str) -> bool:
    """Whether ``me``, adopting ``peer`` (``up``: the stripe's child → parent), counts it in
    its ``adoption_slots`` rather than its ``fanout``: not the learner, not ``peer``'s ancestor
    or earlier sibling."""
    if me == learner or up.get(peer) == up.get(me):
        return False
    a = up.get(peer)
    for _ in range(len(up) + 1):  # a plan is a tree: bounded anyway
        if a is None:
            return True
        if a == me:
            return False
        a = up.get(a)
    return True
