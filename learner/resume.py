"""What a learner checkpoint keeps of its network service, and how a resumed learner uses it.

- Spot-check mismatch counts: a peer flagged or banned before a restart stays so after it.
- The listen addresses of the nodes it knew: running nodes know the learner only by its old
  bootstrap address, so a learner resumed on another address dials them itself. A node retrying
  its bootstrap address then finds a live connection to its pinned learner (same key, same peer
  ID) and re-joins over it (py-libp2p's ``connect`` reuses an existing connection).

Everything read back is checked for shape; a bad entry is skipped with a log line.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from echorl.protocol.identity import short_id

log = logging.getLogger(__name__)

MAX_REMEMBERED_PEERS = 1024
MAX_ADDRS_PER_PEER = 8
REMEMBER_SEEN_WITHIN_S = 600.0


def service_state(service: Any) -> dict[str, Any]:
    """The service's part of a checkpoint (plain JSON types)."""
    now = time.monotonic()
    recent = sorted((p for p in service.peers.values() if now - p.last_seen < REMEMBER_SEEN_WITHIN_S),
                    key=lambda p: p.last_seen, reverse=True)[:MAX_REMEMBERED_PEERS]
    return {"logprob_mismatches": dict(service.mismatches),
            "peer_addrs": {p.peer_id: list(p.capability.listen_addrs)[:MAX_ADDRS_PER_PEER] for p in recent}}


def restore_service(service: Any, state: Any) -> dict[str, list[str]]:
    """Put the mismatch counts back into ``service``; return the remembered node addresses."""
    if not isinstance(state, dict):
        log.warning("checkpoint: ignoring service state of type %s", type(state).__name__)
        return {}
    for peer_id, n in _dict(state, "logprob_mismatches").items():
        if not (isinstance(peer_id, str) and isinstance(n, int) and not isinstance(n, bool) and n > 0):
            log.warning("checkpoint: ignoring mismatch entry %r: %r", peer_id, n)
            continue
        service.mismatches[peer_id] = n
        if service.spot is not None:
            service.spot.flag(peer_id)
    if service.mismatches:
        log.info("restored spot-check flags of %d peers (%d banned)", len(service.mismatches),
                 sum(service.banned(p) for p in service.mismatches))
    addrs: dict[str, list[str]] = {}
    for peer_id, lst in list(_dict(state, "peer_addrs").items())[:MAX_REMEMBERED_PEERS]:
        if isinstance(peer_id, str) and isinstance(lst, list) and all(isinstance(a, str) for a in lst):
            addrs[peer_id] = lst[:MAX_ADDRS_PER_PEER]
        else:
            log.warning("checkpoint: ignoring address entry %r", peer_id)
    return addrs


def _dict(state: dict[str, Any], key: str) -> dict[Any, Any]:
    value = state.get(key, {})
    if isinstance(value, dict):
        return value
    log.warning("checkpoint: ignoring %s of type %s", key, type(value).__name__)
    return {}


async def redial(host: Any, peer_addrs: dict[str, list[str]], timeout_s: float = 5.0, parallel: int = 16) -> int:
    """Dial every remembered node (first address that answers); returns how many answered."""
    limiter = trio.CapacityLimiter(parallel)
    reached: list[str] = []

    async def one(peer_id: str, addrs: list[str]) -> None:
        async with limiter:
            for addr in addrs:
                full = addr if "/p2p/" in addr else f"{addr}/p2p/{peer_id}"
                try:
                    if await host.connect(full, timeout=timeout_s) == peer_id:
                        reached.append(peer_id)
                        return
                except Exception as exc:  # noqa: BLE001 - PeerUnavailable, or an address that does not parse
                    log.debug("redial %s at %s: %s", short_id(peer_id), addr, exc)

    async with trio.open_nursery() as nursery:
        for peer_id, addrs in peer_addrs.items():
            nursery.start_soon(one, peer_id, addrs)
    if peer_addrs:
        log.info("re-dialled %d of %d nodes remembered by the checkpoint", len(reached), len(peer_addrs))
    return len(reached)
