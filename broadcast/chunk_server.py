"""The serving side of the one weight path: ``ChunkServer`` streams a version's chunks to plan
children (libp2p or the ticketed direct TCP path) and answers content-addressed ``ChunkRequest``
and ``CatchUpRequest`` from the peer's one store (``broadcast/store.py``: the versions in flight
and the held chain, as files; frames come from the chunk cache or are read by offset in a worker
thread). The learner's ``Broadcaster`` and each node's ``Relay`` use it alike; a
node's direct fetch from the learner is a catch-up with the learner as the only source.

Downloads outside the broadcast streams (``ChunkRequest``, ``CatchUpRequest``) can be limited:
``admit(peer)`` is asked before a request body is read (the learner admits only joined peers:
``not_found`` otherwise, ``fetch_refused_unjoined``), and ``fetch_limit`` paces each peer's chunk
bytes with a token bucket (``net/ratelimit.py``): a request waits for its bytes' tokens, or is
refused with ``rate_limited`` (``fetch_rate_limited``) if that wait would exceed
``fetch_max_wait_s``. Plan streams are not counted: the broadcast is never slowed by catch-ups."""

from __future__ import annotations

import logging
import os as _os
import time
from collections import OrderedDict
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from echorl.protocol import limits, snapshot, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import (
    CatchUp, CatchUpRequest, Chunk, ChunkRequest, Manifest, Message, StreamTicket, Subscribe,
)
from echorl.protocol.routes import CATCHUP, CHUNK, ROUTES, STREAM, TICKET

from echorl.broadcast.deadlines import Deadlines, upload_copies
from echorl.broadcast.store import HeldChain, VersionState, WeightStore
from echorl.net.framing import read_frame
from echorl.net.guard import ConnectionGuard, remote_ip
from echorl.net.host import Host, HostConfig, RequestContext
from echorl.net.ratelimit import RateLimit, TokenBuckets
from echorl.net.transport import Libp2pTransport, TcpStreamAdapter, UploadLimiter, ip_of, serve_raw
from echorl.protocol.identity import short_id

log = logging.getLogger("echorl.broadcast.chunk_server")


