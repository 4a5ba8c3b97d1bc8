"""Weight bytes on disk: a version's payload or result is a file, read and written by offset, and
checked by streaming over it, so a peer's memory is bounded by a chunk cache and the largest
tensor, not by the model's size.

- ``read_at`` / ``write_at``: ``os.pread`` / ``os.pwrite`` on a path (blocking: worker threads);
  ``mapped``: a file memory-mapped read-only.
  Each call opens the file: no descriptor outlives a call, so removing a file while a reader runs
  is safe (the reader sees ``FileNotFoundError`` or the old bytes, never another file's).
- ``ChunkCache``: an LRU of encoded ``Chunk`` frame bodies with byte accounting (``bytes``,
  ``peak_bytes``): what a relay forwards while its children keep up, read from disk otherwise.
- ``verify_result_file``: the file digest and every tensor digest in one sequential pass
  (``check_layout``: the header alone, for a file whose every chunk was verified).
- ``chunks_match_file``: a file cut into a manifest's chunks, each checked against its digest.
- ``apply_delta_file``: base file + delta payload file → result file, one tensor at a time.

All functions here block; call them with ``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import shutil
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack

from echorl.protocol import delta as delta_mod
from echorl.protocol import snapshot
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import Manifest

BLOCK = 1024 * 1024  # bytes read per step of a streaming pass


def read_at(path: Path, offset: int, n: int) -> bytes:
    """``n`` bytes of ``path`` from ``offset`` (fewer only at the end of the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        parts, got = [], 0
        while got < n:
            part = os.pread(fd, n - got, offset + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


def write_at(path: Path, offset: int, data: bytes | memoryview) -> None:
    """Write ``data`` at ``offset`` of ``path`` (created if missing)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)


@contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap]:
    """``path`` memory-mapped read-only (its bytes read through the page cache, never copied
    into the process). Raises ``OSError`` / ``ValueError`` (an empty file) when it cannot be."""
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield view
    finally:
        try:
            view.close()
        except BufferError:  # a view of it outlives the use (a traceback): closed when freed
            pass


def create_file(path: Path, size: int) -> None:
    """An empty (sparse) file of ``size`` bytes, replacing any file at ``path``."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def file_digest(path: Path) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").digest()


class ChunkCache:
    """LRU of frame bodies keyed by (file, chunk index), bounded by ``max_bytes``: the memory a
    peer spends on weights beyond the chunks in transit. Used from the trio loop only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, max_bytes)
        self.bytes = 0
        self.peak_bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[tuple[str, int], bytes] = OrderedDict()

    def get(self, key: tuple[str, int]) -> bytes | None:
        body = self._items.get(key)
        if body is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return body

    def put(self, key: tuple[str, int], body: bytes) -> None:
        if len(body) > self.max_bytes or key in self._items:
            return
        self._items[key] = body
        self.bytes += len(body)
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= len(old)
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def drop_file(self, name: str) -> None:
        """Forget every chunk of one file (it was removed)."""
        for key in [k for k in self._items if k[0] == name]:
            self.bytes -= len(self._items.pop(key))


def _tensors_of(path: Path) -> list[snapshot.TensorSlice]:
    total = path.stat().st_size
    first = read_at(path, 0, 8)
    header_len = snapshot.header_length(first, total)
    _, tensors = snapshot.parse_header(read_at(path, 0, 8 + header_len), total)
    return tensors


def check_layout(manifest: Manifest, path: Path) -> list[snapshot.TensorSlice]:
    """``path`` has the manifest's result size and tensor layout (names, dtypes, shapes: its
    header only, no digest). Raises ``ProtocolError``."""
    bad = ProtocolError(ErrorCode.BAD_MANIFEST, f"version {manifest.version}: result digest mismatch")
    try:
        if path.stat().st_size != manifest.result_bytes:
            raise bad
        tensors = _tensors_of(path)
    except OSError:
        raise bad from None
    if [(t.name, t.dtype, list(t.shape)) for t in tensors] != [
        (e.name, e.dtype, list(e.shape)) for e in manifest.tensors
    ]:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"version {manifest.version}: tensor digests mismatch")
    return tensors


def verify_result_file(manifest: Manifest, path: Path) -> None:
    """``path`` is exactly the version ``manifest`` describes: size, SHA-256 of the file and of
    every tensor (one sequential pass, ``BLOCK`` bytes in memory). Raises ``ProtocolError``."""
    bad = ProtocolError(ErrorCode.BAD_MANIFEST, f"version {manifest.version}: result digest mismatch")
    tensors = check_layout(manifest, path)
    whole = hashlib.sha256()
    hashers = [hashlib.sha256() for _ in tensors]
    ti, offset = 0, 0
    buf = bytearray(BLOCK)  # one buffer, reused: no allocation per block
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            view, end = memoryview(buf)[:n], offset + n
            whole.update(view)
            while ti < len(tensors) and tensors[ti].start < end:
                t = tensors[ti]
                hashers[ti].update(view[max(t.start, offset) - offset : min(t.end, end) - offset])
                if t.end > end:
                    break
                ti += 1
            offset = end
    if whole.digest() != manifest.result_digest:
        raise bad
    if [h.digest() for h in hashers] != [e.digest for e in manifest.tensors]:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"version {manifest.version}: tensor digests mismatch")


def chunks_match_file(manifest: Manifest, path: Path) -> bool:
    """``path`` is the manifest's payload: its size, and each chunk against its digest."""
    try:
        if path.stat().st_size != manifest.payload_bytes:
            return False
        with open(path, "rb") as f:
            return all(snapshot.digest(f.read(ref.size)) == ref.digest for ref in manifest.chunks)
    except OSError:
        return False


