"""The learner service's bookkeeping of peers: the liveness sweep over real libp2p hosts (a quiet
peer that answers pings stays in broadcast plans; one that is gone — holding a lease or idle — is
marked dead within seconds, its leases expired and re-queued); lease deadlines sized to the node;
and what a checkpoint keeps of the service (bans, node addresses), bad entries skipped."""

from __future__ import annotations

import time

import pytest
import trio

from echorl.learner.buffer import StalenessBuffer
from echorl.net.host import open_host
from echorl.learner.service import LearnerService, LeasePolicy, PeerRecord
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Capability


def _record(peer_id: str, quiet_for_s: float) -> PeerRecord:
    cap = Capability(engine="torch", device="cpu", memory_bytes=0, tokens_per_s=1.0, price_per_hour=0.0,
                     reachable=True, listen_addrs=[])
    then = time.monotonic() - quiet_for_s
    return PeerRecord(peer_id, cap, then, then, version=0)


def test_sweep_keeps_answering_peers_and_drops_gone_ones() -> None:
    from echorl.tasks import load_task

    async def main() -> None:
        task = load_task("addition", digits=2, seed=0)
        learner = Identity.generate()
        svc = LearnerService(learner, "run-1", task, tokenizer=None, buffer=StalenessBuffer(4, scorer=task.reward),
                             policy=LeasePolicy(liveness_after_s=0.5, ping_timeout_s=2.0), vocab_size=100)
        async with open_host(learner) as host, open_host(Identity.generate()) as up:
            svc.install(host)
            await host.connect(up.addrs[0])
            async with open_host(Identity.generate()) as idle_gone, open_host(Identity.generate()) as holder_gone:
                await host.connect(idle_gone.addrs[0])
                await host.connect(holder_gone.addrs[0])
                gone = (idle_gone.peer_id, holder_gone.peer_id)
            # both hosts are stopped now; the learner still has records for all three peers
            for pid in (up.peer_id, *gone):
                svc.peers[pid] = _record(pid, quiet_for_s=10.0)
            prompts = svc.buffer.next_prompts(task, 4)
            svc.book.issue(holder_gone.peer_id, prompts, 8, 0, time.monotonic(), timeout_s=600)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(svc.maintain, 0.1)
                with trio.fail_after(20):
                    while any(svc.peers[pid].alive for pid in gone):
                        await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
            assert svc.peers[up.peer_id].alive
            assert time.monotonic() - svc.peers[up.peer_id].last_seen < 5.0  # its ping refreshed it
            assert [n.peer_id for n in svc.broadcast_nodes()] == [up.peer_id]
            assert svc.book.expired == 1 and not svc.book.active  # the 600 s lease went at once
            requeued = svc.buffer.next_prompts(task, 4)
            assert sorted(p.prompt_id for p in requeued) == sorted(p.prompt_id for p in prompts)

    trio.run(main)


def test_lease_deadline_scales_with_the_learner_measured_rate_and_is_capped() -> None:
    from echorl.learner.admission import Admission

    adm = Admission()
    args = dict(group_size=8, max_new_tokens=256, base_s=30.0)
    # not yet measured: declared 151 tok/s, 2 prompts × 8 samples × 256 tokens ≈ 27 s → 4 × that
    assert adm.deadline("a", 2, declared_tokens_per_s=151.0, **args) == 4 * 2 * 8 * 256 / 151.0
    # a claimed 0 tok/s buys no long deadline: at most 4 × the base until the learner measured the peer
    assert adm.deadline("a", 4, declared_tokens_per_s=0.0, **args) == 120.0
    adm.on_result("fast", groups=10, issued_at=0.0, now=1.0)  # 10 groups/s, measured by the learner
    assert adm.deadline("fast", 4, declared_tokens_per_s=0.0, **args) == 30.0  # the floor
    adm.on_result("slow", groups=4, issued_at=0.0, now=40.0)  # 0.1 groups/s
    assert adm.deadline("slow", 4, declared_tokens_per_s=1e6, **args) == 160.0  # 4 × 40 s, declared ignored
    adm.on_result("crawl", groups=1, issued_at=0.0, now=1000.0)
    assert adm.deadline("crawl", 4, declared_tokens_per_s=1e6, **args) == 600.0  # capped at 20 × base


