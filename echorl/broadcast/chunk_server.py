"""The serving side of the one weight path: ``ChunkServer`` streams a version's chunks to plan
children (libp2p streams through ``serve_raw``, or the ticketed direct TCP path: its
``TicketBook`` issues the tickets, its ``DirectListener`` is the port; ``net/transport/``) and
answers content-addressed ``ChunkRequest`` and ``CatchUpRequest`` from the peer's one store
(``broadcast/store.py``: the versions in flight and the held chain, as files; frames come from
the chunk cache or are read by offset in a worker thread). The learner's ``Broadcaster`` and
each node's ``Relay`` use it alike; a node's direct fetch from the learner is a catch-up with
the learner as the only source.

Who may use the weight routes (chunk streams, tickets, ``ChunkRequest``, ``CatchUpRequest``):
``admit(peer)`` is asked before any body is read (the learner admits joined peers, a node the
learner and the members of the plans it holds, ``Relay.is_member``; ``not_found`` otherwise,
``fetch_refused_unjoined``). ``fetch_limit`` paces the chunk bytes of each peer (a node: of each
address, ``fetch_per_address``) with a token bucket (``net/ratelimit.py``): a request waits for
its bytes' tokens, or is refused with ``rate_limited`` (``fetch_rate_limited``) if that wait
would exceed ``fetch_max_wait_s``. Plan streams are not counted: the broadcast is never slowed
by catch-ups."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import trio

from echorl.broadcast.deadlines import Deadlines, upload_copies
from echorl.broadcast.store import HeldChain, VersionState, WeightStore
from echorl.net.guard import ConnectionGuard
from echorl.net.host import Host, HostConfig, RequestContext
from echorl.net.hostkey import ip_key
from echorl.net.ratelimit import RateLimit, TokenBuckets
from echorl.net.transport import (
    ChunkDialer,
    ChunkStream,
    DirectListener,
    Edge,
    TicketBook,
    UploadLimiter,
    serve_raw,
)
from echorl.protocol import limits, snapshot
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import (
    CatchUp,
    CatchUpRequest,
    Chunk,
    ChunkRequest,
    Manifest,
    Message,
    StreamTicket,
    Subscribe,
)
from echorl.protocol.routes import CATCHUP, CHUNK, STREAM, TICKET

log = logging.getLogger("echorl.broadcast.chunk_server")


class ChunkServer:
    """What the learner and every relay share: serving chunk streams to their plan children,
    content-addressed chunk requests (recovery) and catch-up requests, from the versions in
    flight and the held chain (newest full snapshot + the deltas after it)."""

    def __init__(
        self,
        host: Host,
        run_id: str,
        limiter: UploadLimiter,
        *,
        keep: int = 3,
        retain: int = 0,
        announce_wait_s: float = 15.0,
        io_timeout_s: float = 120.0,
        direct: bool = True,
        deadlines: Deadlines | None = None,
        store: WeightStore | None = None,
        admit: Callable[[str], bool] | None = None,
        fetch_limit: RateLimit | None = None,
        fetch_per_address: bool = False,
        fetch_max_wait_s: float = 30.0,
    ) -> None:
        self.host = host
        # who may send a body on the weight routes (None: anyone): joined peers on the learner,
        # the learner and the members of a plan held on a node (broadcast/relay.py)
        self.admit = admit
        self.fetch_buckets = TokenBuckets(fetch_limit) if fetch_limit is not None else None
        self.fetch_per_address = fetch_per_address  # one bucket per address (net/guard.ip_key), not per peer
        self.fetch_max_wait_s = fetch_max_wait_s
        self.counters = {"fetch_refused_unjoined": 0, "fetch_rate_limited": 0}
        hc = getattr(host, "config", None) or HostConfig()  # a stand-in host without one: the defaults
        self.run_id = run_id
        self.limiter = limiter
        self.io_timeout = io_timeout_s
        self.keep = keep
        self.announce_wait_s = announce_wait_s
        self.deadlines = deadlines or Deadlines()
        self.states: OrderedDict[int, VersionState] = OrderedDict()
        self.plan_members: frozenset[str] = frozenset()  # the learners and members of the plans in flight
        self._plans_changed = trio.Event()  # set (and replaced) whenever plan_members changes
        self._state_events: dict[int, trio.Event] = {}
        self.chain = HeldChain(retain)  # verified versions kept for catch-up (and spot checks)
        self.store = store or WeightStore()
        self.pinned: set[Path] = set()  # files in use besides the states and the chain
        self.direct = direct
        # the direct TCP port (net/transport/direct_tcp.py): tickets for plan children and, on a
        # node, for pushing parents (broadcast/push.py); its connections guarded per address
        self.tickets = TicketBook()
        self.direct_guard = ConnectionGuard(hc.connection_limits)
        self.listener = DirectListener(
            self.tickets.admit,
            self.direct_guard,
            handshake_timeout_s=hc.handshake_timeout_s,  # the ticket proof must arrive by then
            limiter=limiter,
            io_timeout=io_timeout_s,
        )

    @property
    def direct_port(self) -> int | None:
        """The direct TCP port while ``serve_direct`` runs, else None."""
        return self.listener.port

    def dialer(self, edge: Edge, ticket_timeout_s: float) -> ChunkDialer:
        """Opens chunk streams of one dialing direction from this peer (``net/transport/paths.py``)."""
        return ChunkDialer(
            self.host,
            edge,
            self.limiter,
            direct=self.direct,
            io_timeout=self.io_timeout,
            ticket_timeout_s=ticket_timeout_s,
        )

    # --- state bookkeeping ------------------------------------------------------------------------
    def add_state(self, state: VersionState) -> None:
        self.states[state.version] = state
        while len(self.states) > self.keep:
            self.states.popitem(last=False)
        self._note_members()
        ev = self._state_events.pop(state.version, None)
        if ev is not None:
            ev.set()

    def clear_states(self) -> None:
        """Forget every version in flight (the learner restarted or changed)."""
        self.states.clear()
        self._note_members()

    def in_a_plan(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is a member (or the learner) of a plan in flight here."""
        return peer_id in self.plan_members

    def _note_members(self) -> None:
        peers = {p for s in self.states.values() for p in s.plan.peers}
        self.plan_members = frozenset(peers | {s.plan.learner for s in self.states.values()})
        self._plans_changed.set()
        self._plans_changed = trio.Event()

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
        """The weight routes: chunk streams (raw), tickets, chunk and catch-up requests, each
        behind ``admit`` (asked before any body is read) when there is one."""
        if self.admit is None:
            serve_raw(self.host, STREAM, self._on_stream, self.limiter, self.io_timeout)
            self.host.serve({CHUNK: self._on_chunk, CATCHUP: self._on_catch_up, TICKET: self._on_ticket})
            return
        serve_raw(self.host, STREAM, self._on_stream, self.limiter, self.io_timeout, admit=self.admits_soon)
        self.host.serve(
            {CHUNK: self._on_chunk, CATCHUP: self._on_catch_up, TICKET: self._on_ticket},
            admit={CHUNK: self.admits, CATCHUP: self.admits, TICKET: self.admits_soon},
        )

    def admits(self, peer_id: str) -> bool:
        ok = self.admit is None or self.admit(peer_id)
        if not ok:
            self.counters["fetch_refused_unjoined"] += 1
        return ok

    async def admits_soon(self, peer_id: str) -> bool:
        """``admits``, or, for a peer not admitted yet, once a new plan arrives here that admits
        it (within ``announce_wait_s``): the routes a plan edge opens (chunk streams, tickets,
        pushes) are used the moment one end has the announcement, which the other may get a
        little later. Asked before any body is read, like ``admits``."""
        if self.admit is None or self.admit(peer_id):
            return True
        with trio.move_on_after(self.announce_wait_s):
            while not self.admit(peer_id):
                await self._plans_changed.wait()
            return True
        return self.admits(peer_id)  # counted as a refusal

    async def _pace(self, peer_id: str, nbytes: int) -> None:
        """Wait until ``peer_id`` (its address, with ``fetch_per_address``) may have ``nbytes``
        more (``rate_limited`` if too long)."""
        if self.fetch_buckets is None:
            return
        key = (ip_key(self.host.remote_ip(peer_id)) or peer_id) if self.fetch_per_address else peer_id
        wait = self.fetch_buckets.reserve(key, nbytes, self.fetch_max_wait_s)
        if wait is None:
            self.counters["fetch_rate_limited"] += 1
            raise ProtocolError(ErrorCode.RATE_LIMITED, "download rate limit: retry later")
        if wait > 0:
            await trio.sleep(wait)

    async def _check_subscribe(self, sub: Subscribe, peer: str) -> VersionState:
        if sub.run_id != self.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "other run")
        state = await self.state_for(sub.version)
        if state is None or sub.stripe >= state.n_stripes or not state.adopt(sub.stripe, peer):
            raise ProtocolError(ErrorCode.NOT_FOUND, f"{short_id(peer)} is not my child in stripe {sub.stripe}")
        if peer not in state.children.get(sub.stripe, ()):
            log.info("v%d stripe %d: adopting %s from chunk %d", sub.version, sub.stripe, short_id(peer), sub.skip or 0)
        return state

    async def _on_stream(self, sub: Subscribe, stream: ChunkStream, peer: str) -> None:
        await self.serve_stripe(stream, await self._check_subscribe(sub, peer), sub.stripe, sub.skip or 0)

    async def _on_ticket(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, Subscribe)
        if self.direct_port is None:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "no direct path here")
        await self._check_subscribe(msg, ctx.peer_id)
        version, stripe, skip = msg.version, msg.stripe, msg.skip or 0

        async def on_connect(stream: ChunkStream) -> None:
            state = self.states.get(version)
            if state is not None:
                await self.serve_stripe(stream, state, stripe, skip)

        return StreamTicket(ticket=self.tickets.issue(ctx.peer_id, on_connect), port=self.direct_port)

    async def serve_direct(self, listen_ip: str = "127.0.0.1", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The direct TCP chunk port (runs until cancelled; its port goes to ``task_status``)."""
        await self.listener.serve(listen_ip, task_status=task_status)

    def stripe_deadline(self, state: VersionState, stripe: int) -> float:
        """Seconds a stripe's stream may take: its bytes, at the share of the busiest uploader's
        link one stripe gets, waited for through the plan's depth."""
        nbytes = sum(state.manifest.chunks[i].size for i in state.stripe_indices(stripe))
        return self.deadlines.for_bytes(
            int(nbytes * upload_copies(state.plan) * state.n_stripes), hops=state.plan.depth
        )

    async def serve_stripe(self, stream: ChunkStream, state: VersionState, stripe: int, skip: int = 0) -> None:
        """Send ``stripe``'s chunks but the first ``skip`` on ``stream`` as each arrives here,
        then close it cleanly."""
        with trio.fail_after(self.stripe_deadline(state, stripe)):
            for i in state.stripe_indices(stripe)[skip:]:
                await state.wait_for(i)
                await stream.send(await state.body(i))
            await stream.close()

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


def _as_limiter(upload_limit: UploadLimiter | float | None) -> UploadLimiter:
    if isinstance(upload_limit, UploadLimiter):
        return upload_limit
    return UploadLimiter(upload_limit)  # bytes per second, None = unlimited
