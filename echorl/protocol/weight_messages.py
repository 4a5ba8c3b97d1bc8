"""Wire messages of the weight plane: manifests and chunks, plan announcements, chunk streams,
reports and catch-up (``broadcast/``). Same rules as ``protocol/messages.py``, which re-exports
every model here and holds the one table of message types."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from . import limits
from .fields import (
    Addr,
    Count,
    Digest,
    Finite,
    Incarnation,
    Message,
    Name,
    NonNegFinite,
    OptionalFieldsModel,
    PeerId,
    RunId,
    Signature,
    Text,
    Version,
    WireModel,
)
from .plan import MAX_WEIGHT


# --- weights -----------------------------------------------------------------------------------
class ChunkRef(WireModel):
    digest: Digest  # SHA-256 of the chunk bytes: the chunk's name
    size: Annotated[int, Field(ge=1, le=limits.MAX_CHUNK_BYTES)]


class TensorEntry(WireModel):
    name: Text
    dtype: Name  # safetensors dtype string: "F32", "BF16", ...
    shape: Annotated[list[Count], Field(max_length=limits.MAX_TENSOR_DIMS)]
    digest: Digest  # SHA-256 of the tensor's raw bytes in version ``version``


class AdapterSpec(WireModel):
    """A LoRA adapter version: the base it applies to (digest: docs/protocol.md) and its shape."""

    base_digest: Digest
    rank: Annotated[int, Field(ge=1, le=limits.MAX_LORA_RANK)]
    alpha: Annotated[float, Field(gt=0.0, le=1e6, allow_inf_nan=False)]
    target_modules: Annotated[list[Name], Field(min_length=1, max_length=limits.MAX_LORA_TARGETS)]


class Manifest(Message, OptionalFieldsModel):
    """A policy version as a list of content-addressed chunks, signed by the learner.

    ``kind == "full"``: the chunks concatenate to the version's safetensors file.
    ``kind == "delta"``: they concatenate to a delta payload (docs/protocol.md) that turns
    version ``base_version`` into ``version``; ``result_digest`` names the resulting file.
    ``adapter`` set: the version's tensors are a LoRA adapter over the base it names."""

    SIGNED: ClassVar[bool] = True
    OPTIONAL: ClassVar[tuple[str, ...]] = ("adapter",)
    type: Literal["manifest"] = "manifest"
    run_id: RunId
    learner_peer_id: PeerId
    version: Version
    parent_version: Version  # -1 for the first version
    kind: Literal["full", "delta"]
    base_version: Version  # delta: the version it applies to; full: -1
    chunk_bytes: Annotated[int, Field(ge=1, le=limits.MAX_CHUNK_BYTES)]
    payload_bytes: Count
    chunks: Annotated[list[ChunkRef], Field(max_length=limits.MAX_CHUNKS)]
    tensors: Annotated[list[TensorEntry], Field(max_length=limits.MAX_TENSORS)]
    result_bytes: Count  # size of the version's safetensors file
    result_digest: Digest  # SHA-256 of the version's safetensors file
    created_at: Finite
    signature: Signature = b"\0" * 64
    incarnation: Incarnation | None = None
    adapter: AdapterSpec | None = None


class ChunkRequest(Message):
    type: Literal["chunk_request"] = "chunk_request"
    digest: Digest


class Chunk(Message):
    type: Literal["chunk"] = "chunk"
    digest: Digest
    data: Annotated[bytes, Field(min_length=1, max_length=limits.MAX_CHUNK_BYTES)]


