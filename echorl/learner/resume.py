"""What a learner checkpoint keeps of its network service, and how a resumed learner uses it.

- Spot-check mismatch counts: a peer flagged or banned before a restart stays so after it; the
  addresses proven cheats joined from, with when each stops being suspect (wall clock).
- Every node's account (accepted submissions, groups, tokens, rejections by reason, generation
  time, cost) and the receipt sequence: a resumed learner's per-node figures go on from where
  they were, so they equal the receipts the node holds.
- The listen addresses of the nodes it knew: running nodes know the learner only by its old
  bootstrap address, so a learner resumed on another address dials them itself. A node retrying
  its bootstrap address then finds a live connection to its pinned learner (same key, same peer
  ID) and re-joins over it (py-libp2p's ``connect`` reuses an existing connection).

The peer book and the ledger own this state (``LearnerService.state_dict`` /
``load_state_dict`` call these functions). Everything read back is checked for shape: unknown
keys are an error, a bad entry is skipped with a log line.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from echorl.learner.peers import MAX_ACCOUNTS, MAX_CHEAT_ADDRESSES, PeerAccount, PeerBook
from echorl.protocol.errors import ErrorCode
from echorl.protocol.identity import short_id
from echorl.rl.checkpoint import check_state_keys

if TYPE_CHECKING:
    from echorl.net.host import Host

log = logging.getLogger(__name__)

MAX_REMEMBERED_PEERS = 1024
MAX_ADDRS_PER_PEER = 8
REMEMBER_SEEN_WITHIN_S = 600.0


@dataclass
class SavedService:
    """What a checkpoint kept of the service, checked for shape."""

    mismatches: dict[str, int] = field(default_factory=dict)
    addrs: dict[str, list[str]] = field(default_factory=dict)
    accounts: dict[str, PeerAccount] = field(default_factory=dict)
    cheat_addrs: dict[str, float] = field(default_factory=dict)


_KEYS = {"logprob_mismatches", "peer_addrs", "accounts", "receipts_issued", "cheat_addresses"}
_ACCOUNT_INTS = ("submissions_accepted", "groups_accepted", "groups_dropped", "tokens_accepted", "groups_generated")
_ACCOUNT_FLOATS = ("generate_seconds", "joined_s", "cost")
_VOIDABLE_INTS = (
    "unverified_submissions",
    "unverified_groups",
    "unverified_tokens",
    "submissions_voided",
    "groups_voided",
    "tokens_voided",
)
_VOIDABLE_FLOATS = ("unverified_cost", "cost_voided")
"""Account fields a checkpoint of older code lacks (read as 0): the rest are required."""
_REASONS = {code.value for code in ErrorCode}


def encode_service_state(book: PeerBook) -> dict[str, Any]:
    """The peer book's part of a checkpoint (plain JSON types): flags, the recent nodes'
    addresses, every kept account (the ledger adds its receipt sequence)."""
    now = time.monotonic()
    recent = sorted(
        (p for p in book.values() if now - p.last_seen < REMEMBER_SEEN_WITHIN_S),
        key=lambda p: p.last_seen,
        reverse=True,
    )[:MAX_REMEMBERED_PEERS]
    return {
        "logprob_mismatches": dict(book.mismatches),
        "peer_addrs": {p.peer_id: list(p.capability.listen_addrs)[:MAX_ADDRS_PER_PEER] for p in recent},
        "accounts": {peer_id: asdict(acc) for peer_id, acc in book.accounts.items()},
        "cheat_addresses": dict(book.cheat_addrs),
    }


def decode_service_state(state: object) -> SavedService:
    """Flags, node addresses and accounts of a saved service state. Unknown keys are an error
    (state from other code); a malformed entry is skipped with a log line."""
    state = check_state_keys("service", state, _KEYS)
    out = SavedService()
    for peer_id, n in _dict(state, "logprob_mismatches").items():
        if not (isinstance(peer_id, str) and _count(n) and n > 0):
            log.warning("checkpoint: ignoring mismatch entry %r: %r", peer_id, n)
            continue
        out.mismatches[peer_id] = n
    for peer_id, lst in list(_dict(state, "peer_addrs").items())[:MAX_REMEMBERED_PEERS]:
        if isinstance(peer_id, str) and isinstance(lst, list) and all(isinstance(a, str) for a in lst):
            out.addrs[peer_id] = lst[:MAX_ADDRS_PER_PEER]
        else:
            log.warning("checkpoint: ignoring address entry %r", peer_id)
    for peer_id, saved in list(_dict(state, "accounts").items())[:MAX_ACCOUNTS]:
        acc = _account(saved) if isinstance(peer_id, str) else None
        if acc is None:
            log.warning("checkpoint: ignoring account entry %r", peer_id)
            continue
        out.accounts[peer_id] = acc
    for key, until in list(_dict(state, "cheat_addresses").items())[:MAX_CHEAT_ADDRESSES]:
        if isinstance(key, str) and isinstance(until, (int, float)) and math.isfinite(until):
            out.cheat_addrs[key] = float(until)
        else:
            log.warning("checkpoint: ignoring suspect address entry %r", key)
    return out


def _account(saved: object) -> PeerAccount | None:
    """A saved account, or None if any field is missing, unknown or out of range."""
    required = {*_ACCOUNT_INTS, *_ACCOUNT_FLOATS, "rejected"}
    if not isinstance(saved, dict) or not required <= set(saved) <= {*required, *_VOIDABLE_INTS, *_VOIDABLE_FLOATS}:
        return None
    saved = {**dict.fromkeys((*_VOIDABLE_INTS, *_VOIDABLE_FLOATS), 0), **saved}
    ints, floats, rejected = (*_ACCOUNT_INTS, *_VOIDABLE_INTS), (*_ACCOUNT_FLOATS, *_VOIDABLE_FLOATS), saved["rejected"]
    ints_ok = all(_count(saved[k]) for k in ints)
    floats_ok = all(isinstance(saved[k], (int, float)) and 0 <= saved[k] < math.inf for k in floats)
    reasons_ok = isinstance(rejected, dict) and all(r in _REASONS and _count(n) for r, n in rejected.items())
    if not (ints_ok and floats_ok and reasons_ok):
        return None
    acc = PeerAccount(rejected={str(r): int(n) for r, n in rejected.items()})
    for k in ints:
        setattr(acc, k, int(saved[k]))
    for k in floats:
        setattr(acc, k, float(saved[k]))
    return acc


def _count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _dict(state: dict[str, Any], key: str) -> dict[Any, Any]:
    value = state.get(key, {})
    if isinstance(value, dict):
        return value
    log.warning("checkpoint: ignoring %s of type %s", key, type(value).__name__)
    return {}


async def redial(host: Host, peer_addrs: dict[str, list[str]], timeout_s: float = 5.0, parallel: int = 16) -> int:
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
                except Exception as exc:
                    log.debug("redial %s at %s: %s", short_id(peer_id), addr, exc)

    async with trio.open_nursery() as nursery:
        for peer_id, addrs in peer_addrs.items():
            nursery.start_soon(one, peer_id, addrs)
    if peer_addrs:
        log.info("re-dialled %d of %d nodes remembered by the checkpoint", len(reached), len(peer_addrs))
    return len(reached)
