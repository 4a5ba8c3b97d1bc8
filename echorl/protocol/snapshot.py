"""Weight snapshots: safetensors bytes → content-addressed chunks → a signed ``Manifest``.

A version's weights travel as the bytes of one safetensors file (full version) or of a delta
payload (see ``delta.py``), cut into fixed-size chunks named by their SHA-256. The learner signs
the manifest; a relay can forward chunks but cannot forge them, because each chunk is checked
against the signed digest before it is used or forwarded (``ChunkAssembler.add``), and the
rebuilt file is checked against ``result_digest`` and every tensor's digest (``verify_result``).

No torch at import time: torch is touched only by ``state_dict_to_safetensors`` /
``safetensors_to_state_dict``; relays need neither.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from dataclasses import dataclass
from typing import Any

from . import limits
from .errors import ErrorCode, ProtocolError
from .identity import Identity
from .messages import AdapterSpec, ChunkRef, Manifest, TensorEntry
from .wire import sign, verify

# bytes per element of each safetensors dtype
DTYPE_SIZES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MAX_HEADER_BYTES = 100 * limits.MiB  # the safetensors library's own limit


def digest(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class TensorSlice:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets into the file
    end: int


def parse_safetensors(data: bytes | memoryview) -> tuple[int, list[TensorSlice]]:
    """Validate a safetensors file's header; return (data offset, tensors in file order)."""
    return parse_header(data, len(data))


def header_length(first8: bytes | memoryview, total: int) -> int:
    """Bytes of the header after the 8-byte length of a ``total``-byte safetensors file."""
    if len(first8) < 8 or total < 8:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "safetensors file shorter than its header length")
    (header_len,) = struct.unpack("<Q", first8[:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > total:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "safetensors header length out of range")
    return header_len


def parse_header(head: bytes | memoryview, total: int) -> tuple[int, list[TensorSlice]]:
    """``parse_safetensors`` from the file's first bytes (at least the header) and its size:
    what a file on disk is checked with without reading its tensors."""
    view = memoryview(head)
    header_len = header_length(view, total)
    if 8 + header_len > len(view):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "safetensors header cut short")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"safetensors header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "safetensors header is not an object")
    base = 8 + header_len
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tensors.append(_tensor_slice(name, info, base, total))
    tensors.sort(key=lambda t: t.start)
    return base, tensors


def _tensor_slice(name: str, info: Any, base: int, total: int) -> TensorSlice:
    try:
        dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        itemsize = DTYPE_SIZES[dtype]
        count = 1
        for dim in shape:
            if not isinstance(dim, int) or dim < 0:
                raise ValueError("bad dim")
            count *= dim
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"tensor {name[:64]!r}: bad header entry ({exc})") from None
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end and base + end <= total):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"tensor {name[:64]!r}: offsets out of range")
    if end - start != count * itemsize:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"tensor {name[:64]!r}: size does not match shape")
    return TensorSlice(name, dtype, shape, base + start, base + end)


def tensor_entries(data: bytes | memoryview) -> list[TensorEntry]:
    """Per-tensor digests of a safetensors file (what a node proves it rebuilt exactly)."""
    view = memoryview(data)
    _, tensors = parse_safetensors(view)
    return [
        TensorEntry(name=t.name, dtype=t.dtype, shape=list(t.shape), digest=digest(view[t.start : t.end]))
        for t in tensors
    ]


def split_chunks(payload: bytes, chunk_bytes: int = limits.DEFAULT_CHUNK_BYTES) -> list[bytes]:
    return [bytes(v) for v in chunk_views(payload, chunk_bytes)]


def chunk_views(payload: bytes | memoryview, chunk_bytes: int = limits.DEFAULT_CHUNK_BYTES) -> list[memoryview]:
    """``payload`` cut at ``chunk_bytes``, as views (no copy: a large payload is not doubled)."""
    if not 1 <= chunk_bytes <= limits.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in [1, {limits.MAX_CHUNK_BYTES}]")
    view = memoryview(payload)
    return [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]


def build_manifest(
    identity: Identity,
    run_id: str,
    version: int,
    parent_version: int,
    payload: bytes,
    result: bytes,
    *,
    kind: str = "full",
    base_version: int = -1,
    chunk_bytes: int = limits.DEFAULT_CHUNK_BYTES,
    incarnation: bytes | None = None,
    adapter: AdapterSpec | None = None,
) -> tuple[Manifest, list[memoryview]]:
    """Cut ``payload`` into chunks (views into it) and sign a manifest for it. ``result`` is the
    version's safetensors file (equal to ``payload`` for a full version); ``adapter``: the version
    is a LoRA adapter over the base it names."""
    chunks = chunk_views(payload, chunk_bytes)
    manifest = Manifest(
        run_id=run_id,
        learner_peer_id=identity.peer_id,
        version=version,
        parent_version=parent_version,
        kind=kind,
        base_version=base_version if kind == "delta" else -1,
        chunk_bytes=chunk_bytes,
        payload_bytes=len(payload),
        chunks=[ChunkRef(digest=digest(c), size=len(c)) for c in chunks],
        tensors=tensor_entries(result),
        result_bytes=len(result),
        result_digest=digest(result),
        created_at=time.time(),
        incarnation=incarnation,
        adapter=adapter,
    )
    return sign(manifest, identity), chunks


