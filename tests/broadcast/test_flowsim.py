"""bench/flowsim.py, the flow-level broadcast model, against answers known in closed form on
plans of three peers built by the real planner."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from echorl.protocol import limits
from echorl.protocol.plan import PlanPeer, plan_broadcast

# bench/ holds modules named like tests/ helpers (netlab, swarm), and flowsim puts bench/ first on
# sys.path as a script does: the path is restored after the import, so a test collected later
# still imports the tests/ helper.
_path = list(sys.path)
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import flowsim  # noqa: E402

sys.path[:] = _path

CHUNK = 64 * 1024
B = 1_000_000.0  # bytes/s
INF = float("inf")


def _peers(ups: list[float]) -> list[flowsim.Peer]:
    return [flowsim.Peer(f"p{i}", up, INF, True) for i, up in enumerate(ups)]


def _plan(peers: list[flowsim.Peer], fanout: int):
    return plan_broadcast(flowsim.LEARNER, [PlanPeer(p.peer_id) for p in peers], fanout)


def test_chain_is_the_slowest_upstream_link_plus_one_chunk_per_hop():
    # fanout 1: one stripe, a chain learner -> x -> y -> z; y and z get x's rate at most
    peers = _peers([0.25 * B, 0.5 * B, 2 * B])
    plan = _plan(peers, 1)
    x = plan.children(flowsim.LEARNER, 0)[0]
    y = plan.children(x, 0)[0]
    ups = {p.peer_id: p.up for p in peers}
    size = 12 * CHUNK
    got, no_churn, recovered, _ = flowsim.delivery(plan, peers, B, size, CHUNK)
    # each stream runs at min(its parent's uplink, the rate the parent receives)
    r_xy = min(ups[x], B)
    r_yz = min(ups[y], r_xy)
    first_x, first_y = CHUNK / B, CHUNK / B + CHUNK / r_xy
    done_y = max(first_x + size / r_xy, size / B + CHUNK / r_xy)
    done_z = max(first_y + size / r_yz, done_y + CHUNK / r_yz)
    assert r_yz < r_xy  # the plan puts the slowest uplink mid-chain: the case worth checking
    assert got == pytest.approx(done_z) and no_churn == got and recovered == 0


def test_three_stripes_of_three_peers_take_w_over_b_plus_the_fill():
    # fanout 4 over 3 peers: 3 stripes, each root forwards its third to the two others at
    # B/3 (the rate it receives it); the last chunk lands 3c/B after W/B
    peers = _peers([B, B, B])
    plan = _plan(peers, 4)
    assert [len(s.children[flowsim.LEARNER]) for s in plan.stripes] == [1, 1, 1]
    size = 3 * 4 * CHUNK
    got, *_ = flowsim.delivery(plan, peers, B, size, CHUNK)
    assert got == pytest.approx(size / B + 3 * CHUNK / B)
    assert flowsim.lower_bound(size, B, peers) == pytest.approx(size / B)


def test_without_adoption_a_relay_leaving_makes_its_subtree_stall_then_pull_the_stripe():
    # the chain's head leaves at 0: the two below hear nothing for STALL_S, then each pulls
    # the whole stripe from the other (4 requests in flight at a fair share of its uplink:
    # B / (1 tree stream or none, + 4 requests)), but not before the median member has it
    peers = _peers([B, B, B])
    plan = _plan(peers, 1)
    head = plan.children(flowsim.LEARNER, 0)[0]
    size = 12 * CHUNK
    got, no_churn, recovered, adopted = flowsim.delivery(plan, peers, B, size, CHUNK, leave_at={head: 0.0}, adopt=False)
    assert no_churn == pytest.approx(size / B + 2 * CHUNK / B)
    assert (recovered, adopted) == (2, 0)
    assert got == pytest.approx(flowsim.STALL_S + size / (4 * B / 5))


def test_the_orphan_of_a_relay_leaving_is_adopted_and_its_subtree_follows_it():
    # learner -> head -> x -> y; head leaves at 0: x hears nothing for STALL_S, then the learner
    # (x's nearest ancestor that stays) streams it the stripe at its whole uplink (its one tree
    # stream went with the head); y, still fed by x, gets each chunk a chunk-time after x
    peers = _peers([B, B, B])
    plan = _plan(peers, 1)
    head = plan.children(flowsim.LEARNER, 0)[0]
    size = 12 * CHUNK
    got, _, recovered, adopted = flowsim.delivery(plan, peers, B, size, CHUNK, leave_at={head: 0.0})
    assert (recovered, adopted) == (0, 1)
    assert got == pytest.approx(flowsim.STALL_S + size / B + CHUNK / B)


def test_an_ancestor_that_has_adopted_fanout_peers_sends_the_next_orphan_further_up_or_to_pulls():
    # learner -> h -> x -> y -> z, fanout 1: h and y leave at 0. x is adopted by the learner;
    # z's nearest ancestor that stays is x (it adopts z, fed by the learner), not the learner
    peers = _peers([B, B, B, B])
    plan = _plan(peers, 1)
    chain = [plan.children(flowsim.LEARNER, 0)[0]]
    while plan.children(chain[-1], 0):
        chain.append(plan.children(chain[-1], 0)[0])
    h, x, y, z = chain
    size = 12 * CHUNK
    got, _, recovered, adopted = flowsim.delivery(plan, peers, B, size, CHUNK, leave_at={h: 0.0, y: 0.0})
    assert (recovered, adopted) == (0, 2)
    assert got == pytest.approx(flowsim.STALL_S + size / B + CHUNK / B)  # z a chunk behind x
    # x unable to adopt (behind NAT, not dialable): the learner has adopted its one already: z pulls
    natted = [flowsim.Peer(p.peer_id, p.up, p.down, p.peer_id != x) for p in peers]
    _, _, recovered, adopted = flowsim.delivery(plan, natted, B, size, CHUNK, leave_at={h: 0.0, y: 0.0})
    assert (recovered, adopted) == (1, 1)


def test_the_announcement_down_the_plan_costs_the_learner_its_heads_copies_and_each_hop_its_forwarding():
    peers = [PlanPeer(f"p{i}") for i in range(40)]
    plan = plan_broadcast(flowsim.LEARNER, peers, 2, 0)
    up = {p.peer_id: 1000.0 for p in peers} | {flowsim.LEARNER: 4000.0}
    sends, spread = flowsim.announce_spread(plan, peers, up, 100, 0.5)
    heads = plan.children(flowsim.LEARNER, 0)
    assert sends == len(heads)
    depth0 = max(plan.stripes[0].depth_of(flowsim.LEARNER).values())
    # every hop: the receive CPU, then the forwarder's copies to its children over its uplink
    per_hop = [0.5 + len(plan.children(p, 0)) * 100 / 1000.0 for p in plan.peers]
    assert depth0 * 0.5 + sends * 100 / 4000.0 < spread <= depth0 * max(per_hop) + sends * 100 / 4000.0


def test_fair_share_gives_a_capped_flow_s_leftover_to_the_others():
    assert flowsim._water_fill(10.0, [1.0, INF, INF]) == pytest.approx([1.0, 4.5, 4.5])


def test_announcement_is_the_real_signed_message_and_flags_the_member_cap():
    def members(n: int) -> list[PlanPeer]:
        return [PlanPeer(p.peer_id, p.reachable, not p.reachable) for p in flowsim.draw_peers(n, 0.5, 5, 100, 10, 0)]

    small = flowsim.announce_cost(members(3), 4 * CHUNK, CHUNK, 4)
    assert small.valid and small.nbytes > 3 * 46 and small.receive_s is not None
    big = flowsim.announce_cost(members(limits.MAX_PLAN_MEMBERS + 1), 4 * CHUNK, CHUNK, 4)
    assert not big.valid and big.nbytes > limits.MAX_PLAN_MEMBERS * 46 and big.receive_s is None


def test_same_seed_same_prediction_and_a_cut_stream_waits_stall_s():
    argv = ["--peers", "60", "--size-mb", "4", "--churn", "0.4", "--no-announce", "--seed", "3"]
    one, two = flowsim.simulate(flowsim.parse_args(argv)), flowsim.simulate(flowsim.parse_args(argv))
    for out in (one, two):
        out.pop("plan_build_s")
    assert one == two and one["streams_recovered"] > 0
    assert one["predicted_s"] >= flowsim.STALL_S and one["ratio"] >= 1


def test_uplink_weights_bring_uneven_uplinks_near_the_bound_and_leave_even_ones_alone():
    """Issue 27: with child slots in proportion to the uplinks (5–100 Mbit/s, half NAT'd) the
    prediction is a fraction of the one with k slots each; equal uplinks give equal weights,
    so the very same plan and figure."""
    argv = ["--peers", "60", "--size-mb", "64", "--no-announce"]
    uneven = flowsim.simulate(flowsim.parse_args(argv))
    assert uneven["weights"] == "uplink" and uneven["baseline_ratio"] > 6
    assert uneven["ratio"] < 0.3 * uneven["baseline_ratio"] and uneven["ratio"] < 1.8
    assert uneven["plan_bound_s"] < uneven["baseline_plan_bound_s"] / 3
    off = flowsim.simulate(flowsim.parse_args([*argv, "--no-weights"]))
    assert off["ratio"] == uneven["baseline_ratio"] and "baseline_ratio" not in off
    even = flowsim.simulate(flowsim.parse_args([*argv, "--uplink-mbps", "20", "--uplink-max-mbps", "0"]))
    assert even["ratio"] == even["baseline_ratio"] and even["depth"] == even["baseline_depth"]


def test_weights_the_learner_measures_reach_the_uplink_weights_figure_in_one_version():
    """Planned with what the real ``UplinkMeter`` makes of the children's transit timings, the
    second version is already near the plan weighted by the true uplinks (the first has none)."""
    out = flowsim.simulate(
        flowsim.parse_args(["--peers", "60", "--size-mb", "64", "--no-announce", "--measured-versions", "2"])
    )
    first, *later = out["measured_ratios"]
    assert first == out["baseline_ratio"]
    assert all(r < 0.3 * first and r < 1.2 * out["ratio"] for r in later)


def test_the_adoption_what_ifs_change_who_adopts_and_the_default_is_the_relay_s_rule():
    """``--adopt-floor`` and ``--adopt-earlier`` (bench/flowsim.py ``Adoption``) are what-ifs for the
    next relay rule; without them the prediction is the relay's (ancestors, then the learner). A
    floor no peer's share reaches leaves adoption to the learner alone (its slots: fanout per
    stripe); members earlier in the stripe's order adopt orphans the ancestors could not."""
    common = ["--peers", "200", "--nat", "0.5", "--size-mb", "64", "--churn", "0.4", "--no-announce", "--no-baseline"]
    relay = flowsim.simulate(flowsim.parse_args(common))
    assert relay["ratio"] == flowsim.simulate(flowsim.parse_args([*common, "--adopt-floor", "0"]))["ratio"]
    assert (relay["adopt_floor"], relay["adopt_earlier"]) == (0.0, False)
    only_learner = flowsim.simulate(flowsim.parse_args([*common, "--adopt-floor", "1000"]))
    stripes = len(plan_broadcast(flowsim.LEARNER, [PlanPeer(f"p{i}") for i in range(200)], relay["fanout"]).stripes)
    assert 0 < only_learner["streams_adopted"] <= relay["fanout"] * stripes < relay["streams_adopted"]
    earlier = flowsim.simulate(flowsim.parse_args([*common, "--adopt-earlier"]))
    assert earlier["streams_adopted"] > 2 * relay["streams_adopted"]
    assert earlier["streams_recovered"] < relay["streams_recovered"] / 2
