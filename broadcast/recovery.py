"""Recovering a stripe whose parent failed: its missing chunks pulled one by one from other
holders, each verified against the signed manifest before it is stored (and so forwarded).

Sources: the relay's other plan parents and up to eight other members, a random eight per relay,
and each chunk starts at a different one of them, so the orphans of a dead relay spread over many
uplinks instead of converging on the same few; the learner last (it holds everything, but its
uplink is the scarcest). A source that sends a bad chunk becomes a suspect and is not asked again.
"""

from __future__ import annotations

import random
from typing import Any

import trio

from echorl.protocol.errors import ProtocolError
from echorl.protocol.messages import Chunk, ChunkRequest
from echorl.protocol.routes import CHUNK
from echorl.broadcast.store import VersionState
from echorl.net.host import PeerUnavailable, RemoteError

PEERS_ASKED = 8
IN_FLIGHT = 4


async def recover_stripe(host: Any, state: VersionState, stripe: int, learner: str, suspects: set[str],
                         recovered: list[int], timeout: float) -> None:
    """Fetch stripe ``stripe``'s missing chunks of ``state``, counting each stored one in
    ``recovered[0]`` as it lands. ``timeout`` bounds each request; the caller's deadline, the
    whole."""
    others = [p for p in dict.fromkeys(state.parents.values()) if p and p not in suspects and p != learner]
    rest = [p for p in state.plan.peers if p not in suspects and p not in others and p != host.peer_id]
    random.shuffle(rest)
    peers = others + rest[:PEERS_ASKED]
    missing = [i for i in state.stripe_indices(stripe) if not state.has(i)]
    limiter = trio.CapacityLimiter(IN_FLIGHT)

    async def fetch(i: int) -> None:
        k = i % len(peers) if peers else 0
        sources = peers[k:] + peers[:k] + [learner]
        d = state.manifest.chunks[i].digest
        async with limiter:
            for attempt in range(1000):
                if state.has(i):
                    return
                for src in sources:
                    if src in suspects and src != learner:
                        continue
                    try:
                        reply = await host.request(src, CHUNK, ChunkRequest(digest=d), expect=Chunk, timeout=timeout)
                    except (PeerUnavailable, RemoteError):
                        continue
                    assert isinstance(reply, Chunk)
                    try:
                        await trio.to_thread.run_sync(state.verify, d, reply.data)
                    except ProtocolError:
                        suspects.add(src)
                        continue
                    recovered[0] += await state.put(d, reply.data)
                    return
                await trio.sleep(min(2.0, 0.2 * (attempt + 1)))

    async with trio.open_nursery() as nursery:
        for i in missing:
            nursery.start_soon(fetch, i)
