"""Broadcast plan properties: coverage, depth, reachability, per-peer upload."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echorl.protocol.plan import PlanPeer, plan_broadcast

LEARNER = "learner"


def peers_strategy(min_size=0):
    """Reachable peers, unreachable leaves and unreachable pushers (NAT'd, dialling out)."""
    return st.lists(st.sampled_from(["reachable", "leaf", "pusher"]), min_size=min_size, max_size=80).map(
        lambda kinds: [
            PlanPeer(f"peer-{i}", reachable=k == "reachable", pushes=k == "pusher") for i, k in enumerate(kinds)
        ]
    )


def received(plan, stripe):
    counts = {}
    for _parent, children in plan.stripes[stripe].children.items():
        for child in children:
            counts[child] = counts.get(child, 0) + 1
    return counts


@settings(max_examples=200, deadline=None)
@given(peers_strategy(), st.integers(1, 6), st.integers(0, 10**6), st.booleans())
def test_every_peer_gets_every_chunk_exactly_once(peers, fanout, seed, striped):
    plan = plan_broadcast(LEARNER, peers, fanout, seed, striped)
    ids = {p.peer_id for p in peers}
    for chunk in range(3 * len(plan.stripes)):
        counts = received(plan, plan.stripe_of_chunk(chunk))
        assert set(counts) == ids and all(c == 1 for c in counts.values())
        assert LEARNER not in counts
        depth = plan.stripes[plan.stripe_of_chunk(chunk)].depth_of(LEARNER)
        assert set(depth) == ids | {LEARNER}  # connected: everyone reachable from the learner


@settings(max_examples=200, deadline=None)
@given(peers_strategy(min_size=1), st.integers(2, 6), st.integers(0, 10**6), st.booleans())
def test_no_edge_needs_a_dial_to_an_unreachable_peer(peers, fanout, seed, striped):
    """Unreachable leaves are never interior; a pusher's children are all reachable (it dials
    them); so no edge joins two unreachable peers, and ``pushed`` names exactly those edges."""
    plan = plan_broadcast(LEARNER, peers, fanout, seed, striped)
    unreachable = {p.peer_id for p in peers if not p.reachable}
    leaves = {p.peer_id for p in peers if not p.reachable and not p.pushes}
    assert plan.unreachable == unreachable
    for stripe in plan.stripes:
        assert not leaves & set(stripe.children)
        for parent, children in stripe.children.items():
            for child in children:
                if parent != LEARNER:
                    assert parent not in unreachable or child not in unreachable
                assert plan.pushed(parent, child) == (parent in unreachable)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 120), st.integers(0, 120), st.integers(2, 6), st.integers(0, 10**6))
def test_pushers_never_cost_the_learner_or_the_busiest_peer_more(n_pub, n_nat, fanout, seed):
    """Letting NAT'd peers push relieves the reachable ones: neither the learner's upload nor
    the busiest peer's grows compared with the same peers as plain leaves."""

    def plan(push):
        peers = [PlanPeer(f"p{i}") for i in range(n_pub)] + [PlanPeer(f"n{i}", False, push) for i in range(n_nat)]
        built = plan_broadcast(LEARNER, peers, fanout, seed)
        return built.upload_copies(LEARNER), max((built.upload_copies(p.peer_id) for p in peers), default=0)

    (learner_leaf, busiest_leaf), (learner_push, busiest_push) = plan(False), plan(True)
    assert learner_push <= learner_leaf + 1e-9
    assert busiest_push <= busiest_leaf + 1e-9


