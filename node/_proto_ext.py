"""Protocol addition needed by DHT membership (to move into protocol/messages.py): the signed
learner record stored in the DHT under ``/echorl/learner/<run_id>``."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgpack
import pydantic
from pydantic import Field

from echorl.protocol import limits, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import Finite, Message, PeerId, RunId, Signature, Text, Version


class LearnerRecord(Message):
    SIGNED: ClassVar[bool] = True
    type: Literal["learner_record"] = "learner_record"
    run_id: RunId
    learner_peer_id: PeerId
    addrs: Annotated[list[Text], Field(min_length=1, max_length=16)]
    version: Version
    created_at: Finite
    signature: Signature = b"\0" * 64


def encode_record(rec: LearnerRecord) -> bytes:
    return wire.encode(rec)


def decode_record(data: bytes) -> LearnerRecord:
    """Strict decode + signature check (signed by the learner it names). Raises ProtocolError."""
    if len(data) > 64 * limits.KiB:
        raise ProtocolError(ErrorCode.OVERSIZED, "learner record too large")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=limits.MAX_STR_BYTES,
                              max_bin_len=1024, max_array_len=64, max_map_len=32, max_ext_len=0)
        rec = LearnerRecord.model_validate(obj)
    except pydantic.ValidationError as exc:
        raise ProtocolError(ErrorCode.SCHEMA, str(exc.errors()[0].get("msg", "invalid"))) from None
    except Exception as exc:  # noqa: BLE001 - msgpack raises many kinds
        raise ProtocolError(ErrorCode.MALFORMED, f"{type(exc).__name__}") from None
    wire.verify(rec)
    return rec
