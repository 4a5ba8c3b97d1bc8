"""Chunks pulled from other holders, each verified against the signed manifest before it is
stored: a stripe whose parent failed (``recover_stripe``, its missing chunks then forwarded)
and a caught-up version's payload (``fetch_payload``).

Sources: the relay's other plan parents and up to eight other members, a random eight per relay,
and each chunk starts at a different one of them, so the orphans of a dead relay spread over many
uplinks instead of converging on the same few; the learner last (it holds everything, but its
uplink is the scarcest). A source that sends a bad chunk becomes a suspect and is not asked again.

Catch-up (``fetch_payload``): the chunks this peer holds already are copied, the rest asked of
the holders in order; a holder that stalls or refuses is asked last from then on.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import trio

from echorl.broadcast.chunk_server import ChunkServer
from echorl.broadcast.files import create_file, write_chunk
from echorl.broadcast.store import VersionState
from echorl.net.host import Host, PeerUnavailable, RemoteError
from echorl.protocol.errors import ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import Chunk, ChunkRequest, Manifest
from echorl.protocol.routes import CHUNK

log = logging.getLogger(__name__)

PEERS_ASKED = 8
IN_FLIGHT = 4


async def recover_stripe(
    host: Any, state: VersionState, stripe: int, learner: str, suspects: set[str], recovered: list[int], timeout: float
) -> None:
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


async def fetch_payload(
    host: Host, server: ChunkServer, m: Manifest, path: Path, holders: list[str], chunk_timeout: float
) -> bool:
    """Fill ``path`` with ``m``'s payload, chunk by chunk (held here, else from ``holders``),
    each verified before it is written; False if a chunk could not be had. A holder that
    misses a chunk's deadline (``chunk_timeout``: its bytes at the floor rate, a stall) or
    refuses is asked last from then on, one that sends a bad chunk never again (``holders`` is
    updated in place), so a holder that stops sending mid catch-up costs one chunk deadline,
    not one per chunk."""
    await trio.to_thread.run_sync(create_file, path, m.payload_bytes)
    where: dict[bytes, list[int]] = {}
    for i, ref in enumerate(m.chunks):
        where.setdefault(ref.digest, []).append(i)
    for d, idx in where.items():
        data = await server.find_chunk(d)
        if data is not None:
            try:
                await trio.to_thread.run_sync(write_chunk, path, m, idx, d, data)
                continue
            except ProtocolError:
                pass
        if not await _fetch_chunk(host, m, path, d, idx, holders, chunk_timeout):
            return False
    return True


async def _fetch_chunk(
    host: Host, m: Manifest, path: Path, d: bytes, idx: list[int], holders: list[str], timeout: float
) -> bool:
    for src in list(holders):
        try:
            reply = await host.request(src, CHUNK, ChunkRequest(digest=d), expect=Chunk, timeout=timeout)
            assert isinstance(reply, Chunk)
            await trio.to_thread.run_sync(write_chunk, path, m, idx, d, reply.data)
            return True
        except (PeerUnavailable, RemoteError) as exc:
            log.info(
                "catch-up v%d: holder %s failed a chunk (%s): asked last from now on",
                m.version,
                short_id(src),
                type(exc).__name__,
            )
            holders.remove(src)
            holders.append(src)
        except ProtocolError:
            log.warning("catch-up v%d: holder %s sent a bad chunk: dropped", m.version, short_id(src))
            holders.remove(src)
    return False
