"""One valid instance of every wire message, for round-trip and fuzz tests."""

import time

from echorl.protocol import messages as m
from echorl.protocol.identity import Identity
from echorl.protocol.wire import sign


def example_messages(node: Identity, learner: Identity) -> list[m.Message]:
    cap = m.Capability(
        engine="torch",
        device="cpu",
        memory_bytes=8 << 30,
        tokens_per_s=1234.5,
        price_per_hour=0.2,
        reachable=True,
        listen_addrs=["/ip4/127.0.0.1/tcp/4001"],
    )
    sample = m.Sample(token_ids=[5, 6, 7], logprobs=[-0.1, -2.0, 0.0], finish_reason="eos", reward_hint=1.0)
    digest = bytes(range(32))
    manifest = sign(
        m.Manifest(
            run_id="run-1",
            learner_peer_id=learner.peer_id,
            version=5,
            parent_version=4,
            kind="full",
            base_version=-1,
            chunk_bytes=4,
            payload_bytes=4,
            chunks=[m.ChunkRef(digest=digest, size=4)],
            tensors=[m.TensorEntry(name="w", dtype="F32", shape=[1], digest=digest)],
            result_bytes=4,
            result_digest=digest,
            created_at=time.time(),
            incarnation=b"i" * 16,
        ),
        learner,
    )
    receipt = sign(
        m.Receipt(
            run_id="run-1",
            learner_peer_id=learner.peer_id,
            peer_id=node.peer_id,
            lease_id="L-1",
            seq=7,
            groups_submitted=2,
            groups=1,
            tokens=6,
            behaviour_version=4,
            learner_version=5,
            issued_at=time.time(),
        ),
        learner,
    )
    return [
        sign(
            m.JoinRequest(
                run_id="run-1", peer_id=node.peer_id, capability=cap, version=3, timestamp=time.time(), nonce=b"n" * 16
            ),
            node,
        ),
        m.JoinAccepted(
            run_id="run-1",
            learner_peer_id=learner.peer_id,
            version=4,
            staleness_bound=2,
            heartbeat_s=1.0,
            incarnation=b"i" * 16,
        ),
        m.LeaseRequest(run_id="run-1", version=4, max_prompts=16, incarnation=b"i" * 16),
        m.Lease(
            lease_id="L-1",
            run_id="run-1",
            prompts=[m.LeasePrompt(prompt_id="p1", text="12+34=")],
            group_size=8,
            sampling=m.SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=8, stop=["\n"]),
            min_version=2,
            deadline_s=30.0,
        ),
        m.LeaseReturn(run_id="run-1", lease_ids=["L-1"]),
        sign(
            m.Submit(
                run_id="run-1",
                lease_id="L-1",
                peer_id=node.peer_id,
                behaviour_version=4,
                groups=[m.RolloutGroup(prompt_id="p1", samples=[sample, sample])],
                generate_seconds=0.5,
                nonce=b"k" * 16,
            ),
            node,
        ),
        m.SubmitAccepted(lease_id="L-1", accepted=1, version=5, receipt=receipt),
        receipt,
        manifest,
        m.ChunkRequest(digest=digest),
        m.Chunk(digest=digest, data=b"abcd"),
        m.StatusRequest(),
        m.Status(
            run_id="run-1",
            learner={"step": 3, "reward": 0.5, "ok": True, "note": None},
            peers=[{"peer_id": node.peer_id, "tokens_per_s": 10.0}],
        ),
        m.Error(code="schema", detail="missing field"),
        sign(
            m.PlanAnnounce(
                run_id="run-1",
                learner_peer_id=learner.peer_id,
                version=5,
                manifest=manifest,
                shape="striped",
                fanout=4,
                seed=5,
                learner_addrs=["/ip4/127.0.0.1/tcp/4000"],
                members=[m.PlanMember(peer_id=node.peer_id, reachable=True, addrs=["/ip4/127.0.0.1/tcp/4001"])],
                created_at=time.time(),
            ),
            learner,
        ),
        m.Subscribe(run_id="run-1", version=5, stripe=1),
        m.BroadcastDone(
            run_id="run-1",
            version=5,
            ok=True,
            seconds=1.5,
            recovered_chunks=2,
            suspects=[learner.peer_id],
            detail="parent stalled",
        ),
        m.BroadcastAck(run_id="run-1", version=5, have_version=5),
        m.AnnounceHeard(run_id="run-1", version=5),
        m.CatchUpRequest(run_id="run-1", have_version=-1),
        m.CatchUp(run_id="run-1", manifests=[manifest]),
        m.StreamTicket(ticket=b"t" * 16, port=4002),
        sign(
            m.LearnerRecord(
                run_id="run-1",
                learner_peer_id=learner.peer_id,
                addrs=["/ip4/127.0.0.1/tcp/4001"],
                version=5,
                created_at=time.time(),
            ),
            learner,
        ),
        m.LeaseDeferred(run_id="run-1", reason="weights_too_old", want_version=3, retry_after_s=0.0),
        sign(
            m.RunEnded(
                run_id="run-1",
                learner_peer_id=learner.peer_id,
                version=40,
                steps=40,
                leases_done=7,
                groups_accepted=50,
                timestamp=time.time(),
            ),
            learner,
        ),
        m.DialBackRequest(addrs=["/ip4/198.18.0.2/tcp/4002"]),
        m.DialBackResult(reachable=False, seen_ip="198.18.0.254"),
    ]