def manifest_wire_bytes(manifest: Manifest) -> int:
    """An upper bound of ``len(wire.encode(manifest))`` without encoding it (paging decisions):
    ≤ 52 bytes per chunk reference, a tensor entry's name, dims and digest, and a fixed rest."""
    tensors = sum(len(t.name.encode()) + len(t.dtype) + 9 * len(t.shape) + 64 for t in manifest.tensors)
    return 52 * len(manifest.chunks) + tensors + 1024


def verify_manifest(
    manifest: Manifest, learner_peer_id: str, run_id: str | None = None, incarnation: bytes | None = None
) -> None:
    """Signature by the pinned learner, and internal consistency; with ``incarnation`` (the
    one the learner joined us under), signed by that learner process: a version of an abandoned
    branch (same key, same version numbers, other weights) is refused. Raises ``ProtocolError``."""
    verify(manifest, expected_signer=learner_peer_id)
    if run_id is not None and manifest.run_id != run_id:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"manifest is for run {manifest.run_id!r}")
    if incarnation is not None and manifest.incarnation != incarnation:
        raise ProtocolError(
            ErrorCode.WRONG_INCARNATION,
            f"manifest v{manifest.version} is of another learner incarnation (a branch the learner abandoned)",
        )
    if manifest.version < 0 or manifest.parent_version >= manifest.version:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "version must be >= 0 and newer than its parent")
    sizes = [c.size for c in manifest.chunks]
    if sum(sizes) != manifest.payload_bytes:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "chunk sizes do not add up to payload_bytes")
    if any(s != manifest.chunk_bytes for s in sizes[:-1]) or (sizes and sizes[-1] > manifest.chunk_bytes):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "chunks are not cut at chunk_bytes")
    if manifest.kind == "full" and (manifest.payload_bytes != manifest.result_bytes or manifest.base_version != -1):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "a full manifest's payload is its result")
    if manifest.kind == "delta" and not 0 <= manifest.base_version < manifest.version:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "a delta's base must be an older version")


class ChunkAssembler:
    """Collects the chunks of one (verified) manifest, checking each before accepting it."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._index = {}
        for i, ref in enumerate(manifest.chunks):
            self._index.setdefault(ref.digest, []).append(i)
        self._chunks: list[bytes | None] = [None] * len(manifest.chunks)

    def check(self, chunk_digest: bytes, data: bytes) -> list[int]:
        """The chunk indices ``data`` fills, or ``ProtocolError(BAD_CHUNK)`` if it is not what
        the manifest names (wrong bytes, wrong size, or a digest the manifest does not list)."""
        positions = self._index.get(chunk_digest)
        if positions is None:
            raise ProtocolError(ErrorCode.BAD_CHUNK, "digest not in manifest")
        if len(data) != self.manifest.chunks[positions[0]].size or digest(data) != chunk_digest:
            raise ProtocolError(ErrorCode.BAD_CHUNK, "chunk bytes do not match their digest")
        return positions

    def add(self, chunk_digest: bytes, data: bytes) -> bool:
        """Verify and store a chunk; True if it was new."""
        positions = self.check(chunk_digest, data)
        new = self._chunks[positions[0]] is None
        for i in positions:
            self._chunks[i] = data
        return new

    def has(self, chunk_digest: bytes) -> bool:
        positions = self._index.get(chunk_digest)
        return positions is not None and self._chunks[positions[0]] is not None

    def get(self, chunk_digest: bytes) -> bytes | None:
        positions = self._index.get(chunk_digest)
        return None if positions is None else self._chunks[positions[0]]

    def missing(self) -> list[bytes]:
        """Digests still missing, in manifest order, without duplicates."""
        seen: set[bytes] = set()
        out = []
        for ref, data in zip(self.manifest.chunks, self._chunks):
            if data is None and ref.digest not in seen:
                seen.add(ref.digest)
                out.append(ref.digest)
        return out

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self._chunks)

    def payload(self) -> bytes:
        if not self.complete:
            raise ProtocolError(ErrorCode.BAD_MANIFEST, f"{len(self.missing())} chunks missing")
        return b"".join(self._chunks)  # type: ignore[arg-type]


def verify_result(manifest: Manifest, result: bytes) -> None:
    """The rebuilt safetensors file is exactly the version the manifest describes."""
    if len(result) != manifest.result_bytes or digest(result) != manifest.result_digest:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"version {manifest.version}: result digest mismatch")
    if tensor_entries(result) != list(manifest.tensors):
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"version {manifest.version}: tensor digests mismatch")


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The first bytes of a safetensors file holding ``tensors`` ((name, dtype, shape) each):
    the 8-byte length and the JSON header padded to 8 bytes, and the file order as (name,
    start, end) offsets into the data that follows. Wider dtypes first, then by name, so every
    tensor starts aligned to its element size (what the safetensors library does too)."""
    order = sorted(tensors, key=lambda t: (-DTYPE_SIZES[t[1]], t[0]))
    header: dict[str, Any] = {}
    layout, offset = [], 0
    for name, dtype, shape in order:
        n = DTYPE_SIZES[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        layout.append((name, offset, offset + n))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, layout


def state_dict_to_safetensors(state_dict: dict[str, Any]) -> bytes:
    """Serialise a torch state dict (contiguous CPU clones, so tied weights are accepted)."""
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()})


def safetensors_file_to_state_dict(path: Any) -> dict[str, Any]:
    """A state dict from a safetensors file, read one tensor at a time (``safe_open``): the
    file's bytes are never in memory at once beside the tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not iterable


def safetensors_to_state_dict(data: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    return load(data)
