"""Encoding, strict decoding, framing and signing of wire messages.

* ``encode(msg) -> bytes`` / ``decode(bytes) -> Message``: msgpack maps, never pickle. Decoding
  is strict (no ext types, bounded lengths, closed schemas) and can only raise ``ProtocolError``.
* Frames: a 4-byte big-endian length, then that many bytes of msgpack. The length is checked
  against ``MAX_FRAME_BYTES`` before anything is read for the body.
* Signatures: Ed25519 over ``b"echorl/1/" + type + b"\\0" + canonical msgpack`` of the message
  without its ``signature`` field (map keys sorted, bytes as bin, floats as float64), so two
  implementations agree byte for byte.
"""

from __future__ import annotations

import struct
from typing import Any, TypeVar

import msgpack
import pydantic

from . import limits
from .errors import ErrorCode, ProtocolError
from .identity import Identity, short_id, verify_peer_signature
from .messages import MESSAGE_TYPES, Message

FRAME_HEADER = struct.Struct(">I")
SIGNATURE_DOMAIN = b"echorl/1/"
M = TypeVar("M", bound=Message)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.MALFORMED, f"msgpack ext type {code} is not allowed")


def _unpack(data: bytes) -> Any:
    if len(data) > limits.MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.OVERSIZED, f"{len(data)} bytes > {limits.MAX_FRAME_BYTES}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_reject_ext,
            timestamp=0,
            max_str_len=limits.MAX_STR_BYTES,
            max_bin_len=limits.MAX_CHUNK_BYTES,
            max_array_len=limits.MAX_LIST_LEN,
            max_map_len=4096,
            max_ext_len=limits.MAX_STR_BYTES,  # so ext_hook sees (and refuses) them
        )
    except ProtocolError:
        raise
    except ValueError as exc:  # msgpack reports limit violations as ValueError
        code = ErrorCode.OVERSIZED if "exceeds max" in str(exc) else ErrorCode.MALFORMED
        raise ProtocolError(code, f"msgpack: {exc}") from None
    except Exception as exc:  # ExtraData, UnpackValueError, UnicodeDecodeError, StackError, ...
        raise ProtocolError(ErrorCode.MALFORMED, f"msgpack: {type(exc).__name__}: {exc}") from None


def _depth_ok(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return True


def decode(data: bytes, expect: type[M] | None = None) -> M | Message:
    """Decode one message; ``expect`` narrows the accepted type. Raises only ``ProtocolError``."""
    try:
        obj = _unpack(bytes(data))
        if not isinstance(obj, dict):
            raise ProtocolError(ErrorCode.MALFORMED, "a message is a msgpack map")
        if not _depth_ok(obj, limits.MAX_DEPTH):
            raise ProtocolError(ErrorCode.MALFORMED, f"nesting deeper than {limits.MAX_DEPTH}")
        kind = obj.get("type")
        cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {str(kind)[:64]!r}")
        if expect is not None and cls is not expect:
            want = expect.model_fields["type"].default
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"expected {want!r}, got {kind!r}")
        return cls.model_validate(obj)
    except ProtocolError:
        raise
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ProtocolError(ErrorCode.SCHEMA, f"{where}: {first.get('msg', 'invalid')}"[:512]) from None
    except Exception as exc:  # defence in depth: nothing else may escape the decoder
        raise ProtocolError(ErrorCode.MALFORMED, f"{type(exc).__name__}: {exc}"[:512]) from None


def encode(msg: Message) -> bytes:
    data = msgpack.packb(msg.model_dump(mode="python"), use_bin_type=True)
    if len(data) > limits.MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.OVERSIZED, f"message of {len(data)} bytes > {limits.MAX_FRAME_BYTES}")
    return data


# --- framing -----------------------------------------------------------------------------------
def frame_header(length: int) -> bytes:
    """The 4-byte prefix of a frame whose body is ``length`` bytes."""
    if length > limits.MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.OVERSIZED, f"frame of {length} bytes > {limits.MAX_FRAME_BYTES}")
    return FRAME_HEADER.pack(length)


def frame(payload: bytes) -> bytes:
    """Length-prefix one payload."""
    return frame_header(len(payload)) + payload


def frame_length(header: bytes, max_bytes: int = limits.MAX_FRAME_BYTES) -> int:
    """The body length announced by a 4-byte frame header, refused if above ``max_bytes``."""
    if len(header) != FRAME_HEADER.size:
        raise ProtocolError(ErrorCode.MALFORMED, "truncated frame header")
    (length,) = FRAME_HEADER.unpack(header)
    if length > max_bytes:
        raise ProtocolError(ErrorCode.OVERSIZED, f"frame announces {length} bytes > {max_bytes}")
    return length


# --- canonical bytes and signatures ------------------------------------------------------------
def _sorted(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _sorted(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_sorted(v) for v in obj]
    return obj


def canonical_bytes(msg: Message) -> bytes:
    """The bytes a signature covers: domain, type, and the message minus its signature."""
    body = msg.model_dump(mode="python", exclude={"signature"})
    kind = body["type"].encode()
    return SIGNATURE_DOMAIN + kind + b"\0" + msgpack.packb(_sorted(body), use_bin_type=True)


def _signer_field(msg: Message) -> str:
    return "learner_peer_id" if "learner_peer_id" in type(msg).model_fields else "peer_id"


def sign(msg: M, identity: Identity) -> M:
    """A copy of ``msg`` signed by ``identity`` (which must be the peer the message names)."""
    if not msg.SIGNED:
        raise TypeError(f"{type(msg).__name__} is not a signed message")
    if getattr(msg, _signer_field(msg)) != identity.peer_id:
        raise ValueError("a message can only be signed by the peer it names")
    return msg.model_copy(update={"signature": identity.sign(canonical_bytes(msg))})


def verify(msg: Message, expected_signer: str | None = None) -> None:
    """Check a signed message: the named peer signed it, and (if given) it is ``expected_signer``
    (the stream's remote peer, or the pinned learner). Raises ``ProtocolError``."""
    if not msg.SIGNED:
        raise ProtocolError(ErrorCode.SCHEMA, f"{type(msg).__name__} carries no signature")
    signer = getattr(msg, _signer_field(msg))
    if expected_signer is not None and signer != expected_signer:
        raise ProtocolError(
            ErrorCode.WRONG_SIGNER, f"message names …{short_id(signer)}, expected …{short_id(expected_signer)}"
        )
    verify_peer_signature(signer, canonical_bytes(msg), msg.signature)
