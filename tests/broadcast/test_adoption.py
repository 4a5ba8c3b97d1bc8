"""Adoption (``broadcast/stripe_feed.py``): a relay whose plan parent fails takes the rest of
the stripe from the nearest ancestor that adopts it. Here the rule each ancestor applies
(``VersionState.adopt``: its plan children, and at most ``fanout`` descendants per stripe) and
what an orphan asks for (its ancestors in order; the chunks it lacks), and a stalled parent
that is alive asked once more before its subtree walks away."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import trio
from swarm import safetensors_f32
from trio.testing import memory_stream_pair

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


def _announce(n_members: int) -> tuple[PlanAnnounce, Identity]:
    learner = Identity.generate()
    manifest = snapshot.build_manifest(learner, "r", 1, -1, DATA, DATA, chunk_bytes=CHUNK)[0]
    members = [PlanMember(peer_id=Identity.generate().peer_id, reachable=True, addrs=[]) for _ in range(n_members)]
    ann = PlanAnnounce(
        run_id="r",
        learner_peer_id=learner.peer_id,
        version=1,
        manifest=manifest,
        shape="striped",
        fanout=FANOUT,
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


def test_an_ancestor_adopts_at_most_fanout_descendants_per_stripe_and_no_one_else() -> None:
    ann, learner = _announce(14)
    stripe = _state(ann, learner.peer_id).plan.stripes[0]
    up = stripe.parent_of()
    below = {p: [c for c in up if _descends(up, c, p)] for p in up}
    # a relay with grandchildren enough, and peers outside its subtree
    relay = next(p for p in up if FANOUT + 1 < len(below[p]) < len(up) - 1)
    mine = _state(ann, relay)
    descendants = [c for c in below[relay] if c not in stripe.children[relay]]
    outsiders = [p for p in up if p != relay and p not in below[relay]]
    assert len(descendants) > FANOUT and outsiders
    assert all(mine.adopt(0, c) for c in stripe.children[relay])  # plan children: always
    assert not mine.adopt(0, outsiders[0])  # not below it in this stripe: never
    assert [mine.adopt(0, d) for d in descendants] == [True] * FANOUT + [False] * (len(descendants) - FANOUT)
    assert mine.adopt(0, descendants[0])  # one adopted may subscribe again (a retry)
    assert not mine.adopt(0, learner.peer_id)


def test_an_orphan_asks_the_siblings_before_it_and_only_a_later_sibling_is_adopted() -> None:
    ann, learner = _announce(14)
    stripe = _state(ann, learner.peer_id).plan.stripes[0]
    parent = next(p for p, cs in stripe.children.items() if len(cs) == FANOUT and p != learner.peer_id)
    first, second = stripe.children[parent]
    assert _state(ann, second).earlier_siblings(0) == [first]
    assert _state(ann, first).earlier_siblings(0) == []
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
    assert state.earlier_siblings(0) == []  # a first child: its grandparent is the first it asks
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
