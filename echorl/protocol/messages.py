"""Wire messages: one frozen pydantic model per message type, strict and closed.

Every model forbids extra fields, coerces nothing (strict mode), refuses NaN/inf where a number
must be finite, and bounds every string, byte string and list. The ``type`` field is the
discriminator on the wire. docs/protocol.md documents each message; keep the two in step. The
weight plane's messages (manifests, chunks, announcements, reports) are in
``protocol/weight_messages.py``, re-exported here; ``MESSAGE_TYPES`` below lists them all.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from . import limits
from .fields import (  # Message is re-exported: handlers import it from here
    Addr,
    Count,
    Finite,
    Incarnation,
    LogProb,
    Message,
    Name,
    Nonce,
    NonNegFinite,
    OptionalFieldsModel,
    PeerId,
    RunId,
    ScalarMap,
    Signature,
    Text,
    TokenId,
    Version,
    WireModel,
)

# the weight plane's messages live in weight_messages.py; importers find them here as before
from .weight_messages import (
    AdapterSpec,  # noqa: F401 (re-exported)
    AnnounceHeard,
    BroadcastAck,
    BroadcastDone,
    CatchUp,
    CatchUpRequest,
    Chunk,
    ChunkRef,  # noqa: F401 (re-exported)
    ChunkRequest,
    Manifest,
    PlanAnnounce,
    PlanMember,  # noqa: F401 (re-exported)
    StreamRate,  # noqa: F401 (re-exported)
    StreamTicket,
    Subscribe,
    TensorEntry,  # noqa: F401 (re-exported)
)

# --- membership --------------------------------------------------------------------------------
PROBE_ENGINE = "doctor"  # Capability.engine of `echorl doctor`'s join: it reads weights, is never a node


class Capability(OptionalFieldsModel):
    """What a node offers: the learner schedules and prices by it (and sets the spot-check
    tolerance by its engine and dtype)."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("dtype",)

    engine: Name  # "torch", "vllm"; PROBE_ENGINE: a doctor's probe, not a node
    device: Name  # "cpu", "cuda:0", "NVIDIA RTX 4090"
    memory_bytes: Count
    tokens_per_s: Annotated[float, Field(ge=0.0, le=limits.MAX_TOKENS_PER_S, allow_inf_nan=False)]  # node's own claim
    price_per_hour: Annotated[
        float, Field(ge=0.0, le=1e9, allow_inf_nan=False)
    ]  # what the volunteer asks, in the run's currency unit
    reachable: bool  # can others dial it (interior of broadcast trees)?
    listen_addrs: Annotated[list[Addr], Field(max_length=16)]
    dtype: Name | None = None  # weights' dtype ("float32", "bfloat16", "float16"); None: float32


class JoinRequest(Message):
    SIGNED: ClassVar[bool] = True
    type: Literal["join"] = "join"
    run_id: RunId
    peer_id: PeerId
    capability: Capability
    version: Version  # newest verified policy version the node holds, -1 none
    timestamp: Finite  # unix seconds; refused outside ±MAX_CLOCK_SKEW_S
    nonce: Nonce
    # random per node process: a second live process with the same key is refused (identity_in_use)
    instance: Annotated[bytes, Field(max_length=32)] = b""
    signature: Signature = b"\0" * 64


class JoinAccepted(Message):
    type: Literal["join_ok"] = "join_ok"
    run_id: RunId
    learner_peer_id: PeerId
    version: Version  # newest published version
    staleness_bound: Count
    heartbeat_s: NonNegFinite
    incarnation: Incarnation  # the learner's: manifests of another are an abandoned branch's


# --- work --------------------------------------------------------------------------------------
class SamplingSpec(WireModel):
    temperature: NonNegFinite
    top_p: Annotated[float, Field(ge=1.0, le=1.0, allow_inf_nan=False)]  # 1 only: rl/config.py TOP_P_REFUSED
    max_new_tokens: Annotated[int, Field(ge=1, le=limits.MAX_COMPLETION_TOKENS)]
    stop: Annotated[list[Text], Field(max_length=16)]


class EpisodeSpec(WireModel):
    """A multi-turn episode to run (``tasks/env.py``): the environment (a built-in name or
    ``module:Class``; a node runs only built-ins and those it allows) with its options, the
    environment seed the learner chose, the turn limit and the transcript's token budget."""

    env: Name
    options: ScalarMap
    seed: Annotated[int, Field(ge=0, lt=2**63)]
    max_turns: Annotated[int, Field(ge=1, le=limits.MAX_EPISODE_TURNS)]
    max_tokens: Annotated[int, Field(ge=1, le=limits.MAX_COMPLETION_TOKENS)]


class LeasePrompt(OptionalFieldsModel):
    OPTIONAL: ClassVar[tuple[str, ...]] = ("episode", "token_ids")
    prompt_id: Name
    text: Text  # an episode's first observation
    episode: EpisodeSpec | None = None  # set: run G episodes of this seed instead of G completions
    # set: the prompt is these token ids, used as given (``echorl serve``'s sampling requests; ``text`` is "")
    token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=limits.MAX_PROMPT_TOKENS)] | None = None


