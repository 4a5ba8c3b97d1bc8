"""Wire field types and the message bases: every bound a field carries is declared here once.

``messages.py`` builds each message from these; docs/protocol.md documents them.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_serializer

from . import limits

# --- field types -------------------------------------------------------------------------------
Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]
Text = Annotated[str, StringConstraints(max_length=limits.MAX_STR_BYTES)]
Addr = Annotated[str, StringConstraints(max_length=limits.MAX_ADDR_BYTES)]  # one multiaddr
PeerId = Annotated[str, StringConstraints(min_length=32, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")]
RunId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
Count = Annotated[int, Field(ge=0, le=2**53)]
Version = Annotated[int, Field(ge=-1, le=2**53)]  # -1: "none" / "latest", as each field says
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
NonNegFinite = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
LogProb = Annotated[float, Field(ge=limits.MIN_LOGPROB, le=0.0, allow_inf_nan=False)]
Nonce = Annotated[bytes, Field(min_length=16, max_length=32)]
Signature = Annotated[bytes, Field(min_length=64, max_length=64)]
Digest = Annotated[bytes, Field(min_length=32, max_length=32)]  # SHA-256
# random per learner start (a ``--resume`` starts a new branch): versions of another are not this run's
Incarnation = Annotated[bytes, Field(min_length=16, max_length=16)]
Scalar = Union[bool, int, Finite, Text, None]  # noqa: UP007 - Annotated members: Union reads plainest
ScalarMap = Annotated[dict[Name, Scalar], Field(max_length=128)]


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class OptionalFieldsModel(WireModel):
    """A model with fields added after the first protocol version: such a field is left out of
    the encoding (and of the signed canonical bytes) while it is None, so a message that does
    not use it is byte for byte what a peer that predates it sends and signs."""

    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        out = handler(self)
        for name in self.OPTIONAL:
            if out.get(name, 0) is None:
                del out[name]
        return out


class Message(WireModel):
    """Base of top-level messages; ``SIGNED`` ones carry a ``signature`` over canonical bytes."""

    SIGNED: ClassVar[bool] = False
