"""What a learner checkpoint keeps of its network service, and how a resumed learner uses it.

- Spot-check mismatch counts: a peer flagged or banned before a restart stays so after it.
- The listen addresses of the nodes it knew: running nodes know the learner only by its old
  bootstrap address, so a learner resumed on another address dials them itself. A node retrying
  its bootstrap address then finds a live connection to its pinned learner (same key, same peer
  ID) and re-joins over it (py-libp2p's ``connect`` reuses an existing connection).

The service owns this state (``LearnerService.state_dict`` / ``load_state_dict`` call these
functions). Everything read back is checked for shape: unknown keys are an error, a bad entry
is skipped with a log line.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from echorl.protocol.identity import short_id
from echorl.learner.checkpoint import check_state_keys

log = logging.getLogger(__name__)

MAX_REMEMBERED_PEERS = 1024
MAX_ADDRS_PER_PEER = 8
REMEMBER_SEEN_WITHIN_S = 600.0


def encode_service_state(peers: dict[str, Any], mismatches: dict[str, int]) -> dict[str, Any]:
    """The service's part of a checkpoint (plain JSON types), from its peers and mismatch counts."""
    now = time.monotonic()
    recent = sorted((p for p in peers.values() if now - p.last_seen < REMEMBER_SEEN_WITHIN_S),
                    key=lambda p: p.last_seen, reverse=True)[:MAX_REMEMBERED_PEERS]
    return {"logprob_mismatches": dict(mismatches),
            "peer_addrs": {p.peer_id: list(p.capability.listen_addrs)[:MAX_ADDRS_PER_PEER] for p in recent}}


def decode_service_state(state: Any) -> tuple[dict[str, int], dict[str, list[str]]]:
    """(mismatch counts, node addresses) of a saved service state. Unknown keys are an error
    (state from other code); a malformed entry is skipped with a log line."""
    state = check_state_keys("service", state, {"logprob_mismatches", "peer_addrs"})
    mismatches: dict[str, int] = {}
    for peer_id, n in _dict(state, "logprob_mismatches").items():
        if not (isinstance(peer_id, str) and isinstance(n, int) and not isinstance(n, bool) and n > 0):
            log.warning("checkpoint: ignoring mismatch entry %r: %r", peer_id, n)
            continue
        mismatches[peer_id] = n
    addrs: dict[str, list[str]] = {}
    for peer_id, lst in list(_dict(state, "peer_addrs").items())[:MAX_REMEMBERED_PEERS]:
        if isinstance(peer_id, str) and isinstance(lst, list) and all(isinstance(a, str) for a in lst):
            addrs[peer_id] = lst[:MAX_ADDRS_PER_PEER]
        else:
            log.warning("checkpoint: ignoring address entry %r", peer_id)
    return mismatches, addrs


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
