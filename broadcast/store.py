"""The one store of weight chunks a peer holds, for every use: ``VersionState`` (one version's
chunks as they are verified, what plan children are streamed) and ``HeldChain`` (the verified
versions kept after that: the newest full snapshot and the deltas after it, served to peers
catching up and to a node's direct fetch; on the learner also the older versions the spot
checker may still need).

Each chunk is held once, as the encoded ``Chunk`` frame body a parent forwards verbatim; its
bytes are a ``memoryview`` into that body, so the chain, the catch-up answers and the rebuilt
payload never hold a second copy. Both the learner's ``Broadcaster`` and every node's ``Relay``
serve from it (``broadcast/chunk_server.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import trio

from echorl.protocol import delta as delta_mod
from echorl.protocol import snapshot, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import Chunk, Manifest, PlanAnnounce
from echorl.protocol.plan import BroadcastPlan, PlanPeer, Stripe, plan_broadcast

ChunkBytes = bytes | memoryview
ChainEntry = tuple[Manifest, Mapping[bytes, ChunkBytes]]


def plan_of(ann: PlanAnnounce) -> BroadcastPlan:
    """The relay plan every node derives from a (verified) announcement."""
    learner = ann.learner_peer_id
    if ann.shape == "star":
        peers = tuple(sorted(m.peer_id for m in ann.members))
        return BroadcastPlan(learner, max(len(peers), 1), (Stripe(0, {learner: peers}),), peers)
    peers = [PlanPeer(m.peer_id, m.reachable) for m in ann.members]
    return plan_broadcast(learner, peers, ann.fanout, ann.seed, striped=ann.shape == "striped")


def chunk_body(d: bytes, data: ChunkBytes, body: bytes | None = None) -> tuple[bytes, memoryview]:
    """The frame body of chunk ``d`` and a view of its bytes inside it (one copy). A received
    ``body`` is kept when its bytes end it (msgpack puts ``data`` last); else it is re-encoded."""
    n = len(data)
    if body is None or not body.endswith(data):
        body = wire.encode(Chunk(digest=d, data=bytes(data)))
    return body, memoryview(body)[len(body) - n:]


def rebuild_version(manifest: Manifest, payload: bytes, base: bytes | None) -> bytes:
    """The version's safetensors file from a verified payload (a full file, or a delta applied
    to ``base``), checked bit for bit against the manifest. Raises ``ProtocolError``."""
    if manifest.kind == "full":
        result = payload
    elif base is None:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"delta v{manifest.version} needs its base version")
    else:
        result = delta_mod.apply_delta(base, payload)
    snapshot.verify_result(manifest, result)
    return result


def payload_chunks(manifest: Manifest, payload: bytes) -> dict[bytes, memoryview] | None:
    """Views of ``payload`` cut into the manifest's chunks, each checked against its digest;
    None if it does not match (then nothing is served from it)."""
    chunks: dict[bytes, memoryview] = {}
    view = memoryview(payload)
    offset = 0
    for ref in manifest.chunks:
        piece = view[offset:offset + ref.size]
        if snapshot.digest(piece) != ref.digest:
            return None
        chunks[ref.digest] = piece
        offset += ref.size
    return chunks if offset == len(payload) else None


class VersionState:
    """One version in flight at one peer: chunks as they are verified, waiters woken per chunk.

    ``bodies[i]`` is chunk i as an encoded ``Chunk`` message: what a parent forwards verbatim
    (verified once, never re-encoded); ``data[i]`` is a view of its bytes inside that body."""

    def __init__(self, ann: PlanAnnounce, me: str) -> None:
        self.announce = ann
        self.manifest = ann.manifest
        self.version = ann.version
        self.plan = plan_of(ann)
        self.me = me
        self.n = len(self.manifest.chunks)
        self.n_stripes = len(self.plan.stripes)
        self.bodies: list[bytes | None] = [None] * self.n
        self.data: list[memoryview | None] = [None] * self.n
        self.by_digest: dict[bytes, list[int]] = {}
        for i, ref in enumerate(self.manifest.chunks):
            self.by_digest.setdefault(ref.digest, []).append(i)
        self.parents = {s: st.parent_of().get(me) for s, st in enumerate(self.plan.stripes)}
        self.children = {s: st.children.get(me, ()) for s, st in enumerate(self.plan.stripes)}
        self._changed = trio.Event()
        self.done = trio.Event()
        self.started = time.monotonic()

    def stripe_indices(self, s: int) -> range:
        return range(s, self.n, self.n_stripes)

    def has(self, i: int) -> bool:
        return self.data[i] is not None

    def get_by_digest(self, d: bytes) -> memoryview | None:
        idx = self.by_digest.get(d)
        return None if not idx else self.data[idx[0]]

    def put(self, d: bytes, data: ChunkBytes, body: bytes | None = None) -> bool:
        """Store a chunk already verified against ``d``; True if new. Wakes all waiters."""
        idx = self.by_digest.get(d)
        if not idx or self.data[idx[0]] is not None:
            return False
        body, view = chunk_body(d, data, body)
        for i in idx:
            self.data[i] = view
            self.bodies[i] = body
        self._changed.set()
        self._changed = trio.Event()
        return True

    def verify(self, d: bytes, data: ChunkBytes) -> None:
        """Raise BAD_CHUNK unless ``data`` is the chunk the manifest names ``d``."""
        idx = self.by_digest.get(d)
        if not idx:
            raise ProtocolError(ErrorCode.BAD_CHUNK, "digest not in manifest")
        if len(data) != self.manifest.chunks[idx[0]].size or snapshot.digest(data) != d:
            raise ProtocolError(ErrorCode.BAD_CHUNK, "chunk bytes do not match their digest")

    async def wait_for(self, i: int) -> None:
        while self.data[i] is None:
            await self._changed.wait()

    def stripe_complete(self, s: int) -> bool:
        return all(self.data[i] is not None for i in self.stripe_indices(s))

    @property
    def complete(self) -> bool:
        return all(d is not None for d in self.data)

    def payload(self) -> bytes:
        return b"".join(self.data)  # type: ignore[arg-type]

    def chunks(self) -> dict[bytes, memoryview]:
        """``{digest: view}`` of a complete version (what ``HeldChain.hold`` keeps)."""
        return {ref.digest: self.data[idx[0]] for ref in self.manifest.chunks  # type: ignore[misc]
                for idx in (self.by_digest[ref.digest],)}


class HeldChain:
    """Verified versions held after their broadcast: runs of a full snapshot and the deltas after
    it, oldest first. ``retain`` (versions) keeps older runs while a version within ``retain`` of
    the newest still needs them (the learner: S, so every version a rollout may be sampled with
    can be rebuilt for a spot check); 0 keeps only the newest run (a relay).

    ``entries`` is replaced, never mutated, so a worker thread may read a snapshot of it."""

    def __init__(self, retain: int = 0) -> None:
        self.retain = max(0, retain)
        self.entries: list[ChainEntry] = []

    def hold(self, manifest: Manifest, chunks: Mapping[bytes, ChunkBytes]) -> None:
        """Add a verified version's payload chunks."""
        if manifest.kind == "full" or (self.entries and self.entries[-1][0].version == manifest.base_version):
            entries = self.entries + [(manifest, chunks)]
        else:
            entries = []  # a delta we cannot chain: serve nothing rather than a broken chain
        self.entries = self._trimmed(entries)

    def _trimmed(self, entries: list[ChainEntry]) -> list[ChainEntry]:
        if not entries:
            return entries
        cutoff = entries[-1][0].version - self.retain
        fulls = [i for i, (m, _) in enumerate(entries) if m.kind == "full"]
        older = [i for i in fulls if entries[i][0].version <= cutoff]
        return entries[(older[-1] if older else fulls[0]):]

    def clear(self) -> None:
        self.entries = []

    @property
    def version(self) -> int:
        return self.entries[-1][0].version if self.entries else -1

    def newest_run(self) -> list[Manifest]:
        """The newest full snapshot's manifest and every delta after it (what catch-up serves)."""
        manifests = [m for m, _ in self.entries]
        start = max((i for i, m in enumerate(manifests) if m.kind == "full"), default=len(manifests))
        return manifests[start:]

    def manifest(self, version: int) -> Manifest | None:
        return next((m for m, _ in reversed(self.entries) if m.version == version), None)

    def find_chunk(self, d: bytes) -> ChunkBytes | None:
        for _, chunks in reversed(self.entries):
            data = chunks.get(d)
            if data is not None:
                return data
        return None

    def version_bytes(self, version: int) -> bytes | None:
        """``version``'s safetensors file rebuilt from the held chunks (the full snapshot before
        it, then each delta), or None if not held. Pure computation: call it in a worker thread."""
        entries = self.entries
        at = next((i for i, (m, _) in enumerate(entries) if m.version == version), None)
        if at is None:
            return None
        start = max(i for i in range(at + 1) if entries[i][0].kind == "full")
        result: bytes | None = None
        for m, chunks in entries[start:at + 1]:
            result = rebuild_version(m, b"".join(chunks[ref.digest] for ref in m.chunks), result)
        return result

    def held_bytes(self) -> int:
        """Bytes of the distinct buffers the chain's chunks live in."""
        return distinct_bytes(c for _, chunks in self.entries for c in chunks.values())


def distinct_bytes(pieces: Iterable[ChunkBytes]) -> int:
    """Total size of the distinct buffers ``pieces`` (bytes or views into them) occupy."""
    seen: dict[int, int] = {}
    for p in pieces:
        buf = p.obj if isinstance(p, memoryview) else p
        seen[id(buf)] = len(buf)
    return sum(seen.values())
