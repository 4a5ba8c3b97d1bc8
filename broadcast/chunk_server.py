"""The shared core of the weight broadcast: protocol IDs, the plan a node derives from a
verified ``PlanAnnounce``, ``VersionState`` (chunks of one version as they are verified, with
waiters woken per chunk) and ``ChunkServer`` (chunk streams to plan children over libp2p or the
ticketed direct TCP path, content-addressed ``ChunkRequest`` and ``CatchUpRequest`` answers).
Used by the learner's ``Broadcaster`` (broadcast/broadcaster.py) and each node's ``Relay``
(broadcast/relay.py)."""

from __future__ import annotations

import logging
import os as _os
import time
from collections import OrderedDict
from typing import Any

import trio

from echorl.protocol import limits, snapshot, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import (
    CatchUp, CatchUpRequest, Chunk, ChunkRequest, Manifest, Message, PlanAnnounce, StreamTicket, Subscribe,
)
from echorl.protocol.plan import BroadcastPlan, PlanPeer, Stripe, plan_broadcast

from echorl.net.framing import read_frame
from echorl.net.host import Host, RequestContext
from echorl.net.ratelimit import RateLimit
from echorl.net.transport import Libp2pTransport, TcpStreamAdapter, UploadLimiter, ip_of, serve_raw
from echorl.protocol.identity import short_id

log = logging.getLogger("echorl.broadcast.chunk_server")

ANNOUNCE = "/echorl/bcast/announce/1"
STREAM = "/echorl/bcast/stream/1"
CHUNK = "/echorl/bcast/chunk/1"
CATCHUP = "/echorl/bcast/catchup/1"
DONE = "/echorl/bcast/done/1"
TICKET = "/echorl/bcast/ticket/1"  # Subscribe -> StreamTicket (direct TCP chunk path)

DEFAULT_CHUNK_BYTES = 256 * limits.KiB
CHUNK_RATE = RateLimit(2000.0, 4000.0)


def plan_of(ann: PlanAnnounce) -> BroadcastPlan:
    """The relay plan every node derives from a (verified) announcement."""
    learner = ann.learner_peer_id
    if ann.shape == "star":
        peers = tuple(sorted(m.peer_id for m in ann.members))
        return BroadcastPlan(learner, max(len(peers), 1), (Stripe(0, {learner: peers}),), peers)
    peers = [PlanPeer(m.peer_id, m.reachable) for m in ann.members]
    return plan_broadcast(learner, peers, ann.fanout, ann.seed, striped=ann.shape == "striped")


class VersionState:
    """One version in flight at one peer: chunks as they are verified, waiters woken per chunk.

    ``bodies[i]`` is chunk i as an encoded ``Chunk`` message: what a parent forwards verbatim
    (verified once, never re-encoded)."""

    def __init__(self, ann: PlanAnnounce, me: str) -> None:
        self.announce = ann
        self.manifest = ann.manifest
        self.version = ann.version
        self.plan = plan_of(ann)
        self.me = me
        self.n = len(self.manifest.chunks)
        self.n_stripes = len(self.plan.stripes)
        self.bodies: list[bytes | None] = [None] * self.n
        self.data: list[bytes | None] = [None] * self.n
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

    def get_by_digest(self, d: bytes) -> bytes | None:
        idx = self.by_digest.get(d)
        return None if not idx else self.data[idx[0]]

    def put(self, d: bytes, data: bytes, body: bytes | None = None) -> bool:
        """Store a chunk already verified against ``d``; True if new. Wakes all waiters."""
        idx = self.by_digest.get(d)
        if not idx or self.data[idx[0]] is not None:
            return False
        if body is None:
            body = wire.encode(Chunk(digest=d, data=data))
        for i in idx:
            self.data[i] = data
            self.bodies[i] = body
        self._changed.set()
        self._changed = trio.Event()
        return True

    def verify(self, d: bytes, data: bytes) -> None:
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