def test_half_nat_pushers_spread_the_upload_evenly():
    """The lab's case (4 public, 4 NAT'd, k = 4): one copy from the learner, nobody above one."""
    peers = [PlanPeer(f"p{i}") for i in range(4)] + [PlanPeer(f"n{i}", False, True) for i in range(4)]
    plan = plan_broadcast(LEARNER, peers, 4)
    assert plan.upload_copies(LEARNER) == 1.0
    assert all(plan.upload_copies(p.peer_id) <= 1.0 for p in peers)
    assert sum(plan.upload_copies(p.peer_id) for p in peers if not p.reachable) == 3.0  # NAT'd uplinks carry


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.integers(2, 6), st.integers(0, 10**6), st.booleans())
def test_depth_is_logarithmic_when_all_reachable(n, fanout, seed, striped):
    peers = [PlanPeer(f"p{i}") for i in range(n)]
    plan = plan_broadcast(LEARNER, peers, fanout, seed, striped)
    assert plan.depth <= math.ceil(math.log(n, fanout)) + 1


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 200), st.integers(2, 6), st.integers(0, 10**6))
def test_striped_plan_uploads_about_one_copy_per_peer(n, fanout, seed):
    peers = [PlanPeer(f"p{i}") for i in range(n)]
    plan = plan_broadcast(LEARNER, peers, fanout, seed, striped=True)
    assert plan.upload_copies(LEARNER) == 1.0
    uploads = [plan.upload_copies(p.peer_id) for p in peers]
    # k child slots per peer across all stripes = one copy; a peer borrowed to fill a short
    # stripe group uses its spare slots (or, at worst, one stripe's extra share).
    assert max(uploads) <= 1 + 1 / fanout + 1e-9
    assert sum(uploads) / n <= 1.0
    single = plan_broadcast(LEARNER, peers, fanout, seed, striped=False)
    if n > fanout + 1:  # a single tree makes its interior peers upload k copies
        assert max(single.upload_copies(p.peer_id) for p in peers) == fanout


def test_plan_is_deterministic_and_order_independent():
    peers = [PlanPeer(f"p{i}", reachable=i % 3 != 0) for i in range(40)]
    a = plan_broadcast(LEARNER, peers, 4, seed=7)
    b = plan_broadcast(LEARNER, list(reversed(peers)), 4, seed=7)
    c = plan_broadcast(LEARNER, peers, 4, seed=8)
    assert a == b and a != c


def test_no_reachable_peer_means_learner_serves_all():
    peers = [PlanPeer(f"p{i}", reachable=False) for i in range(5)]
    plan = plan_broadcast(LEARNER, peers, 3)
    for stripe in plan.stripes:
        assert set(stripe.children) == {LEARNER}


@pytest.mark.parametrize("n,fanout", [(4, 5), (5, 6), (2, 6)])
def test_fewer_peers_than_fanout_is_one_hop_from_a_stripe_root(n, fanout):
    # hypothesis once found n=4, k=5 planned as a chain of depth 3 (spare slots borrowed)
    peers = [PlanPeer(f"p{i}") for i in range(n)]
    plan = plan_broadcast(LEARNER, peers, fanout, 0, striped=True)
    assert plan.depth == 2 and plan.upload_copies(LEARNER) == 1.0
    assert max(plan.upload_copies(p.peer_id) for p in peers) <= 1.0


def test_pushes_is_left_out_of_the_signed_bytes_unless_set():
    """``PlanMember.pushes`` is optional on the wire: an announce without pushers encodes
    byte for byte as before the field existed."""
    from echorl.protocol.messages import PlanMember

    plain = PlanMember(peer_id="p" * 46, reachable=True, addrs=[])
    assert "pushes" not in plain.model_dump()
    pusher = PlanMember(peer_id="p" * 46, reachable=False, addrs=[], pushes=True)
    assert pusher.model_dump()["pushes"] is True


def test_auto_chunk_size_keeps_the_pipeline_fill_small():
    from echorl.protocol.plan import AUTO_CHUNK_MAX, AUTO_CHUNK_MIN, auto_chunk_bytes, expected_depth

    assert expected_depth(8, 4) == 3 and expected_depth(16, 4) == 3 and expected_depth(17, 4) == 4
    sizes = []
    for mb in (1, 8, 64, 512, 4096, 65536):
        w = mb * 2**20
        c = auto_chunk_bytes(w, 16, 4)
        assert AUTO_CHUNK_MIN <= c <= AUTO_CHUNK_MAX and c & (c - 1) == 0  # a power of two in range
        if AUTO_CHUNK_MIN < c < AUTO_CHUNK_MAX:  # not clamped: fill (depth−1)·c·k ≤ W/16
            assert (expected_depth(16, 4) - 1) * c * 4 <= w / 16
        sizes.append(c)
    assert sizes == sorted(sizes) and sizes[0] == AUTO_CHUNK_MIN and sizes[-1] == AUTO_CHUNK_MAX