class ChunkServer:
    """What the learner and every relay share: serving chunk streams to their plan children,
    content-addressed chunk requests (recovery) and catch-up requests, from the versions in
    flight and the held chain (newest full snapshot + the deltas after it)."""

    def __init__(self, host: Host, run_id: str, limiter: UploadLimiter, *, keep: int = 3, retain: int = 0,
                 announce_wait_s: float = 15.0, io_timeout_s: float = 120.0, direct: bool = True,
                 deadlines: Deadlines | None = None, store: WeightStore | None = None,
                 admit: Callable[[str], bool] | None = None, fetch_limit: RateLimit | None = None,
                 fetch_max_wait_s: float = 30.0) -> None:
        self.host = host
        self.admit = admit  # None: anyone may fetch (a node's relay); the learner: joined peers
        self.fetch_buckets = TokenBuckets(fetch_limit) if fetch_limit is not None else None
        self.fetch_max_wait_s = fetch_max_wait_s
        self.counters = {"fetch_refused_unjoined": 0, "fetch_rate_limited": 0}
        hc = getattr(host, "config", None) or HostConfig()  # a stand-in host without one: the defaults
        self.handshake_timeout_s = hc.handshake_timeout_s  # the direct port's ticket must arrive by then
        self.direct_guard = ConnectionGuard(hc.connection_limits)  # the direct TCP port's connections
        self.run_id = run_id
        self.limiter = limiter
        self.keep = keep
        self.announce_wait_s = announce_wait_s
        self.deadlines = deadlines or Deadlines()
        self.transport = Libp2pTransport(host, STREAM, limiter, io_timeout=io_timeout_s)
        self.states: OrderedDict[int, VersionState] = OrderedDict()
        self._state_events: dict[int, trio.Event] = {}
        self.chain = HeldChain(retain)  # verified versions kept for catch-up (and spot checks)
        self.store = store or WeightStore()
        self.pinned: set[Path] = set()  # files in use besides the states and the chain
        self.direct = direct
        self.direct_port: int | None = None  # set while serve_direct runs
        self._tickets: dict[bytes, tuple[str, int, int, float]] = {}  # ticket -> (peer, version, stripe, expiry)
        # a direct connection whose ticket is not ours: a push ticket? (broadcast/push.py)
        self.accept_pushed: Callable[[bytes, TcpStreamAdapter], Awaitable[bool]] | None = None

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

    def locate(self, d: bytes) -> tuple[Path, int, int] | None:
        """(file, offset, size) of a held chunk: a version in flight, else the chain."""
        for state in reversed(self.states.values()):
            i = state.index_of(d)
            if i is not None:
                return state.path, state.offset(i), state.manifest.chunks[i].size
        return self.chain.locate(d)

    async def find_chunk(self, d: bytes) -> bytes | None:
        """A held chunk's bytes (read in a worker thread; not verified again), or None."""
        where = self.locate(d)
        if where is None:
            return None
        try:
            data = await self.store.read(*where)
        except OSError:
            return None
        return data if len(data) == where[2] else None

    def live_paths(self) -> set[Path]:
        return {s.path for s in self.states.values()} | self.chain.paths() | self.pinned

    async def collect(self) -> None:
        """Remove the weight files no version in flight, held version or pin uses."""
        await self.store.collect(self.live_paths())

    def held_bytes(self) -> int:
        """Bytes of weight files this peer holds on disk (versions in flight, the chain and
        pinned results), each file counted once."""
        return self.store.disk_bytes(self.live_paths())

    def memory_bytes(self) -> int:
        """Bytes of chunk bodies held in memory (the cache): bounded by its ``max_bytes``."""
        return self.store.cache.bytes

    # --- serving --------------------------------------------------------------------------------
    def install_serving(self) -> None:
        serve_raw(self.host, STREAM, self._on_stream)
        fetch = {CHUNK: self._admits, CATCHUP: self._admits} if self.admit is not None else None
        self.host.serve({CHUNK: self._on_chunk, CATCHUP: self._on_catch_up, TICKET: self._on_ticket}, admit=fetch)

    def _admits(self, peer_id: str) -> bool:
        ok = self.admit is None or self.admit(peer_id)
        if not ok:
            self.counters["fetch_refused_unjoined"] += 1
        return ok

    async def _pace(self, peer_id: str, nbytes: int) -> None:
        """Wait until ``peer_id`` may have ``nbytes`` more (``rate_limited`` if too long)."""
        if self.fetch_buckets is None:
            return
        wait = self.fetch_buckets.reserve(peer_id, nbytes, self.fetch_max_wait_s)
        if wait is None:
            self.counters["fetch_rate_limited"] += 1
            raise ProtocolError(ErrorCode.RATE_LIMITED, "download rate limit: retry later")
        if wait > 0:
            await trio.sleep(wait)

    async def _check_subscribe(self, sub: Subscribe, peer: str) -> VersionState:
        if sub.run_id != self.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "other run")
        state = await self.state_for(sub.version)
        if state is None or sub.stripe >= state.n_stripes or peer not in state.children[sub.stripe]:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"{short_id(peer)} is not my child in stripe {sub.stripe}")
        return state

    async def _on_stream(self, stream: Any, peer: str) -> None:
        body = await read_frame(stream, max_bytes=ROUTES[STREAM].max_request_bytes, first_byte_timeout=10.0, io_timeout=10.0)
        sub = wire.decode(body, expect=Subscribe)
        assert isinstance(sub, Subscribe)
        state = await self._check_subscribe(sub, peer)
        await self.serve_stripe(stream, state, sub.stripe)

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
        ip = remote_ip(tcp)
        with self.direct_guard.slot(ip) as ok:
            if ok:
                await self._serve_direct_conn(tcp)
            else:
                await trio.aclose_forcefully(tcp)

    async def _serve_direct_conn(self, tcp: trio.SocketStream) -> None:
        """One direct connection: its 16-byte ticket within the host's handshake deadline, then
        the ticket's stripe."""
        adapter = TcpStreamAdapter(tcp)
        try:
            with trio.fail_after(self.handshake_timeout_s):
                ticket = b""
                while len(ticket) < 16:
                    more = await tcp.receive_some(16 - len(ticket))
                    if not more:
                        return
                    ticket += more
            entry = self._tickets.pop(ticket, None)
            if entry is None and self.accept_pushed is not None and await self.accept_pushed(ticket, adapter):
                return
            if entry is None or entry[3] < time.monotonic():
                return
            _, version, stripe, _ = entry
            state = self.states.get(version)
            if state is not None:
                await self.serve_stripe(adapter, state, stripe)
        except Exception as exc:  # noqa: BLE001 - one child's stream must not end the listener
            log.info("direct stream ended: %s: %s", type(exc).__name__, exc)
        finally:
            await trio.aclose_forcefully(tcp)

    def stripe_deadline(self, state: VersionState, stripe: int) -> float:
        """Seconds a stripe's stream may take: its bytes, at the share of the busiest uploader's
        link one stripe gets, waited for through the plan's depth."""
        nbytes = sum(state.manifest.chunks[i].size for i in state.stripe_indices(stripe))
        return self.deadlines.for_bytes(int(nbytes * upload_copies(state.plan) * state.n_stripes),
                                        hops=state.plan.depth)

    async def serve_stripe(self, stream: Any, state: VersionState, stripe: int) -> None:
        with trio.fail_after(self.stripe_deadline(state, stripe)):
            for i in state.stripe_indices(stripe):
                await state.wait_for(i)
                await self.transport.send(stream, await state.body(i))
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
        where = self.locate(msg.digest)
        if where is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "chunk not held")
        await self._pace(ctx.peer_id, where[2])  # before the read: a paced request holds no chunk
        data = await self.find_chunk(msg.digest)
        if data is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "chunk not held")
        await self.limiter.acquire(len(data))
        return Chunk(digest=msg.digest, data=data)

    async def _on_catch_up(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, CatchUpRequest)
        run = self.chain.newest_run()
        if msg.run_id != self.run_id or not run:
            raise ProtocolError(ErrorCode.NOT_FOUND, "no chain held")
        versions = [m.version for m in run]
        if msg.have_version in versions:
            run = [m for m in run if m.version > msg.have_version]
        page = catch_up_page(run)
        return CatchUp(run_id=self.run_id, manifests=page, more=len(page) < len(run))


def catch_up_page(run: list[Manifest]) -> list[Manifest]:
    """The first manifests of ``run`` (oldest first) that fit one ``CatchUp`` page: the first
    whatever its size, then more while the page stays within ``CATCHUP_PAGE_BYTES``."""
    page: list[Manifest] = []
    used = 0
    for m in run[:256]:
        size = snapshot.manifest_wire_bytes(m)
        if page and used + size > limits.CATCHUP_PAGE_BYTES:
            break
        page.append(m)
        used += size
    return page


def _listen_ip(host: Host) -> str:
    return ip_of(host.addrs) or "127.0.0.1"


def _as_limiter(upload_limit: UploadLimiter | float | None) -> UploadLimiter:
    if isinstance(upload_limit, UploadLimiter):
        return upload_limit
    return UploadLimiter(upload_limit)  # bytes per second, None = unlimited