def test_lease_deadline_adds_the_time_to_load_a_version_of_the_published_size() -> None:
    """A version published mid-lease is loaded before the lease's next sample: a 60 GB model's
    leases get 10 minutes more (at 100 MB/s), past the measured-rate cap; a 2 MB one 0.02 s."""
    from echorl.learner.admission import Admission

    adm = Admission()
    args = dict(group_size=8, max_new_tokens=256, base_s=30.0, declared_tokens_per_s=0.0)
    adm.on_result("fast", groups=10, issued_at=0.0, now=1.0)
    adm.note_published(0, weights_bytes=2_000_000)
    assert adm.deadline("fast", 4, **args) == pytest.approx(30.0 + 0.02)
    adm.note_published(1)  # a delta: the model's size is unchanged
    assert adm.deadline("fast", 4, **args) == pytest.approx(30.02)
    adm.note_published(2, weights_bytes=60_000_000_000)
    assert adm.deadline("fast", 4, **args) == pytest.approx(30.0 + 600.0)
    assert adm.deadline("new", 4, **args) == pytest.approx(120.0 + 600.0)  # unmeasured: 4 × base + load


def test_checkpointed_service_state_round_trips_and_bad_entries_are_skipped() -> None:
    import json

    import pytest

    from echorl.tasks import load_task

    task = load_task("addition", digits=2, seed=0)

    def service() -> LearnerService:
        return LearnerService(Identity.generate(), "run-1", task, tokenizer=None,
                              buffer=StalenessBuffer(4, scorer=task.reward), policy=LeasePolicy(), vocab_size=100)

    old = service()
    old.peers["fresh"] = _record("fresh", quiet_for_s=1.0)
    old.peers["gone-long-ago"] = _record("gone-long-ago", quiet_for_s=3600.0)
    old.peers["fresh"].capability = old.peers["fresh"].capability.model_copy(update={"listen_addrs": ["/ip4/10.0.0.1/tcp/4001"]})
    old.mismatches = {"cheater": 3}
    saved = json.loads(json.dumps(old.state_dict()))  # what the checkpoint's state.json holds
    new = service()
    new.load_state_dict(saved)
    assert new.remembered_addrs == {"fresh": ["/ip4/10.0.0.1/tcp/4001"]}
    assert new.mismatches == {"cheater": 3} and new.banned("cheater")

    bad = service()
    state = {"logprob_mismatches": {"a": 2, "b": "x", "c": True, "d": -1}, "peer_addrs": {"p": ["/ip4/1.2.3.4/tcp/1"], "q": "x"}}
    bad.load_state_dict(state)
    assert bad.remembered_addrs == {"p": ["/ip4/1.2.3.4/tcp/1"]} and bad.mismatches == {"a": 2}
    fresh = service()
    fresh.load_state_dict({"logprob_mismatches": [1, 2], "peer_addrs": 7})  # wrong shapes: skipped
    assert fresh.remembered_addrs == {} and fresh.mismatches == {}
    for junk in ("garbage", None, {"logprob_mismatches": {}, "bans": {"x": 1}}):  # not this code's state
        fresh = service()
        with pytest.raises(ValueError, match="service state"):
            fresh.load_state_dict(junk)
        assert fresh.remembered_addrs == {} and fresh.mismatches == {}


def test_status_is_paged_with_a_cursor() -> None:
    """``Status`` holds one page of peers and where the next starts; following the cursor lists
    every peer once, and the last page has no cursor."""
    from echorl.protocol import wire
    from echorl.protocol.messages import Status, StatusRequest
    from echorl.tasks import load_task

    task = load_task("addition", digits=2, seed=0)
    svc = LearnerService(Identity.generate(), "run-1", task, tokenizer=None,
                         buffer=StalenessBuffer(4, scorer=task.reward), policy=LeasePolicy(), vocab_size=100)
    ids = [Identity.generate().peer_id for _ in range(7)]
    for pid in ids:
        svc.peers[pid] = _record(pid, quiet_for_s=0.0)

    async def page(cursor: int, limit: int) -> Status:
        req = wire.decode(wire.encode(StatusRequest(cursor=cursor, limit=limit)), expect=StatusRequest)
        reply = await svc.on_status(req, None)
        return wire.decode(wire.encode(reply), expect=Status)

    async def main() -> None:
        seen, cursor, pages = [], 0, 0
        while cursor is not None:
            st = await page(cursor, 3)
            assert len(st.peers) <= 3 and st.total_peers == 7
            seen += [p["peer_id"] for p in st.peers]
            cursor, pages = st.next_cursor, pages + 1
        assert seen == ids and pages == 3
        whole = await svc.on_status(StatusRequest(), None)  # no cursor: the first page
        assert len(whole.peers) == 7 and whole.next_cursor is None

    trio.run(main)
