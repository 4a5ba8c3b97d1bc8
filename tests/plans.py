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


def share_a_plan(holder: Relay, learner: Identity, *peers: str, run_id: str = "r") -> None:
    """Make ``peers`` members of a plan (of an unrelated version) that ``holder`` holds."""
    data = safetensors_f32(np.zeros(4, dtype=np.float32))
    manifest = snapshot.build_manifest(learner, run_id, UNRELATED_VERSION, -1, data, data)[0]
    members = [PlanMember(peer_id=p, reachable=True, addrs=[]) for p in (holder.host.peer_id, *peers)]
    ann = PlanAnnounce(
        run_id=run_id,
        learner_peer_id=learner.peer_id,
        version=UNRELATED_VERSION,
        manifest=manifest,
        shape="striped",
        fanout=2,
        seed=0,
        learner_addrs=[],
        members=members,
        created_at=0.0,
    )
    holder.server.add_state(VersionState(ann, holder.host.peer_id, holder.server.store))
