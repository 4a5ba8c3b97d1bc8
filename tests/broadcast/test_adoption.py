"""Adoption (``broadcast/stripe_feed.py``, ``broadcast/adoption.py``): a relay whose plan parent
fails takes the rest of the stripe from the first that adopts it. Here the rule each adopter
applies (``VersionState.adopt``: its plan children; per stripe at most ``fanout`` descendants
and later siblings, ``adoption_slots`` nephews; never a member before it in the stripe's
order), whom an orphan asks (``adopters``: ancestors, uncles, a stripe head's orphans their
earlier siblings, the learner last) and for what (the chunks it lacks), and a stalled parent
that is alive asked once more before its subtree walks away."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import trio
from swarm import safetensors_f32
from trio.testing import memory_stream_pair

from echorl.broadcast.adoption import adopters, adoption_slots
from echorl.broadcast.deadlines import Deadlines
from echorl.broadcast.store import VersionState, WeightStore, chunk_body
from echorl.broadcast.stripe_feed import StripeFeed
from echorl.net.host import PeerUnavailable
from echorl.net.transport import FramedStream, TcpStreamAdapter
from echorl.protocol import snapshot
from echorl.protocol.identity import Identity
from echorl.protocol.messages import PlanAnnounce, PlanMember

FANOUT = 2


CHUNK = 16 * 1024
DATA = safetensors_f32(np.arange(64 * 1024, dtype=np.float32))


def _announce(n_members: int, fanout: int = FANOUT) -> tuple[PlanAnnounce, Identity]:
    learner = Identity.generate()
    manifest = snapshot.build_manifest(learner, "r", 1, -1, DATA, DATA, chunk_bytes=CHUNK)[0]
    members = [PlanMember(peer_id=Identity.generate().peer_id, reachable=True, addrs=[]) for _ in range(n_members)]
    ann = PlanAnnounce(
        run_id="r",
        learner_peer_id=learner.peer_id,
        version=1,
        manifest=manifest,
        shape="striped",
        fanout=fanout,
        seed=0,
        learner_addrs=[],
        members=members,
        created_at=0.0,
    )
    return ann, learner


def _state(ann: PlanAnnounce, me: str) -> VersionState:
    return VersionState(ann, me, WeightStore())


def test_an_orphan_asks_its_ancestors_nearest_first_and_the_learner_last() -> None:
    ann, learner = _announce(14)
    view = _state(ann, learner.peer_id)
    up = view.plan.stripes[0].parent_of()
    deepest = max(up, key=lambda p: view.plan.stripes[0].depth_of(learner.peer_id)[p])
    chain = _state(ann, deepest).ancestors(0)
    assert chain[0] == up[deepest] and chain[-1] == learner.peer_id and len(chain) >= 3
    assert all(up[a] == b for a, b in zip(chain, chain[1:]))  # each the parent of the one before


def test_an_ancestor_adopts_at_most_fanout_descendants_per_stripe_and_no_one_before_it() -> None:
    ann, learner = _announce(14)
    stripe = _state(ann, learner.peer_id).plan.stripes[0]
    up = stripe.parent_of()
    order = stripe.order_of(learner.peer_id)
    below = {p: [c for c in up if _descends(up, c, p)] for p in up}
    # a relay with grandchildren enough, and peers before it in the stripe's order
    relay = next(p for p in up if FANOUT + 1 < len(below[p]) < len(up) - 1)
    mine = _state(ann, relay)
    descendants = [c for c in below[relay] if c not in stripe.children[relay]]
    before = [p for p in up if order[p] < order[relay]]
    assert len(descendants) > FANOUT and before
    assert all(mine.adopt(0, c) for c in stripe.children[relay])  # plan children: always
    assert not any(mine.adopt(0, p) for p in before)  # before it in this stripe: never
    assert [mine.adopt(0, d) for d in descendants] == [True] * FANOUT + [False] * (len(descendants) - FANOUT)
    assert mine.adopt(0, descendants[0])  # one adopted may subscribe again (a retry)
    assert not mine.adopt(0, learner.peer_id)


def test_a_relay_adopts_nephews_only_within_its_adoption_slots() -> None:
    """A relay's nephews (its siblings' children) count against ``adoption_slots``: ⌊streams/4⌋
    a stripe (each of its own streams keeps 4/5 of its rate), not ``fanout``, plus the child
    slots the plan gave it and it does not use (a relay of three streams of four slots: one)."""
    ann, learner = _announce(60, fanout=4)
    plan = _state(ann, learner.peer_id).plan
    stripe = plan.stripes[0]
    up = stripe.parent_of()

    def nephews(p: str) -> list[str]:
        return [c for u in stripe.children.get(up[p], ()) if u != p for c in stripe.children.get(u, ())]

    busy = next(p for p in up if plan.streams(p) == plan.slots[p] == 4 and len(nephews(p)) > 1)
    assert adoption_slots(plan, busy) == 1
    mine = _state(ann, busy)
    got = [mine.adopt(0, n) for n in nephews(busy)]
    assert got == [True] + [False] * (len(got) - 1)
    spare = next(p for p in up if plan.streams(p) == 3 and plan.slots[p] == 4 and len(nephews(p)) > 1)
    assert adoption_slots(plan, spare) == 1  # ⌊3/4⌋ = 0, and the slot it does not use
    mine = _state(ann, spare)
    assert [mine.adopt(0, n) for n in nephews(spare)[:2]] == [True, False]


def test_an_orphan_asks_its_ancestors_then_its_uncles_each_sibling_from_a_different_one() -> None:
    ann, learner = _announce(60, fanout=4)
    plan = _state(ann, learner.peer_id).plan
    stripe = plan.stripes[0]
    up = stripe.parent_of()
    depth = stripe.depth_of(learner.peer_id)
    # a parent two below the head with two children or more, and uncles that may adopt
    parent = next(
        p
        for p, d in depth.items()
        if d == 3
        and len(stripe.children.get(p, ())) >= 2
        and sum(adoption_slots(plan, u) > 0 for u in stripe.children[up[p]]) >= 3
    )
    first, second = stripe.children[parent][:2]
    uncles = [u for u in stripe.children[up[parent]] if u != parent and adoption_slots(plan, u) > 0]
    asked = adopters(plan, 0, first)
    assert asked[:2] == [up[parent], up[up[parent]]]  # grandparent, then the head
    assert sorted(asked[2:-1]) == sorted(uncles) and asked[-1] == learner.peer_id
    assert adopters(plan, 0, second)[2] != asked[2]  # the next orphan starts at another uncle


def test_a_stripe_head_s_orphans_ask_the_siblings_before_them_and_only_a_later_sibling_is_adopted() -> None:
    ann, learner = _announce(14)
    plan = _state(ann, learner.peer_id).plan
    head = plan.stripes[0].children[learner.peer_id][0]
    first, second = plan.stripes[0].children[head][:2]
    assert adopters(plan, 0, second) == [first, learner.peer_id]
    assert adopters(plan, 0, first) == [learner.peer_id]
    assert _state(ann, first).adopt(0, second)  # down the sibling order: yes
    assert not _state(ann, second).adopt(0, first)  # up it: never (no two peers wait on each other)


def _descends(up: dict[str, str], peer: str, ancestor: str) -> bool:
    while peer in up:
        peer = up[peer]
        if peer == ancestor:
            return True
    return False


def test_an_orphan_skips_the_chunks_it_holds_in_stripe_order() -> None:
    ann, learner = _announce(3)
    state = _state(ann, ann.members[0].peer_id)
    idx = list(state.stripe_indices(1))
    assert len(idx) >= 3
    assert state.held_prefix(1) == 0
    state.have[idx[0]] = state.have[idx[2]] = 1  # the first and the third (a pull filled a gap)
    assert state.held_prefix(1) == 1
    state.have[idx[1]] = 1
    assert state.held_prefix(1) == 3


@pytest.mark.parametrize("parent_alive", [True, False])
def test_a_stalled_parent_that_answers_a_ping_is_asked_once_more_else_an_ancestor_adopts(parent_alive) -> None:
    """The parent sends a stripe's first chunk and goes quiet. Alive (it answers a ping: it may be
    being adopted itself), it is asked again for the rest and is no suspect; dead, it is the
    suspect and the next ancestor up is asked for the rest."""
    ann, learner = _announce(14)
    view = _state(ann, learner.peer_id)
    depth = view.plan.stripes[0].depth_of(learner.peer_id)
    up = view.plan.stripes[0].parent_of()
    me = next(p for p, d in depth.items() if d >= 3 and view.plan.stripes[0].children[up[p]][0] == p)
    state = _state(ann, me)
    parent, grandparent = state.ancestors(0)[:2]
    assert adopters(state.plan, 0, me)[0] == grandparent  # its grandparent is the first it asks
    stripe = list(state.stripe_indices(0))
    assert len(stripe) >= 2
    bodies = [
        chunk_body(ref.digest, DATA[i * CHUNK : i * CHUNK + ref.size]) for i, ref in enumerate(ann.manifest.chunks)
    ]
    asked: list[tuple[str, int]] = []
    ends = []

    async def open_source(source: str, _state: VersionState, s: int, skip: int = 0) -> FramedStream:
        ours, theirs = memory_stream_pair()
        ends.append(theirs)  # kept open: a quiet stream, not a closed one
        send = stripe[:1] if not asked else stripe[skip:]
        asked.append((source, skip))
        for i in send:
            await theirs.send_all(len(bodies[i]).to_bytes(4, "big") + bodies[i])
        return FramedStream(TcpStreamAdapter(ours), io_timeout=10.0)

    async def ping(peer: str, timeout: float) -> float:
        if not parent_alive:
            raise PeerUnavailable("gone")
        return 0.001

    host = SimpleNamespace(peer_id=me, ping=ping)
    feed = StripeFeed(host, "r", None, None, Deadlines(base_s=1.0), stall_s=0.3, announce_wait_s=1.0)  # type: ignore[arg-type]
    feed.open_source = open_source  # type: ignore[method-assign]
    suspects: set[str] = set()

    async def main() -> None:
        with trio.fail_after(10):
            await feed.receive(state, 0, suspects, [0])

    trio.run(main)
    assert state.stripe_complete(0)
    if parent_alive:
        assert asked == [(parent, 0), (parent, 1)] and suspects == set() and feed.adopted == 0
    else:
        assert asked == [(parent, 0), (grandparent, 1)] and suspects == {parent} and feed.adopted == 1