# --- broadcast (broadcast/broadcaster.py, broadcast/relay.py) ---------------------------------------------
class PlanMember(OptionalFieldsModel):
    """``pushes``: not reachable, but may relay by dialling out to reachable children and
    pushing its stripe to them (a node behind NAT); None = a leaf unless reachable. ``weight``:
    its upload as the learner measured it (``broadcast/uplinks.py``); child slots are shared in
    proportion (``plan.relay_slots``); None = the median of the members' weights. ``forward``:
    True = its stripe-0 parent forwards it the announcement (the learner sends it only if the
    member has not said it heard it by its depth's deadline, ``broadcast/announcing.py``);
    None = the learner sends it."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("pushes", "weight", "forward")
    peer_id: PeerId
    reachable: bool  # may be interior (others can dial it)
    addrs: Annotated[list[Addr], Field(max_length=16)]  # where its children dial it
    pushes: bool | None = None
    weight: Annotated[int, Field(ge=0, le=MAX_WEIGHT)] | None = None
    forward: bool | None = None


class PlanAnnounce(Message):
    """Learner → every node of a broadcast: the signed manifest of ``version`` and the members
    from which every node computes the same relay plan (``shape``: "striped" = architecture §6
    SplitStream plan, "tree" = one k-ary tree, "star" = everyone fetches from the learner).
    Signed by the learner, so a relay cannot redirect traffic or change the plan."""

    SIGNED: ClassVar[bool] = True
    type: Literal["plan_announce"] = "plan_announce"
    run_id: RunId
    learner_peer_id: PeerId
    version: Version
    manifest: Manifest
    shape: Literal["striped", "tree", "star"]
    fanout: Annotated[int, Field(ge=1, le=64)]
    seed: Annotated[int, Field(ge=0, lt=2**63)]
    learner_addrs: Annotated[list[Addr], Field(max_length=16)]
    members: Annotated[list[PlanMember], Field(max_length=limits.MAX_PLAN_MEMBERS)]
    created_at: Finite
    signature: Signature = b"\0" * 64


class Subscribe(Message, OptionalFieldsModel):
    """Child → parent (adopted: → an ancestor, protocol.md §4.5), first frame of a chunk stream: send
    stripe ``stripe`` of ``version`` but its first ``skip`` (omitted: 0) chunks, in order, as verified."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("skip",)
    type: Literal["subscribe"] = "subscribe"
    run_id: RunId
    version: Version
    stripe: Annotated[int, Field(ge=0, le=64)]
    skip: Count | None = None


class StreamRate(WireModel):
    """One stripe as it came from the reporter's plan parent: the bytes after the first chunk and
    the seconds their frames were in transit, first byte to last of each (waits between frames
    left out): the learner's measure of the parent's upload."""

    stripe: Annotated[int, Field(ge=0, le=64)]
    bytes: Count
    seconds: NonNegFinite


class BroadcastDone(Message, OptionalFieldsModel):
    """Node → learner: ``version`` is applied and verified (``ok``) or given up; ``suspects``
    are parents that sent bad chunks or stalled past the deadline; ``streams`` (optional): what
    came from each plan parent, per stripe."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("streams",)
    type: Literal["broadcast_done"] = "broadcast_done"
    run_id: RunId
    version: Version
    ok: bool
    seconds: NonNegFinite  # announce received → version verified
    recovered_chunks: Count  # chunks fetched outside the plan
    suspects: Annotated[list[PeerId], Field(max_length=64)]
    detail: Text
    streams: Annotated[list[StreamRate], Field(max_length=64)] | None = None


class BroadcastAck(Message):
    type: Literal["broadcast_ack"] = "broadcast_ack"
    run_id: RunId
    version: Version  # the version acknowledged
    have_version: Version  # the newest version the replier holds verified


class CatchUpRequest(Message):
    """Any holder: the manifests a node needs to reach the newest version from ``have_version``."""

    type: Literal["catch_up_request"] = "catch_up_request"
    run_id: RunId
    have_version: Version  # -1: nothing


class CatchUp(Message, OptionalFieldsModel):
    """The newest full snapshot's manifest and every delta after it (or only the deltas after
    ``have_version`` when the requester holds a version of the chain), oldest first: one page of
    them: the first manifest, then more while the page stays within ``limits.CATCHUP_PAGE_BYTES``.
    ``more``: the holder has newer ones; ask again with ``have_version`` = the last one applied."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("more",)
    type: Literal["catch_up"] = "catch_up"
    run_id: RunId
    manifests: Annotated[list[Manifest], Field(max_length=256)]
    more: bool | None = None


class StreamTicket(Message):
    """Reply to ``Subscribe`` on ``TICKET``/``PUSH``: TCP to ``port`` on the IP of the libp2p
    connection it came over (never an announced address), send the ticket's proof (SHA-256 of a
    domain and the ticket, 16 bytes), then ``Chunk`` frames flow. Single-use, bound to (peer,
    version, stripe); chunks are verified against the signed manifest, so no encryption."""

    type: Literal["stream_ticket"] = "stream_ticket"
    ticket: Annotated[bytes, Field(min_length=limits.TICKET_BYTES, max_length=limits.TICKET_BYTES)]
    port: Annotated[int, Field(ge=1, le=65535)]


class AnnounceHeard(Message):
    """Node → learner: this node took ``version``'s plan announcement from a plan parent (the
    learner's signed bytes, forwarded down stripe 0; protocol.md §4.5), so the learner need not
    send it one itself. A node that took it from the learner answers that request instead."""

    type: Literal["announce_heard"] = "announce_heard"
    run_id: RunId
    version: Version