class LeaseRequest(Message, OptionalFieldsModel):
    OPTIONAL: ClassVar[tuple[str, ...]] = ("incarnation",)
    type: Literal["lease_request"] = "lease_request"
    run_id: RunId
    version: Version  # the node's current version; the learner leases only if it is fresh enough
    max_prompts: Annotated[int, Field(ge=1, le=limits.MAX_PROMPTS_PER_LEASE)]
    incarnation: Incarnation | None = None  # of ``version``'s manifest; another: ``weights_unknown``


class Lease(Message, OptionalFieldsModel):
    OPTIONAL: ClassVar[tuple[str, ...]] = ("sampling_seed",)
    type: Literal["lease"] = "lease"
    lease_id: Name
    run_id: RunId
    prompts: Annotated[list[LeasePrompt], Field(min_length=1, max_length=limits.MAX_PROMPTS_PER_LEASE)]
    group_size: Annotated[int, Field(ge=1, le=limits.MAX_GROUP_SIZE)]
    sampling: SamplingSpec
    min_version: Version  # generate with this version or newer
    deadline_s: Annotated[float, Field(gt=0.0, le=86400.0, allow_inf_nan=False)]  # from receipt
    sampling_seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None  # secret: seeded sampling (actor/seeded.py)


class RunEnded(Message):
    """The learner's answer to a lease request once its run is over: the node stops (exit 0)
    and reports what it contributed. Signed, so only the pinned learner can end a node's run."""

    SIGNED: ClassVar[bool] = True
    type: Literal["run_ended"] = "run_ended"
    run_id: RunId
    learner_peer_id: PeerId
    version: Version  # the final policy version
    steps: Count
    leases_done: Count  # this node's settled leases with results
    groups_accepted: Count  # this node's rollout groups the learner trained on (or buffered)
    timestamp: Finite
    signature: Signature = b"\0" * 64


class LeaseDeferred(Message):
    """The learner's answer to a ``LeaseRequest`` it cannot serve now, with what to do next:
    ``weights_too_old`` (get version ``want_version`` or newer first), ``weights_unknown`` (the
    node claims a version the learner never published, e.g. after the learner resumed from an
    older checkpoint: drop it and fetch ``want_version``), ``paced`` (enough work in flight) or
    ``stopping`` (the learner is shutting down). Ask again after ``retry_after_s``."""

    type: Literal["lease_deferred"] = "lease_deferred"
    run_id: RunId
    reason: Literal["weights_too_old", "weights_unknown", "paced", "stopping", "standby"]
    want_version: Version  # -1 unless the reason is about weights
    retry_after_s: Annotated[float, Field(ge=0.0, le=3600.0, allow_inf_nan=False)]


class LeaseReturn(Message):
    """A node gives leases back (shutdown) so their prompts are re-queued at once."""

    type: Literal["lease_return"] = "lease_return"
    run_id: RunId
    lease_ids: Annotated[list[Name], Field(max_length=64)]


class Sample(OptionalFieldsModel):
    """A completion, or (``model_mask`` set) an episode's transcript: model turns and
    environment observations interleaved, ``model_mask`` True on the model's tokens (observation
    tokens carry log-prob 0.0). At least one token (an honest actor always samples one, EOS
    included). The learner recomputes the reward; for an episode it replays it,
    and a ``reward_hint`` that differs from the replay is refused as ``env_mismatch``."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("model_mask",)
    token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=limits.MAX_COMPLETION_TOKENS)]
    logprobs: Annotated[list[LogProb], Field(min_length=1, max_length=limits.MAX_COMPLETION_TOKENS)]
    finish_reason: Literal["stop", "length", "eos"]
    reward_hint: Finite  # the actor's own reward: for logging only, the learner recomputes
    model_mask: Annotated[list[bool], Field(max_length=limits.MAX_COMPLETION_TOKENS)] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("token_ids and logprobs differ in length")
        if self.model_mask is not None and len(self.model_mask) != len(self.token_ids):
            raise ValueError("model_mask and token_ids differ in length")
        return self


class RolloutGroup(WireModel):
    prompt_id: Name
    samples: Annotated[list[Sample], Field(min_length=1, max_length=limits.MAX_GROUP_SIZE)]


class Submit(Message, OptionalFieldsModel):
    """Signed rollouts for one lease. Replay defence: the lease id is single-use, the nonce is
    fresh, and the signer must be the stream's remote peer."""

    SIGNED: ClassVar[bool] = True
    OPTIONAL: ClassVar[tuple[str, ...]] = ("incarnation",)
    type: Literal["submit"] = "submit"
    run_id: RunId
    lease_id: Name
    peer_id: PeerId
    behaviour_version: Version  # the policy version every sample was generated with
    groups: Annotated[list[RolloutGroup], Field(min_length=1, max_length=limits.MAX_PROMPTS_PER_LEASE)]
    generate_seconds: Annotated[float, Field(ge=0.0, le=86400.0, allow_inf_nan=False)]  # the learner floors it
    nonce: Nonce
    signature: Signature = b"\0" * 64
    incarnation: Incarnation | None = None  # of the behaviour version; another: ``wrong_incarnation``