def apply_delta_file(base: Path, delta_path: Path, out: Path, *, base_digest: bytes | None = None) -> None:
    """Write ``out``: ``base`` with the delta payload in ``delta_path`` applied one tensor at a
    time (memory: the largest changed tensor). ``base_digest``, when the caller already verified
    ``base``, saves hashing it again. The result is not verified here: ``verify_result_file``.
    Raises ``ProtocolError``; ``out`` is removed on failure."""
    try:
        shutil.copyfile(base, out)  # in the kernel (sendfile/copy_file_range): no copy in memory
        tensors = _tensors_of(base)
        with open(delta_path, "rb") as f:
            header = _patch_tensors(out, tensors, f, os.fstat(f.fileno()).st_size)
        if header.get("format") != delta_mod.FORMAT:
            raise ProtocolError(ErrorCode.BAD_MANIFEST, f"not an {delta_mod.FORMAT} payload")
        if header.get("base_digest") != (base_digest or file_digest(base)):
            raise ProtocolError(ErrorCode.BAD_MANIFEST, "delta does not apply to this base version")
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def _patch_tensors(out: Path, tensors: list[snapshot.TensorSlice], f, size: int) -> dict:
    """Stream the delta map: apply its ``tensors`` entries to ``out`` as they are decoded;
    return the other fields (format, digests)."""
    unpacker = msgpack.Unpacker(
        f,
        raw=False,
        strict_map_key=True,
        ext_hook=delta_mod._no_ext,
        timestamp=0,
        max_buffer_size=max(1024, min(size, 2**32 - 1)),
    )
    header: dict = {}
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key != "tensors":
                header[key] = unpacker.unpack()
                continue
            if unpacker.read_array_header() != len(tensors):
                raise ProtocolError(ErrorCode.BAD_MANIFEST, "delta and base differ in tensor count")
            for t in tensors:
                _patch_one(out, t, unpacker.unpack())
    except (msgpack.UnpackException, ValueError) as exc:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"delta is not msgpack: {exc}") from None
    return header


def _patch_one(out: Path, t: snapshot.TensorSlice, entry: object) -> None:
    if isinstance(entry, dict) and entry.get("mode") == "same" and entry.get("name") == t.name:
        return
    buf = bytearray(read_at(out, t.start, t.end - t.start))
    delta_mod._apply_tensor(buf, dataclasses.replace(t, start=0, end=t.end - t.start), entry)
    write_at(out, t.start, buf)


def write_chunk(path: Path, manifest: Manifest, indices: list[int], d: bytes, data: bytes) -> None:
    """Check ``data`` is the manifest's chunk ``d`` (size and digest), then write it at each of
    its ``indices``. Raises ``ProtocolError(BAD_CHUNK)`` and writes nothing if it is not."""
    if len(data) != manifest.chunks[indices[0]].size or snapshot.digest(data) != d:
        raise ProtocolError(ErrorCode.BAD_CHUNK, "chunk bytes do not match their digest")
    for i in indices:
        write_at(path, i * manifest.chunk_bytes, data)


def rebuild_file(
    manifest: Manifest,
    payload: Path,
    base: Path | None,
    out: Path,
    *,
    base_digest: bytes | None = None,
    chunks_verified: bool = False,
) -> Path:
    """The version's safetensors file from its verified payload file: the payload itself for a
    full version, else ``out`` = the delta applied to ``base``; checked bit for bit against the
    manifest (``verify_result_file``). Raises ``ProtocolError`` (and removes ``out``).

    ``chunks_verified``: every chunk of ``payload`` was checked against the signed manifest's
    chunk digests before it was written, so a full version's bytes are already the learner's
    and only its layout is checked (two SHA-256 passes over the file saved: at 1 GB, ~1.3 s of
    a core per peer, at the very end of each broadcast)."""
    if manifest.kind == "full":
        if chunks_verified:
            check_layout(manifest, payload)
        else:
            verify_result_file(manifest, payload)
        return payload
    if base is None:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"delta v{manifest.version} needs its base version")
    apply_delta_file(base, payload, out, base_digest=base_digest)
    try:
        verify_result_file(manifest, out)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out
