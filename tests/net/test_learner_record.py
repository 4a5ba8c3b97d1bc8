"""The DHT's learner record is taken only if signed by the pinned learner and not dated in the
future. Anyone can sign a record naming itself, and a lookup keeps the newest: before this, a
record dated far in the future hid the real learner's for good."""

from __future__ import annotations

import time

import pytest
import trio

from echorl.net.host import open_host
from echorl.net.membership import Membership, _RecordValidator, find_learner, learner_key
from echorl.protocol import limits, wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import LearnerRecord

RUN = "record-test"
KEY = learner_key(RUN)


def _record(signer: Identity, created_at: float, addr: str = "/ip4/127.0.0.1/tcp/1") -> bytes:
    rec = LearnerRecord(run_id=RUN, learner_peer_id=signer.peer_id, addrs=[addr], version=0, created_at=created_at)
    return wire.encode(wire.sign(rec, signer))


def test_far_future_or_foreign_records_lose_and_are_invalid() -> None:
    learner, mallory = Identity.generate(), Identity.generate()
    now = time.time()
    real, foreign_future = _record(learner, now), _record(mallory, now + 10 * 365 * 86400)
    own_future = _record(learner, now + 10 * limits.MAX_CLOCK_SKEW_S)
    v = _RecordValidator()
    assert v.select(KEY, [real, foreign_future]) == 0  # the newest is not taken if it is from the future
    assert v.select(KEY, [own_future, real]) == 1  # even the pinned learner's own: bounded by the skew window
    with pytest.raises(ValueError):
        v.validate(KEY, own_future)
    foreign_now = _record(mallory, now + 1)
    assert v.select(KEY, [real, foreign_now]) == 1  # not pinned yet: any signer, newest wins
    v.pinned = learner.peer_id
    assert v.select(KEY, [real, foreign_now]) == 0
    with pytest.raises(ValueError):
        v.validate(KEY, foreign_now)
    v.validate(KEY, real)


def test_far_future_record_of_another_key_does_not_divert_a_node() -> None:
    """Mallory (the node's bootstrap peer, a DHT server) stores a record naming itself, dated ten
    years ahead; the pinned learner's real record is in the DHT too. The node still finds and
    connects to the pinned learner."""

    async def main() -> None:
        learner_id, mallory_id, node_id = Identity.generate(), Identity.generate(), Identity.generate()
        async with open_host(learner_id) as learner, open_host(mallory_id) as mallory, open_host(node_id) as node:
            async with trio.open_nursery() as nursery:
                dhts = {}
                for name, host in (("learner", learner), ("mallory", mallory), ("node", node)):
                    dhts[name] = Membership(host, RUN)
                    await nursery.start(dhts[name].run)
                await mallory.connect(f"{learner.addrs[0]}")
                await dhts["mallory"].add_bootstrap(learner.peer_id)
                await dhts["learner"].add_bootstrap(mallory.peer_id)
                await dhts["learner"].publish_learner_record(learner.addrs)
                fake = _record(mallory_id, time.time() + 10 * 365 * 86400, mallory.addrs[0])
                dhts["mallory"].dht.value_store.put(KEY.encode(), fake)  # mallory's own store keeps it
                dhts["node"].dht.value_store.put(KEY.encode(), fake)  # and it reached the node before it pinned
                with trio.fail_after(60):
                    found = await find_learner(node, f"{mallory.addrs[0]}", RUN, dhts["node"], pinned=learner.peer_id)
                assert found == learner.peer_id and node.is_connected(learner.peer_id)
                rec = await dhts["node"].find_learner_record()
                assert rec is not None and rec.learner_peer_id == learner.peer_id
                nursery.cancel_scope.cancel()

    trio.run(main)
