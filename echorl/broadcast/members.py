"""Who the learner puts in a version's plan, and how much of each fits its announcement.

``NodeInfo`` is a node as the learner hands it to ``Broadcaster.publish``; ``fit_addrs`` trims the
members' listen addresses so the signed ``PlanAnnounce`` (the whole manifest and every member in
one frame) stays under ``MAX_FRAME_BYTES`` at up to ``MAX_PLAN_MEMBERS`` members: every member
keeps its first address (its plan children dial it there), further ones while they fit an equal
share of the frame; a member list too long for even one address each loses its last members
(the roster orders workers first: those left out catch up by pull).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from echorl.protocol import limits, snapshot
from echorl.protocol.messages import Manifest, PlanMember

log = logging.getLogger(__name__)

ANNOUNCE_HEADROOM = 64 * limits.KiB
"""Frame bytes kept for the announcement's own fields around the manifest and the members (run,
learner and its 16 addresses, signature, msgpack headers: ~9 KiB at most)."""
MEMBER_OVERHEAD = 72
"""Encoded bytes of a member besides its peer ID and addresses, rounded up: six field names (46
bytes), their values' headers, the reachable/pushes/forward flags and a weight."""
ADDR_OVERHEAD = 3  # a string header of up to 65,535 bytes


@dataclass(frozen=True)
class NodeInfo:
    peer_id: str
    reachable: bool = True
    addrs: tuple[str, ...] = ()
    leaf: bool = False  # forwards nothing in this plan (the learner's newcomers that never worked)


def announce_room(manifest: Manifest) -> int:
    """Frame bytes left for the member list of an announcement carrying ``manifest``."""
    return limits.MAX_FRAME_BYTES - snapshot.manifest_wire_bytes(manifest) - ANNOUNCE_HEADROOM


def member_bytes(peer_id: str, addrs: list[str]) -> int:
    """An upper bound of one member's encoded size with these addresses."""
    return MEMBER_OVERHEAD + len(peer_id) + sum(len(a) + ADDR_OVERHEAD for a in addrs)


def fit_addrs(members: list[PlanMember], room: int) -> list[PlanMember]:
    """``members`` whose encoded list takes at most ``room`` bytes (see the module docstring)."""
    floor = [member_bytes(m.peer_id, m.addrs[:1]) for m in members]
    if sum(floor) > room:
        keep, used = 0, 0
        while keep < len(members) and used + floor[keep] <= room:
            used += floor[keep]
            keep += 1
        log.warning(
            "plan of %d members does not fit one announcement: the last %d left out (they catch up)",
            len(members),
            len(members) - keep,
        )
        members, floor = members[:keep], floor[:keep]
    spare = room - sum(floor)
    if all(len(m.addrs) <= 1 for m in members) or sum(member_bytes(m.peer_id, m.addrs) for m in members) <= room:
        return members
    share = spare // max(1, len(members))  # each member's room for addresses past its first
    fitted = []
    for m in members:
        addrs, extra = m.addrs[:1], 0
        for a in m.addrs[1:]:
            extra += len(a) + ADDR_OVERHEAD
            if extra > share:
                break
            addrs.append(a)
        fitted.append(m if len(addrs) == len(m.addrs) else m.model_copy(update={"addrs": addrs}))
    return fitted
