"""Delta versions: version v encoded against v−1 as changed positions + new values.

Between consecutive RL steps most parameters keep their exact bit pattern, so a delta is small.
Both files must be safetensors files with identical headers (same tensors, dtypes, shapes,
offsets); otherwise the learner publishes a full snapshot. Per tensor, elements are compared as
unsigned integers of the dtype's width (bit-exact, NaN-safe), and the delta stores:

* ``gaps``: zlib of little-endian uint32 gaps between successive changed element indices
  (the first gap is the first index), and
* ``values``: zlib of the changed elements' new bytes,

or, when most elements changed, ``dense``: zlib of the whole new tensor. Applying a delta to the
exact base file (checked by digest) reproduces the new file bit for bit; the manifest's
``result_digest`` and per-tensor digests let the receiver prove it.

Payload (msgpack map): ``format`` = "echorl-delta/1", ``base_digest``, ``result_digest``
(SHA-256 of the files), ``tensors``: list of ``{name, mode: "sparse"|"dense"|"same",
count, gaps, values}``. Decoding is bounded: no decompression beyond the tensor's size.
"""

from __future__ import annotations

import zlib

import msgpack
import numpy as np

from .errors import ErrorCode, ProtocolError
from .snapshot import DTYPE_SIZES, digest, parse_safetensors

FORMAT = "echorl-delta/1"
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
DENSE_FRACTION = 0.5  # above this fraction of changed elements, store the tensor whole


def _views(old: bytes, new: bytes):
    old_base, old_tensors = parse_safetensors(old)
    new_base, new_tensors = parse_safetensors(new)
    if old_base != new_base or old[:old_base] != new[:new_base]:
        raise ValueError("headers differ (tensors, dtypes or shapes changed): publish a full snapshot")
    return new_base, new_tensors


def encode_delta(old: bytes, new: bytes, level: int = 1) -> bytes:
    """Encode ``new`` against ``old`` (both safetensors files with the same header)."""
    base, tensors = _views(old, new)
    entries = []
    for t in tensors:
        width = DTYPE_SIZES[t.dtype]
        a = np.frombuffer(old, dtype=_UINT[width], count=(t.end - t.start) // width, offset=t.start)
        b = np.frombuffer(new, dtype=_UINT[width], count=(t.end - t.start) // width, offset=t.start)
        changed = np.flatnonzero(a != b)
        entry = {"name": t.name, "count": int(changed.size), "gaps": b"", "values": b""}
        if changed.size == 0:
            entry["mode"] = "same"
        elif changed.size > DENSE_FRACTION * b.size or b.size >= 2**32:  # uint32 gaps must not wrap
            entry["mode"] = "dense"
            entry["count"] = int(b.size)
            entry["values"] = zlib.compress(b.tobytes(), level)
        else:
            entry["mode"] = "sparse"
            gaps = np.diff(changed, prepend=0).astype("<u4")
            entry["gaps"] = zlib.compress(gaps.tobytes(), level)
            entry["values"] = zlib.compress(b[changed].tobytes(), level)
        entries.append(entry)
    payload = {"format": FORMAT, "base_digest": digest(old), "result_digest": digest(new), "tensors": entries}
    return msgpack.packb(payload, use_bin_type=True)


def _inflate(data: bytes, expected: int, what: str) -> bytes:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, expected + 1)
    except zlib.error as exc:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"{what}: {exc}") from None
    if len(out) != expected or inflater.unconsumed_tail or inflater.unused_data or not inflater.eof:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"{what}: wrong decompressed size")
    return out


def _decode_payload(delta: bytes) -> dict:
    try:
        payload = msgpack.unpackb(delta, raw=False, strict_map_key=True, ext_hook=_no_ext, timestamp=0)
    except Exception as exc:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"delta is not msgpack: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"not an {FORMAT} payload")
    if not isinstance(payload.get("tensors"), list):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "delta has no tensor list")
    return payload


def _no_ext(code: int, data: bytes):
    raise ValueError("ext types are not allowed")


def apply_delta(old: bytes, delta: bytes) -> bytes:
    """Rebuild the new file from the exact base file and a delta payload."""
    payload = _decode_payload(delta)
    if payload.get("base_digest") != digest(old):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "delta does not apply to this base version")
    _, tensors = parse_safetensors(old)
    entries = payload["tensors"]
    if len(entries) != len(tensors):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "delta and base differ in tensor count")
    out = bytearray(old)
    for t, entry in zip(tensors, entries):
        _apply_tensor(out, t, entry)
    result = bytes(out)
    if digest(result) != payload.get("result_digest"):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "delta result digest mismatch")
    return result


def _apply_tensor(out: bytearray, t, entry) -> None:
    if not isinstance(entry, dict) or entry.get("name") != t.name:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"delta entry does not match tensor {t.name[:64]!r}")
    width = DTYPE_SIZES[t.dtype]
    n = (t.end - t.start) // width
    mode, count = entry.get("mode"), entry.get("count")
    gaps, values = entry.get("gaps"), entry.get("values")
    if not (isinstance(count, int) and 0 <= count <= n and isinstance(gaps, bytes) and isinstance(values, bytes)):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"delta entry for {t.name[:64]!r} is malformed")
    target = np.frombuffer(out, dtype=_UINT[width], count=n, offset=t.start)
    if mode == "same":
        return
    if mode == "dense":
        if count != n:
            raise ProtocolError(ErrorCode.BAD_MANIFEST, f"dense entry for {t.name[:64]!r} must count every element")
        target[:] = np.frombuffer(_inflate(values, n * width, t.name), dtype=_UINT[width])
        return
    if mode != "sparse":
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"unknown delta mode {mode!r}")
    positions = np.cumsum(np.frombuffer(_inflate(gaps, count * 4, t.name), dtype="<u4"), dtype=np.int64)
    if count and positions[-1] >= n:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"delta position out of range in {t.name[:64]!r}")
    target[positions] = np.frombuffer(_inflate(values, count * width, t.name), dtype=_UINT[width])
