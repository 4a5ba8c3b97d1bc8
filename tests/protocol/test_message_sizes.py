"""No message grows past the frame cap with the model size or the peer count: the sizes of a
``CatchUp`` page for a 60 GB model and of ``Status`` pages for 100 000 peers, computed."""

from __future__ import annotations

import os

from echorl.broadcast.chunk_server import catch_up_page
from echorl.protocol import limits, snapshot, wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import CatchUp, ChunkRef, Manifest, Status, TensorEntry

GB = 1_000_000_000


def _manifest(identity: Identity, version: int, payload_bytes: int, n_tensors: int, kind: str = "full") -> Manifest:
    """A manifest of the shape a model of ``payload_bytes`` gets (digests random: only sizes matter)."""
    chunk = limits.DEFAULT_CHUNK_BYTES
    n = -(-payload_bytes // chunk)
    sizes = [chunk] * (n - 1) + [payload_bytes - chunk * (n - 1)]
    tensors = [
        TensorEntry(
            name=f"model.layers.{i // 9}.mlp.gate_proj.weight.{i}",
            dtype="BF16",
            shape=[8192, 28672],
            digest=os.urandom(32),
        )
        for i in range(n_tensors)
    ]
    return wire.sign(
        Manifest(
            run_id="run",
            learner_peer_id=identity.peer_id,
            version=version,
            parent_version=version - 1,
            kind=kind,
            base_version=-1 if kind == "full" else version - 1,
            chunk_bytes=chunk,
            payload_bytes=payload_bytes,
            chunks=[ChunkRef(digest=os.urandom(32), size=s) for s in sizes],
            tensors=tensors,
            result_bytes=60 * GB,
            result_digest=os.urandom(32),
            created_at=0.0,
        ),
        identity,
    )


def test_a_catch_up_page_of_a_60_gb_model_fits_the_frame_cap():
    """The newest full snapshot of a 60 GB bf16 model (~229k chunks, 1 000 tensors) and deltas
    after it: each page is one frame under the cap, and the pages together carry the chain."""
    learner = Identity.generate()
    full = _manifest(learner, 10, 60 * GB, 1000)
    deltas = [_manifest(learner, v, 2 * GB, 1000, kind="delta") for v in range(11, 15)]
    run = [full, *deltas]
    estimate = snapshot.manifest_wire_bytes(full)
    assert len(wire.encode(full)) <= estimate  # the paging estimate is an upper bound

    sent: list[int] = []
    while run:
        page = catch_up_page(run)
        frame = wire.encode(CatchUp(run_id="run", manifests=page, more=len(page) < len(run)))
        assert len(frame) <= limits.MAX_FRAME_BYTES, len(frame)
        assert len(page) == 1 or sum(map(snapshot.manifest_wire_bytes, page)) <= limits.CATCHUP_PAGE_BYTES
        sent += [m.version for m in page]
        run = run[len(page) :]
    assert sent == list(range(10, 15))
    decoded = wire.decode(wire.encode(CatchUp(run_id="run", manifests=[full])), expect=CatchUp)
    assert decoded.manifests[0].payload_bytes == 60 * GB


def _peer_entry(i: int) -> dict:
    """What the learner sends per peer (``LearnerService.status``), with the longest values."""
    return {
        "peer_id": "12D3KooW" + "x" * 44,
        "device": "cuda:NVIDIA H200 141GB HBM3e" + "-" * 40,
        "engine": "vllm-0.6.3.post1+cu124",
        "version": 2**40 + i,
        "tokens_per_s": 123456.7,
        "price_per_hour": 12.5,
        "leases": 64,
        "leases_done": 2**40,
        "groups_accepted": 2**40,
        "rollouts_per_s": 1234.567,
        "last_seen_s": 86400.25,
        "alive": True,
        "logprob_mismatches": 2**20,
        "banned": False,
        "standby": False,
    }


def test_status_pages_of_100k_peers_each_fit_the_frame_cap():
    learner = {f"metric_{i}": float(i) for i in range(128)}
    total = 100_000
    page = limits.MAX_STATUS_PAGE
    frame = wire.encode(
        Status(
            run_id="run",
            learner=learner,
            peers=[_peer_entry(i) for i in range(page)],
            next_cursor=page,
            total_peers=total,
        )
    )
    assert len(frame) <= limits.MAX_FRAME_BYTES // 8, len(frame)  # ~0.3 KiB a peer
    pages = -(-total // page)
    assert pages * page >= total
    last = Status(run_id="run", learner={}, peers=[_peer_entry(0)], total_peers=total)
    assert wire.decode(wire.encode(last), expect=Status).next_cursor is None


def _announce(learner: Identity, manifest: Manifest, members: list) -> bytes:
    from echorl.protocol.messages import PlanAnnounce

    ann = PlanAnnounce(
        run_id="run",
        learner_peer_id=learner.peer_id,
        version=manifest.version,
        manifest=manifest,
        shape="striped",
        fanout=4,
        seed=0,
        learner_addrs=["/dns4/" + "l" * 200 + "/tcp/40001"] * 16,
        members=members,
        created_at=0.0,
    )
    return wire.encode(wire.sign(ann, learner))


def test_a_plan_announce_fitted_by_the_learner_fits_the_frame_cap():
    """The announce carries the whole manifest and member list in one frame: at 60 GB and the most
    members it allows, each with 16 of the longest addresses, the learner's fitting
    (``broadcast/members.py``) keeps it under the cap by trimming addresses, then members; 10,000
    members with two ordinary addresses each and a 1 GiB model keep everything."""
    from echorl.broadcast.members import announce_room, fit_addrs
    from echorl.protocol.messages import PlanMember

    learner = Identity.generate()
    ids = [Identity.generate().peer_id for _ in range(64)]

    huge = _manifest(learner, 10, 60 * GB, 1000)
    longest = ["/dns4/" + "a" * (limits.MAX_ADDR_BYTES - 16) + "/tcp/1"] * 16
    worst = [PlanMember(peer_id=ids[i % 64], reachable=True, addrs=longest) for i in range(limits.MAX_PLAN_MEMBERS)]
    fitted = fit_addrs(worst, announce_room(huge))
    assert 0 < len(fitted) < len(worst) and all(len(m.addrs) == 1 for m in fitted)
    assert len(_announce(learner, huge, fitted)) <= limits.MAX_FRAME_BYTES

    gib = _manifest(learner, 11, 1 << 30, 300)
    ordinary = [
        PlanMember(peer_id=ids[i % 64], reachable=True, addrs=[f"/ip4/203.0.{i >> 8}.{i & 255}/tcp/40001"] * 2)
        for i in range(10_000)
    ]
    assert fit_addrs(ordinary, announce_room(gib)) == ordinary
    assert len(_announce(learner, gib, ordinary)) <= limits.MAX_FRAME_BYTES