class Receipt(Message, OptionalFieldsModel):
    """The learner's signed proof that it accepted a node's work: one per accepted submission.

    A node keeps its receipts (``node/receipts.py``) and anyone can check them offline against
    the learner's peer ID (``echorl ledger --receipts``): a volunteer can show what it was
    credited with, and a forged or altered receipt fails verification."""

    SIGNED: ClassVar[bool] = True
    OPTIONAL: ClassVar[tuple[str, ...]] = ("verified",)
    type: Literal["receipt"] = "receipt"
    run_id: RunId
    learner_peer_id: PeerId  # the signer
    peer_id: PeerId  # the node credited
    lease_id: Name
    seq: Count  # the learner's receipt counter: unique per learner key and run
    groups_submitted: Annotated[int, Field(ge=0, le=limits.MAX_PROMPTS_PER_LEASE)]
    groups: Annotated[int, Field(ge=0, le=limits.MAX_PROMPTS_PER_LEASE)]  # accepted into the buffer
    tokens: Count  # completion tokens of the accepted groups
    behaviour_version: Version
    learner_version: Version  # the learner's version when it accepted
    issued_at: Finite  # unix seconds
    verified: bool | None = None  # True: the sampling proof was replayed and held; False: not checked
    signature: Signature = b"\0" * 64

    @model_validator(mode="after")
    def _consistent(self) -> Receipt:
        if self.groups > self.groups_submitted:
            raise ValueError("more groups accepted than submitted")
        return self


class SubmitAccepted(Message):
    type: Literal["submit_ok"] = "submit_ok"
    lease_id: Name
    accepted: Count  # rollout groups accepted into the buffer
    version: Version  # learner's current version
    receipt: Receipt | None = None  # signed proof of the accepted work (absent from older learners)


class StatusRequest(Message, OptionalFieldsModel):
    """One page of the status: peers from ``cursor`` on (their order is the learner's join
    order), at most ``limit`` of them (the learner may send fewer)."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("cursor", "limit")
    type: Literal["status_request"] = "status_request"
    cursor: Count | None = None  # None: 0
    limit: Annotated[int, Field(ge=1, le=limits.MAX_STATUS_PAGE)] | None = None  # None: the page size


class Status(Message, OptionalFieldsModel):
    """One page: ``next_cursor`` is where the next page starts (None: this is the last), and
    ``total_peers`` how many peers the learner knows; ``learner`` is on every page."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ("next_cursor", "total_peers")
    type: Literal["status"] = "status"
    run_id: RunId
    learner: ScalarMap
    peers: Annotated[list[ScalarMap], Field(max_length=limits.MAX_STATUS_PAGE)]
    next_cursor: Count | None = None
    total_peers: Count | None = None


class Error(Message):
    type: Literal["error"] = "error"
    code: Name  # an ErrorCode value
    detail: Text


class LearnerRecord(Message):
    """The run's learner as stored in the DHT under ``/echorl/learner/<run_id>``. Signed by the
    learner it names; nodes use it only to find the addresses of the learner they pinned."""

    SIGNED: ClassVar[bool] = True
    type: Literal["learner_record"] = "learner_record"
    run_id: RunId
    learner_peer_id: PeerId
    addrs: Annotated[list[Text], Field(min_length=1, max_length=16)]
    version: Version
    created_at: Finite
    signature: Signature = b"\0" * 64


class DialBackRequest(Message):
    """Anyone → learner (what ``echorl doctor`` asks before a volunteer joins): dial me back at
    ``addrs`` and say whether that worked. The learner dials only those of ``addrs`` on the IP
    the request's connection comes from, so it cannot be made to connect to third parties."""

    type: Literal["dial_back_request"] = "dial_back_request"
    addrs: Annotated[list[Addr], Field(max_length=16)]


class DialBackResult(Message):
    type: Literal["dial_back_result"] = "dial_back_result"
    reachable: bool  # some address accepted a TCP connection and spoke libp2p
    seen_ip: Text  # where the request came from, as the learner sees it ("" if unknown)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.model_fields["type"].default: cls
    for cls in (
        JoinRequest,
        JoinAccepted,
        LeaseRequest,
        Lease,
        LeaseDeferred,
        LeaseReturn,
        Submit,
        SubmitAccepted,
        Receipt,
        Manifest,
        ChunkRequest,
        Chunk,
        StatusRequest,
        Status,
        Error,
        PlanAnnounce,
        Subscribe,
        BroadcastDone,
        BroadcastAck,
        AnnounceHeard,
        CatchUpRequest,
        CatchUp,
        StreamTicket,
        LearnerRecord,
        RunEnded,
        DialBackRequest,
        DialBackResult,
    )
}
