"""The learner's ledger: per-peer acceptances and rejections by reason (bounded), cost integrated
over time joined, and the learner-only estimate (learner/ledger.py)."""

from __future__ import annotations

import pytest
import trio
from swarm import capability

from echorl.learner import peers as peers_mod
from echorl.learner.ledger import Ledger
from echorl.learner.peers import PeerRecord
from echorl.protocol.identity import Identity, short_id

A, B = Identity.generate().peer_id, Identity.generate().peer_id


def test_counts_and_top_rejection() -> None:
    led = Ledger(Identity.generate(), "run-1")
    r = led.accept(A, "L-1", submitted=4, groups=3, tokens=30, behaviour_version=2, learner_version=3)
    assert (r.peer_id, r.groups, r.groups_submitted, r.tokens, r.seq) == (A, 3, 4, 30, 1)
    for reason in ("stale_version", "stale_version", "replay"):
        led.reject(A, reason)
    f = led.peer_fields(A)
    assert f["short_id"] == short_id(A) == A[-8:]
    assert (f["groups_accepted_total"], f["groups_dropped"], f["submissions_rejected"]) == (3, 1, 3)
    assert f["top_rejection"] == "stale_version" and f["rejected_replay"] == 1
    assert led.rejections_by_reason() == {"stale_version": 2, "replay": 1}
    assert led.peer_fields(B)["submissions_rejected"] == 0


def test_cost_split_per_step_per_1k_and_estimate() -> None:
    rate = [0.0]  # the learner's measured generation rate (its evaluation's), read when asked
    led = Ledger(Identity.generate(), "run-1", price_per_hour=2.0, started=0.0, learner_rate=lambda: rate[0])
    led.tick([(A, True), (B, True)], now=0.0)
    led.tick([(A, True), (B, False)], now=1800.0)  # B found dead: its time not counted
    led.tick([(A, True), (B, False)], now=3600.0)
    assert (led.accounts[A].joined_s, led.accounts[B].joined_s) == (3600.0, 0.0)
    assert led.accounts[A].cost == 0.0 == led.accounts[B].cost  # time joined is not billed: work is
    led.accounts[A].bill(3600.0, 1.0)  # an hour of accepted work at 1.0 an hour
    for _ in range(4):
        led.accept(A, "L", 8, 8, 64, 0, 1)
    assert (
        led.cost(steps=10, rollouts_accepted=32, group_size=8, now=3600.0)["cost_rollouts_on_learner_estimate"] is None
    )
    rate[0] = 256.0 / 3600.0  # the learner would need 1 h for 32 groups × 8 samples
    c = led.cost(steps=10, rollouts_accepted=32, group_size=8, now=3600.0)
    assert c["cost_learner"] == pytest.approx(2.0) and c["cost_nodes"] == pytest.approx(1.0)
    assert c["cost_total"] == pytest.approx(3.0) and c["cost_per_step"] == pytest.approx(0.3)
    assert c["cost_per_1k_rollouts"] == pytest.approx(3000.0 / 32)
    assert c["cost_rollouts_on_learner_estimate"] == pytest.approx(2.0)


def test_peer_table_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(peers_mod, "MAX_ACCOUNTS", 2)
    led = Ledger(Identity.generate(), "run-1")
    peers = [Identity.generate().peer_id for _ in range(6)]
    for p in peers[:5]:
        led.reject(p, "schema")
    assert len(led.accounts) == 2 and led.totals()["peers_untracked"] == 3
    assert led.accept(peers[5], "L", 1, 1, 1, 0, 0).seq == 1  # still answered with a receipt


def test_a_node_is_billed_for_the_paid_share_of_its_accepted_work() -> None:
    """Declared price × the seconds of work the learner accepted and paid, pro rata of the groups
    kept: half the groups kept of an hour's lease at 2.0 an hour is 1.0; nothing kept, nothing billed."""
    from echorl.actor.types import RolloutGroup, Sample

    led = Ledger(Identity.generate(), "run-1")
    led.book.add(PeerRecord(A, capability(price_per_hour=2.0), 0.0, 0.0, version=0))
    group = RolloutGroup("p0", "prompt", [1, 2], [Sample([3], [-0.1], "stop", "x")], 0)
    trio.run(led.issue, A, "L1", 2, [group], 0, 0, False, 3600.0)
    assert led.accounts[A].cost == pytest.approx(1.0)
    trio.run(led.issue, A, "L2", 2, [], 0, 0, False, 3600.0)
    assert led.accounts[A].cost == pytest.approx(1.0) and led.accounts[A].groups_accepted == 1
