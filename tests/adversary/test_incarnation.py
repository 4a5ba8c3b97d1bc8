"""A learner restarted with ``--resume`` from an older checkpoint signs new weights under the
version numbers of the branch it abandoned. Each learner process has a random incarnation, signed
into its manifests and named in ``JoinAccepted``: a node refuses manifests of another incarnation
(broadcast, catch-up, its own disk), drops a version it holds of another one on joining, and the
learner refuses leases and submissions against another incarnation's versions."""

from __future__ import annotations

import secrets
from types import SimpleNamespace

import pytest
import torch
import trio
from swarm import signed_submit
from test_hostile_rollouts import RUN, _code, _join, _lease, _service, tiny  # noqa: F401 - fixture

from echorl.broadcast.relay import Relay
from echorl.net.host import RequestContext
from echorl.node.versions import NodeWeights
from echorl.protocol import routes, snapshot, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import LeaseDeferred, LeaseRequest, PlanAnnounce, PlanMember

OLD, NEW = secrets.token_bytes(16), secrets.token_bytes(16)


def _version(learner: Identity, version: int, incarnation: bytes | None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    data = snapshot.state_dict_to_safetensors({"w": torch.randn(16, 8, generator=g)})
    manifest, _ = snapshot.build_manifest(learner, RUN, version, version - 1, data, data, incarnation=incarnation)
    return manifest, data


def test_manifest_of_another_incarnation_is_refused() -> None:
    learner = Identity.generate()
    old, _ = _version(learner, 5, OLD)
    snapshot.verify_manifest(old, learner.peer_id, RUN, OLD)
    snapshot.verify_manifest(old, learner.peer_id, RUN)  # not joined yet: signer and run only
    with pytest.raises(ProtocolError) as err:
        snapshot.verify_manifest(old, learner.peer_id, RUN, NEW)
    assert err.value.code == ErrorCode.WRONG_INCARNATION
    unnamed, _ = _version(learner, 5, None)  # from before incarnations: not this learner's either
    with pytest.raises(ProtocolError):
        snapshot.verify_manifest(unnamed, learner.peer_id, RUN, NEW)
    forged = old.model_copy(update={"incarnation": NEW})  # the incarnation is signed
    with pytest.raises(ProtocolError) as err:
        snapshot.verify_manifest(forged, learner.peer_id, RUN, NEW)
    assert err.value.code == ErrorCode.BAD_SIGNATURE


def test_node_drops_an_abandoned_branch_and_refuses_its_manifests(tmp_path) -> None:
    learner, me = Identity.generate(), Identity.generate()

    async def main() -> None:
        host = SimpleNamespace(peer_id=me.peer_id, add_peer_addrs=lambda *a: None)
        relay = Relay(host, learner.peer_id, RUN, store_dir=tmp_path / "store")
        old, data = _version(learner, 5, OLD)
        assert await relay.adopt(5, data, old)  # e.g. the node's on-disk snapshot
        assert relay.server.chain.manifest(5) is not None  # served to peers catching up
        weights = NodeWeights(host, RUN, backend=None, relay=relay, version=5, incarnation=OLD)
        weights.joined(learner.peer_id, OLD)  # same learner process: kept
        assert weights.version == 5 and relay.version == 5
        weights.joined(learner.peer_id, NEW)  # the learner restarted: v5 is the abandoned branch's
        assert weights.version == -1 and relay.version == -1 and weights.incarnation is None
        assert relay.server.chain.manifest(5) is None  # never served again
        ctx = RequestContext(peer_id=learner.peer_id, protocol=routes.ANNOUNCE, received_at=0.0)
        members = [PlanMember(peer_id=me.peer_id, reachable=True, addrs=[])]

        def announce(manifest):
            return wire.sign(
                PlanAnnounce(
                    run_id=RUN,
                    learner_peer_id=learner.peer_id,
                    version=manifest.version,
                    manifest=manifest,
                    shape="star",
                    fanout=1,
                    seed=0,
                    learner_addrs=[],
                    members=members,
                    created_at=0.0,
                ),
                learner,
            )

        stale, _ = _version(learner, 6, OLD, seed=1)  # a late announce of the old branch
        with pytest.raises(ProtocolError) as err:
            await relay._on_announce(announce(stale), ctx)
        assert err.value.code == ErrorCode.WRONG_INCARNATION and 6 not in relay.server.states
        assert not await relay._follow_chain([stale], [])  # nor taken from a catch-up answer
        fresh, _ = _version(learner, 6, NEW, seed=2)
        await relay._on_announce(announce(fresh), ctx)
        assert 6 in relay.server.states

    trio.run(main)


def test_learner_refuses_leases_and_submissions_of_another_incarnation(tiny) -> None:  # noqa: F811
    async def main() -> None:
        svc = _service(tiny)
        svc.note_published(0)
        me = Identity.generate()
        ctx = _join(svc, me)
        reply = await svc.on_lease(LeaseRequest(run_id=RUN, version=0, max_prompts=2, incarnation=OLD), ctx)
        assert isinstance(reply, LeaseDeferred) and reply.reason == "weights_unknown"
        lease = await _lease(svc, ctx)
        code = await _code(
            svc.on_submit(signed_submit(me, lease, 0, token_ids=(4,), logprobs=(-1.0,), incarnation=OLD), ctx)
        )
        assert code == "wrong_incarnation" and len(svc.buffer) == 0
        assert svc.leases.held_by(me.peer_id) == []  # the lease is settled, its prompts re-queued
        lease = await _lease(svc, ctx)
        assert (
            await _code(
                svc.on_submit(
                    signed_submit(me, lease, 0, token_ids=(4,), logprobs=(-1.0,), incarnation=svc.incarnation), ctx
                )
            )
            == "ok"
        )

    trio.run(main)
