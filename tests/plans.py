"""Test helper: put peers in a plan a relay holds. A node serves chunk, catch-up and stream
requests only to the learner and the members of a plan it holds (``Relay.is_member``); tests
whose peers meet outside a broadcast make them members of an unrelated plan first."""

from __future__ import annotations

import numpy as np
from swarm import safetensors_f32

from echorl.broadcast.relay import Relay
from echorl.broadcast.store import VersionState
from echorl.protocol import snapshot
from echorl.protocol.identity import Identity
from echorl.protocol.messages import PlanAnnounce, PlanMember

UNRELATED_VERSION = 10**6  # far beyond any version a test publishes


def announce(
    learner: Identity, data: bytes, members: list[str], *, version: int = 1, chunk_bytes: int = 0
) -> PlanAnnounce:
    """A signed full version ``data`` planned over ``members`` (``chunk_bytes`` 0: the default)."""
    cut = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    manifest = snapshot.build_manifest(learner, "r", version, -1, data, data, **cut)[0]
    return PlanAnnounce(
        run_id="r",
        learner_peer_id=learner.peer_id,
        version=version,
        manifest=manifest,
        shape="striped",
        fanout=2,
        seed=0,
        learner_addrs=[],
        members=[PlanMember(peer_id=p, reachable=True, addrs=[]) for p in members],
        created_at=0.0,
    )


def share_a_plan(holder: Relay, learner: Identity, *peers: str) -> None:
    """Make ``peers`` members of a plan (of an unrelated version) that ``holder`` holds."""
    data = safetensors_f32(np.zeros(4, dtype=np.float32))
    ann = announce(learner, data, [holder.host.peer_id, *peers], version=UNRELATED_VERSION)
    holder.server.add_state(VersionState(ann, holder.host.peer_id, holder.server.store))
