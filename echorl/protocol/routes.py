"""Every stream id of the echorl network with the request it carries and its size cap: pure data.

One table (``ROUTES``) is the contract for both ends: a server registers its handlers against
it (``Host.serve`` looks the request type and the cap up here), a client names the id. Network
policy (per-peer rate limits) is not part of the contract and lives in ``net/routes.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import limits
from .messages import (
    AnnounceHeard,
    BroadcastDone,
    CatchUpRequest,
    ChunkRequest,
    DialBackRequest,
    JoinRequest,
    LeaseRequest,
    LeaseReturn,
    Message,
    PlanAnnounce,
    StatusRequest,
    Submit,
    Subscribe,
)


@dataclass(frozen=True)
class Route:
    """One stream id: what a request on it must decode as, and the largest request frame."""

    id: str
    request: type[Message]
    max_request_bytes: int


# control plane (learner serves)
JOIN = "/echorl/join/1"  # JoinRequest -> JoinAccepted
LEASE = "/echorl/lease/1"  # LeaseRequest -> Lease | LeaseDeferred | RunEnded (the run is over)
SUBMIT = "/echorl/submit/1"  # Submit -> SubmitAccepted
RETURN = "/echorl/return/1"  # LeaseReturn -> LeaseReturn (the lease ids re-queued)
STATUS = "/echorl/status/1"  # StatusRequest -> Status
DIALBACK = "/echorl/dialback/1"  # DialBackRequest -> DialBackResult (echorl doctor's reachability check)
# weight plane (the learner and every relay serve the chunk routes from one store per version)
ANNOUNCE = "/echorl/bcast/announce/1"  # PlanAnnounce -> BroadcastAck, learner (or stripe-0 parent) -> node
STREAM = "/echorl/bcast/stream/1"  # raw: Subscribe, then Chunk frames; child dials parent
CHUNK = "/echorl/bcast/chunk/1"  # ChunkRequest -> Chunk, any holder (recovery, catch-up, fallback)
CATCHUP = "/echorl/bcast/catchup/1"  # CatchUpRequest -> CatchUp, any holder
DONE = "/echorl/bcast/done/1"  # BroadcastDone -> BroadcastAck, node -> learner
HEARD = "/echorl/bcast/heard/1"  # AnnounceHeard -> BroadcastAck, node -> learner (took it from a parent)
TICKET = "/echorl/bcast/ticket/1"  # Subscribe -> StreamTicket (direct TCP chunk path)
# a pushed edge (parent behind NAT, reachable child): the parent dials the child
PUSH = "/echorl/bcast/push/1"  # Subscribe -> StreamTicket, parent -> child: push over direct TCP
PUSH_STREAM = "/echorl/bcast/pushstream/1"  # raw: Subscribe, then Chunk frames; parent dials child

ROUTES: dict[str, Route] = {
    r.id: r
    for r in (
        Route(JOIN, JoinRequest, 16 * limits.KiB),
        Route(LEASE, LeaseRequest, 4 * limits.KiB),
        Route(SUBMIT, Submit, limits.MAX_FRAME_BYTES),
        Route(RETURN, LeaseReturn, 16 * limits.KiB),
        Route(STATUS, StatusRequest, 1 * limits.KiB),
        Route(DIALBACK, DialBackRequest, 4 * limits.KiB),
        Route(ANNOUNCE, PlanAnnounce, limits.MAX_FRAME_BYTES),
        Route(STREAM, Subscribe, 1 * limits.KiB),
        Route(CHUNK, ChunkRequest, 1 * limits.KiB),
        Route(CATCHUP, CatchUpRequest, 1 * limits.KiB),
        Route(DONE, BroadcastDone, 16 * limits.KiB),
        Route(HEARD, AnnounceHeard, 1 * limits.KiB),
        Route(TICKET, Subscribe, 1 * limits.KiB),
        Route(PUSH, Subscribe, 1 * limits.KiB),
        Route(PUSH_STREAM, Subscribe, 1 * limits.KiB),
    )
}
