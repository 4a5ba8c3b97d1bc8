"""Weights over the network, learner → node directly: the learner's ``WeightStore`` serves
signed manifests and chunks; ``fetch_weights`` is the node's fallback fetch path (the broadcast,
``broadcast/broadcaster.py`` + ``broadcast/relay.py``, is the primary one): for a node that has no version
yet or could not catch up. The store holds the same safetensors bytes the broadcast publishes.

Serialisation, hashing and deserialisation run in worker threads, never on the trio loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import trio

from echorl.protocol import snapshot
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Chunk, ChunkRequest, Manifest, ManifestRequest, Message

from echorl.net import routes
from echorl.net.host import Host, RequestContext


@dataclass
class Published:
    manifest: Manifest
    published_at: float
    build_seconds: float


class WeightStore:
    """The learner's last ``keep`` versions as manifests + content-addressed chunks."""

    def __init__(self, identity: Identity, run_id: str, keep: int = 4, upload_limit: Any = None) -> None:
        self.identity = identity
        self.limiter = upload_limit  # an UploadLimiter shared with the broadcast, or None
        self.run_id = run_id
        self.keep = max(1, keep)
        self.versions: OrderedDict[int, Published] = OrderedDict()
        self.chunks: dict[bytes, bytes] = {}
        self._refs: dict[bytes, int] = {}
        # (peer, version) -> [first request time, last chunk served time]
        self.fetches: dict[tuple[str, int], list[float]] = {}

    async def publish(self, version: int, state_dict: dict[str, Any]) -> Published:
        data = await trio.to_thread.run_sync(snapshot.state_dict_to_safetensors, state_dict)
        return await self.publish_bytes(version, data)

    async def publish_bytes(self, version: int, data: bytes) -> Published:
        """Hold ``version`` (a safetensors file) as a signed full manifest + chunks."""
        t0 = time.perf_counter()
        parent = next(reversed(self.versions)) if self.versions else -1

        def build() -> tuple[Manifest, list[bytes]]:
            return snapshot.build_manifest(self.identity, self.run_id, version, parent, data, data)

        manifest, chunks = await trio.to_thread.run_sync(build)
        for ref, data in zip(manifest.chunks, chunks):
            if ref.digest not in self.chunks:
                self.chunks[ref.digest] = data
            self._refs[ref.digest] = self._refs.get(ref.digest, 0) + 1
        pub = Published(manifest, time.time(), time.perf_counter() - t0)
        self.versions[version] = pub
        while len(self.versions) > self.keep:
            _, old = self.versions.popitem(last=False)
            for ref in old.manifest.chunks:
                self._refs[ref.digest] -= 1
                if self._refs[ref.digest] <= 0:
                    self._refs.pop(ref.digest)
                    self.chunks.pop(ref.digest, None)
        return pub

    @property
    def newest(self) -> int:
        return next(reversed(self.versions)) if self.versions else -1

    async def on_manifest(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, ManifestRequest)
        if msg.run_id != self.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"run {msg.run_id!r} is not served here")
        version = self.newest if msg.version == -1 else msg.version
        pub = self.versions.get(version)
        if pub is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"version {msg.version} not held")
        self.fetches[(ctx.peer_id, version)] = [time.monotonic(), time.monotonic()]
        if len(self.fetches) > 4096:
            self.fetches.pop(next(iter(self.fetches)))
        return pub.manifest

    async def on_chunk(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, ChunkRequest)
        data = self.chunks.get(msg.digest)
        if data is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "chunk not held")
        if self.limiter is not None:
            await self.limiter.acquire(len(data))
        for (peer, _v), span in list(self.fetches.items())[-64:]:
            if peer == ctx.peer_id:
                span[1] = time.monotonic()
        return Chunk(digest=msg.digest, data=data)

    def fetch_seconds(self, version: int) -> list[float]:
        """Per-peer serve time (manifest request → last chunk) of ``version``."""
        return [b - a for (p, v), (a, b) in self.fetches.items() if v == version]

    def install(self, host: Host) -> None:
        host.route(routes.MANIFEST, self.on_manifest, request=ManifestRequest,
                   max_request_bytes=routes.MAX_REQUEST_BYTES[routes.MANIFEST],
                   rate=routes.RATES[routes.MANIFEST])
        host.route(routes.CHUNK, self.on_chunk, request=ChunkRequest,
                   max_request_bytes=routes.MAX_REQUEST_BYTES[routes.CHUNK],
                   rate=routes.RATES[routes.CHUNK])


async def fetch_weights(host: Host, learner_peer_id: str, run_id: str, have_version: int,
                        timeout: float = 60.0) -> tuple[int, dict[str, Any], float] | None:
    """Fetch the learner's newest version if newer than ``have_version``: the manifest is
    verified against the pinned learner ID, every chunk against its digest, the file against
    the manifest. Returns (version, state dict, seconds) or None if nothing newer."""
    got = await fetch_weights_bytes(host, learner_peer_id, run_id, have_version, timeout)
    if got is None:
        return None
    version, payload, seconds = got
    state = await trio.to_thread.run_sync(snapshot.safetensors_to_state_dict, payload)
    return version, state, seconds


async def fetch_weights_bytes(host: Host, learner_peer_id: str, run_id: str, have_version: int,
                              timeout: float = 60.0) -> tuple[int, bytes, float] | None:
    """``fetch_weights`` without the decoding: (version, verified safetensors bytes, seconds)."""
    t0 = time.perf_counter()
    with trio.fail_after(timeout):
        manifest = await host.request(learner_peer_id, routes.MANIFEST,
                                      ManifestRequest(run_id=run_id, version=-1), expect=Manifest)
        assert isinstance(manifest, Manifest)
        if manifest.version <= have_version:
            return None
        await trio.to_thread.run_sync(snapshot.verify_manifest, manifest, learner_peer_id, run_id)
        assembler = snapshot.ChunkAssembler(manifest)
        for d in assembler.missing():
            reply = await host.request(learner_peer_id, routes.CHUNK, ChunkRequest(digest=d), expect=Chunk)
            assert isinstance(reply, Chunk)
            await trio.to_thread.run_sync(assembler.add, reply.digest, reply.data)

        def rebuild() -> bytes:
            payload = assembler.payload()
            snapshot.verify_result(manifest, payload)
            return payload

        payload = await trio.to_thread.run_sync(rebuild)
    return manifest.version, payload, time.perf_counter() - t0