class ChunkServer:
    """What the learner and every relay share: serving chunk streams to their plan children,
    content-addressed chunk requests (recovery) and catch-up requests, from the versions in
    flight and the held chain (newest full snapshot + the deltas after it)."""

    def __init__(self, host: Host, run_id: str, limiter: UploadLimiter, *, keep: int = 3,
                 announce_wait_s: float = 15.0, stream_timeout_s: float = 600.0, io_timeout_s: float = 120.0,
                 direct: bool = True) -> None:
        self.host = host
        self.run_id = run_id
        self.limiter = limiter
        self.keep = keep
        self.announce_wait_s = announce_wait_s
        self.stream_timeout_s = stream_timeout_s
        self.transport = Libp2pTransport(host, STREAM, limiter, io_timeout=io_timeout_s)
        self.states: OrderedDict[int, VersionState] = OrderedDict()
        self._state_events: dict[int, trio.Event] = {}
        # chain held for catch-up: [(manifest, {digest: data})], oldest (a full snapshot) first
        self.chain: list[tuple[Manifest, dict[bytes, bytes]]] = []
        self.tamper = False  # tests only: a malicious relay that alters what it forwards
        self.served_streams = 0
        self.direct = direct
        self.direct_port: int | None = None  # set while serve_direct runs
        self._tickets: dict[bytes, tuple[str, int, int, float]] = {}  # ticket -> (peer, version, stripe, expiry)

    # --- state bookkeeping ------------------------------------------------------------------------
    def add_state(self, state: VersionState) -> None:
        self.states[state.version] = state
        while len(self.states) > self.keep:
            self.states.popitem(last=False)
        ev = self._state_events.pop(state.version, None)
        if ev is not None:
            ev.set()

    async def state_for(self, version: int) -> VersionState | None:
        if version in self.states:
            return self.states[version]
        if len(self._state_events) > 64:
            return None
        ev = self._state_events.setdefault(version, trio.Event())
        with trio.move_on_after(self.announce_wait_s):
            await ev.wait()
        return self.states.get(version)

    def hold(self, manifest: Manifest, chunks: dict[bytes, bytes]) -> None:
        """Add a verified version's payload chunks to the catch-up chain."""
        if manifest.kind == "full":
            self.chain = [(manifest, chunks)]
        elif self.chain and self.chain[-1][0].version == manifest.base_version:
            self.chain.append((manifest, chunks))
        else:
            self.chain = []  # a delta we cannot chain: serve nothing rather than a broken chain

    @property
    def held_version(self) -> int:
        return self.chain[-1][0].version if self.chain else -1

    def find_chunk(self, d: bytes) -> bytes | None:
        for state in reversed(self.states.values()):
            data = state.get_by_digest(d)
            if data is not None:
                return data
        for _, chunks in reversed(self.chain):
            if d in chunks:
                return chunks[d]
        return None

    # --- serving --------------------------------------------------------------------------------
    def install_serving(self) -> None:
        serve_raw(self.host, STREAM, self._on_stream)
        self.host.route(CHUNK, self._on_chunk, request=ChunkRequest, max_request_bytes=1024, rate=CHUNK_RATE)
        self.host.route(CATCHUP, self._on_catch_up, request=CatchUpRequest, max_request_bytes=1024,
                        rate=RateLimit(10.0, 30.0))
        self.host.route(TICKET, self._on_ticket, request=Subscribe, max_request_bytes=1024,
                        rate=RateLimit(50.0, 200.0))

    async def _check_subscribe(self, sub: Subscribe, peer: str) -> VersionState:
        if sub.run_id != self.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "other run")
        state = await self.state_for(sub.version)
        if state is None or sub.stripe >= state.n_stripes or peer not in state.children[sub.stripe]:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"{short_id(peer)} is not my child in stripe {sub.stripe}")
        return state

    async def _on_stream(self, stream: Any, peer: str) -> None:
        body = await read_frame(stream, max_bytes=1024, first_byte_timeout=10.0, io_timeout=10.0)
        sub = wire.decode(body, expect=Subscribe)
        assert isinstance(sub, Subscribe)
        state = await self._check_subscribe(sub, peer)
        await self._serve_stripe(stream, state, sub.stripe)

    async def _on_ticket(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, Subscribe)
        if self.direct_port is None:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "no direct path here")
        await self._check_subscribe(msg, ctx.peer_id)
        now = time.monotonic()
        for t, (_, _, _, exp) in list(self._tickets.items()):
            if exp < now:
                del self._tickets[t]
        if len(self._tickets) > 1024:
            raise ProtocolError(ErrorCode.RATE_LIMITED, "too many open tickets")
        ticket = _os.urandom(16)
        self._tickets[ticket] = (ctx.peer_id, msg.version, msg.stripe, now + 30.0)
        return StreamTicket(ticket=ticket, port=self.direct_port)

    async def serve_direct(self, listen_ip: str = "127.0.0.1", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The direct TCP chunk listener (runs until cancelled)."""
        listeners = await trio.open_tcp_listeners(0, host=listen_ip)
        self.direct_port = listeners[0].socket.getsockname()[1]
        task_status.started(self.direct_port)
        try:
            await trio.serve_listeners(self._on_direct, listeners)
        finally:
            self.direct_port = None

    async def _on_direct(self, tcp: trio.SocketStream) -> None:
        adapter = TcpStreamAdapter(tcp)
        try:
            with trio.fail_after(10.0):
                ticket = b""
                while len(ticket) < 16:
                    more = await tcp.receive_some(16 - len(ticket))
                    if not more:
                        return
                    ticket += more
            entry = self._tickets.pop(ticket, None)
            if entry is None or entry[3] < time.monotonic():
                return
            _, version, stripe, _ = entry
            state = self.states.get(version)
            if state is not None:
                await self._serve_stripe(adapter, state, stripe)
        except Exception as exc:  # noqa: BLE001 - one child's stream must not end the listener
            log.info("direct stream ended: %s: %s", type(exc).__name__, exc)
        finally:
            await trio.aclose_forcefully(tcp)

    async def _serve_stripe(self, stream: Any, state: VersionState, stripe: int) -> None:
        self.served_streams += 1
        with trio.fail_after(self.stream_timeout_s):
            for i in state.stripe_indices(stripe):
                await state.wait_for(i)
                body = state.bodies[i]
                assert body is not None
                if self.tamper:
                    data = bytearray(state.data[i])  # type: ignore[arg-type]
                    data[len(data) // 2] ^= 0xFF
                    body = wire.encode(Chunk(digest=state.manifest.chunks[i].digest, data=bytes(data)))
                await self.transport.send(stream, body)
            with trio.move_on_after(5.0):
                await stream.close()

    def parent_ip(self, state: VersionState, parent: str) -> str | None:
        if parent == state.announce.learner_peer_id:
            return ip_of(state.announce.learner_addrs)
        for m in state.announce.members:
            if m.peer_id == parent:
                return ip_of(m.addrs)
        return None

    async def _on_chunk(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, ChunkRequest)
        data = self.find_chunk(msg.digest)
        if data is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "chunk not held")
        await self.limiter.acquire(len(data))
        return Chunk(digest=msg.digest, data=data)

    async def _on_catch_up(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, CatchUpRequest)
        if msg.run_id != self.run_id or not self.chain:
            raise ProtocolError(ErrorCode.NOT_FOUND, "no chain held")
        versions = [m.version for m, _ in self.chain]
        if msg.have_version in versions:
            manifests = [m for m, _ in self.chain if m.version > msg.have_version]
        else:
            manifests = [m for m, _ in self.chain]
        return CatchUp(run_id=self.run_id, manifests=manifests[-256:])


def _listen_ip(host: Host) -> str:
    return ip_of(host.addrs) or "127.0.0.1"


def _as_limiter(upload_limit: UploadLimiter | float | None) -> UploadLimiter:
    if isinstance(upload_limit, UploadLimiter):
        return upload_limit
    return UploadLimiter(upload_limit)  # bytes per second, None = unlimited
