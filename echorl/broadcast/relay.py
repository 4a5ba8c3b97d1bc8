"""Node side of the broadcast: receive a version's chunks from plan parents, verify each, forward
at once to plan children (cut-through), apply the version when complete, recover, catch up.

Contract (see also ``broadcast/broadcaster.py``)::

    relay = Relay(host, learner_peer_id, run_id, on_version=cb,        # cb(version, bytes), sync or async
                  upload_limit=UploadLimiter.from_mbps(mbps),          # or bytes/s, or None
                  stall_s=10.0, direct=True)
    relay.install()                                  # routes on the node's Host
    nursery.start_soon(relay.run)                    # receive jobs + the direct TCP chunk port
    await relay.catch_up()                           # late joiner / missed versions: newest full
                                                     # snapshot + deltas from any holder
    relay.version, relay.result_path                 # newest fully verified version and its file

``on_version(version, path)`` runs on the trio loop after the version is verified and reported
to the learner, with the version's safetensors file: a sync callback must be quick (hand heavy
work such as ``load_state_dict`` to a thread); an async one is awaited (the next version's
relaying continues meanwhile, in other tasks). Weights live on disk (``store_dir``, a temporary
directory by default): each version's payload is a file written chunk by chunk as each chunk is
verified, a delta's result another file; memory holds the chunk cache (``cache_bytes``) and the
largest changed tensor while a delta is applied, whatever the model's size. The file must not be
modified; a caller that keeps it past the next version hard-links it (``SnapshotKeeper``).

A version is used (``on_version``, ``relay.result``) only after the rebuilt safetensors file
matched the signed manifest's result digest and every tensor digest. A parent that sends a bad
chunk or stays silent for ``stall_s`` is reported to the learner (``BroadcastDone.suspects``)
and its stripe comes from the nearest ancestor that adopts it, what is still missing from
other holders, the learner last (``broadcast/stripe_feed.py``).

No torch here: a relay moves bytes (``python -m echorl.broadcast.relay_process`` runs one as a process, for
benchmarks and tests; it prints JSON lines: ready, version, done).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from echorl.broadcast.chunk_server import ChunkServer
from echorl.broadcast.deadlines import Deadlines, upload_copies
from echorl.broadcast.files import (
    chunks_match_file,
    file_digest,
    rebuild_file,
    write_at,
)
from echorl.broadcast.push import Pusher, PushInbox
from echorl.broadcast.recovery import fetch_payload
from echorl.broadcast.store import DEFAULT_CACHE_BYTES, VersionState, WeightStore, link_or_copy
from echorl.broadcast.stripe_feed import StripeFeed
from echorl.net.host import MAX_NOTED_PEERS, Host, PeerUnavailable, RemoteError, RequestContext
from echorl.net.ratelimit import RateLimit
from echorl.net.transport import PULL, UploadLimiter, listen_ip
from echorl.protocol import limits, snapshot, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import (
    AnnounceHeard,
    BroadcastAck,
    BroadcastDone,
    CatchUp,
    CatchUpRequest,
    Manifest,
    Message,
    PlanAnnounce,
    PlanMember,
)
from echorl.protocol.routes import ANNOUNCE, CATCHUP, DONE, HEARD

log = logging.getLogger("echorl.broadcast.relay")

VersionCallback = Callable[[int, Path], Any]
TICKET_WAIT_S = 10.0  # a plan parent answers a direct-path ticket request within this long
#: what one address may pull from a node outside the plan streams (chunk and catch-up requests of
#: members recovering or catching up): well above a volunteer's uplink share per peer, so it
#: never slows an honest catch-up, but one host (or a crowd of identities behind one address)
#: cannot take a node's whole uplink; the node's ``UploadLimiter`` caps all of it together
NODE_FETCH_LIMIT = RateLimit(16 * 2**20, 64 * 2**20)
REPORT_TIMEOUT_S = 10.0  # a small report to the learner (BroadcastDone, AnnounceHeard)


class Relay:
    def __init__(
        self,
        host: Host,
        learner_peer_id: str,
        run_id: str,
        *,
        on_version: VersionCallback | None = None,
        upload_limit: UploadLimiter | float | None = None,
        stall_s: float = 10.0,
        version_timeout_s: float | None = None,
        keep: int = 3,
        direct: bool = True,
        deadlines: Deadlines | None = None,
        store_dir: Path | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.host = host
        self.learner = learner_peer_id
        self.run_id = run_id
        self.on_version = on_version
        self.stall_s = stall_s
        self.version_timeout_s = version_timeout_s  # None: scaled with the version's bytes
        self.deadlines = deadlines or Deadlines()
        limiter = upload_limit if isinstance(upload_limit, UploadLimiter) else UploadLimiter(upload_limit)
        self.server = ChunkServer(
            host,
            run_id,
            limiter,
            keep=keep,
            direct=direct,
            deadlines=self.deadlines,
            store=WeightStore(store_dir, cache_bytes),
            admit=self.is_member,
            fetch_limit=NODE_FETCH_LIMIT,
            fetch_per_address=True,
        )
        self.direct = direct
        self.pull = self.server.dialer(PULL, ticket_timeout_s=TICKET_WAIT_S)  # our plan parents
        self.inbox = PushInbox(self.server)  # behind NAT, parents push to us; we push to children
        self.pusher = Pusher(self.server)
        self.feed = StripeFeed(
            host, run_id, self.pull, self.inbox, self.deadlines, stall_s, self.server.announce_wait_s
        )
        self._push_nursery: trio.Nursery | None = None
        self.version = -1
        # the learner process our node joined under (None: not yet joined): manifests of another
        # are refused; and the one that signed the version we hold (None: none, or unknown)
        self.incarnation: bytes | None = None
        self.held_incarnation: bytes | None = None
        self.result_path: Path | None = None  # the newest verified version's safetensors file
        self._result_digest: bytes | None = None
        self.known_peers: dict[str, tuple[str, ...]] = {}  # peer -> addrs, from announcements
        self._unreachable: set[str] = set()  # known peers announced as not dialable (behind NAT)
        self._jobs_send, self._jobs_recv = trio.open_memory_channel[PlanAnnounce](16)
        self._apply_lock = trio.Lock()

    # --- wiring ---------------------------------------------------------------------------------
    def install(self) -> None:
        self.server.install_serving()
        self.inbox.install()
        self.host.serve({ANNOUNCE: self._on_announce}, admit={ANNOUNCE: self.may_announce})

    def is_member(self, peer_id: str) -> bool:
        """Who may send a body on this node's weight routes (chunk streams, tickets, chunk and
        catch-up requests): the pinned learner and the members of a plan this node holds."""
        return peer_id == self.learner or self.server.in_a_plan(peer_id)

    def may_announce(self, peer_id: str) -> bool:
        """Whose announcements (up to 16 MiB) are read at all: the pinned learner and the members
        of a plan this node holds (a stripe-0 parent forwards the learner's announcement,
        ``broadcast/announcing.py``); the handler takes only what the learner signed."""
        return peer_id == self.learner or self.server.in_a_plan(peer_id)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._push_nursery = nursery
            if self.direct:
                await nursery.start(self.server.serve_direct, listen_ip(self.host))
            async for ann in self._jobs_recv:
                nursery.start_soon(self._receive_guarded, ann)

    async def _on_announce(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, PlanAnnounce)
        if msg.run_id != self.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"run {msg.run_id!r} is not served here")
        forwarded = ctx.peer_id != self.learner
        # a member's copy of one already taken, or older than what it holds (caught up to exactly
        # this version: taken, so its plan children get their chunks): answered, nothing to check
        if forwarded and (msg.version in self.server.states or msg.version < self.version):
            return BroadcastAck(run_id=self.run_id, version=msg.version, have_version=self.version)
        me = self.host.peer_id

        def check() -> tuple[VersionState, list[str], bytes]:  # 10,000 members: ~0.3 s of CPU, off the loop
            wire.verify(msg, expected_signer=self.learner)  # whoever passed it on, the learner signed it
            snapshot.verify_manifest(msg.manifest, self.learner, self.run_id, self.incarnation)
            if msg.manifest.version != msg.version:
                raise ProtocolError(ErrorCode.BAD_MANIFEST, "announce and manifest differ in version")
            state = VersionState(msg, me, self.server.store)
            flagged = {m.peer_id for m in msg.members if m.forward}
            kids = [c for c in state.plan.children(me, 0) if c in flagged] if state.plan.stripes else []
            return state, kids, wire.encode(msg) if kids else b""

        state, kids, encoded = await trio.to_thread.run_sync(check)
        # also versions we already hold (e.g. caught up): our plan children still need the chunks
        if msg.version not in self.server.states:
            if self.host.peer_id not in state.plan.peers:
                raise ProtocolError(ErrorCode.NOT_FOUND, "not a member of this plan")
            self._note_members(msg.members)
            if msg.learner_addrs:
                self.host.add_peer_addrs(self.learner, list(msg.learner_addrs))
            self.server.add_state(state)
            try:
                self._jobs_send.send_nowait(msg)
            except trio.WouldBlock:
                raise ProtocolError(ErrorCode.UNAVAILABLE, "too many versions in flight") from None
            if self._push_nursery is not None:
                if kids:
                    self._push_nursery.start_soon(self._forward, msg.version, kids, encoded)
                if forwarded:
                    self._push_nursery.start_soon(self._say_heard, msg.version)
        return BroadcastAck(run_id=self.run_id, version=msg.version, have_version=self.version)

    async def _forward(self, version: int, children: list[str], encoded: bytes) -> None:
        """Pass the learner's signed announcement on to the stripe-0 children it flagged."""
        timeout = self.deadlines.for_bytes(len(encoded))

        async def one(child: str) -> None:
            try:
                await self.host.request(child, ANNOUNCE, encoded, expect=BroadcastAck, timeout=timeout)
            except (PeerUnavailable, ProtocolError) as exc:  # the learner sends it at its deadline
                log.info("forwarding the v%d announcement to %s failed: %s", version, short_id(child), exc)

        async with trio.open_nursery() as nursery:
            for child in children:
                nursery.start_soon(one, child)

    async def _say_heard(self, version: int) -> None:
        """Tell the learner a parent forwarded us ``version``'s announcement (else it sends one)."""
        heard = AnnounceHeard(run_id=self.run_id, version=version)
        try:
            await self.host.request(self.learner, HEARD, heard, expect=BroadcastAck, timeout=REPORT_TIMEOUT_S)
        except (PeerUnavailable, ProtocolError) as exc:
            log.info("telling the learner v%d was forwarded failed: %s", version, exc)

    def _note_members(self, members: list[PlanMember]) -> None:
        """Remember an announcement's members (catch-up sources, where to dial them), the newest
        last: a peer absent from the last ``MAX_NOTED_PEERS`` announced is forgotten."""
        for m in members:
            if m.peer_id == self.host.peer_id:
                continue
            self.known_peers.pop(m.peer_id, None)
            self.known_peers[m.peer_id] = tuple(m.addrs)
            if m.reachable:
                self._unreachable.discard(m.peer_id)
            else:
                self._unreachable.add(m.peer_id)
            self.host.note_peer_addrs(m.peer_id, m.addrs)
        while len(self.known_peers) > MAX_NOTED_PEERS:
            gone = next(iter(self.known_peers))
            del self.known_peers[gone]
            self._unreachable.discard(gone)

    # --- receiving one version -------------------------------------------------------------------
    async def _receive_guarded(self, ann: PlanAnnounce) -> None:
        try:
            await self._receive(ann)
        except Exception as exc:
            log.exception("version %d failed: %s", ann.version, exc)

    async def _receive(self, ann: PlanAnnounce) -> None:
        state = self.server.states.get(ann.version)
        if state is None:
            return
        t0 = time.perf_counter()
        self._start_pushes(state)
        suspects: set[str] = set()
        recovered = [0]
        ok, detail = False, ""
        with trio.move_on_after(self.version_deadline(state)):
            async with trio.open_nursery() as nursery:
                for s in range(state.n_stripes):
                    nursery.start_soon(self.feed.receive, state, s, suspects, recovered)
        new = False
        m = state.manifest
        # a delta whose base we lack (a newcomer, or one that fell behind): the chunks are relayed,
        # so report now and catch up afterwards; a catch-up before the report can outlast the
        # learner's wait, and a member that never reports is left out of many plans
        behind = state.complete and m.kind == "delta" and m.version > self.version and m.base_version != self.version
        if behind:
            detail = f"not at the delta's base v{m.base_version} (holding v{self.version}): catching up"
        elif state.complete:
            ok, detail, new = await self._apply(m, state.path)
        else:
            detail = f"{state.missing()} chunks missing at deadline"
        seconds = time.perf_counter() - t0
        if ok and not recovered[0]:
            self.deadlines.meter.add(state.manifest.payload_bytes, seconds)
        state.done.set()
        done = BroadcastDone(
            run_id=self.run_id,
            version=ann.version,
            ok=ok,
            seconds=seconds,
            recovered_chunks=recovered[0],
            suspects=sorted(suspects)[:64],
            detail=detail[:1000],
            streams=state.streams(),
        )
        for _ in range(3):
            try:
                await self.host.request(self.learner, DONE, done, expect=BroadcastAck, timeout=REPORT_TIMEOUT_S)
                break
            except (PeerUnavailable, RemoteError) as exc:
                log.info("done report for v%d failed: %s", ann.version, exc)
                await trio.sleep(0.5)
        if behind:
            await self.catch_up()  # delivers what it reached
            if m.base_version == self.version:  # a holder was one version behind: this delta applies
                _, _, new = await self._apply(m, state.path)
        if new:  # also when a catch-up moved us forward but short of this version
            await self._deliver()

    def _start_pushes(self, state: VersionState) -> None:
        """Our children that cannot dial us (we are behind NAT, they are reachable): dial them
        and push, each in the relay's nursery (it outlives this version's receiving)."""
        if self._push_nursery is None:
            return
        for s, children in state.children.items():
            for child in children:
                if state.plan.pushed(self.host.peer_id, child):
                    self._push_nursery.start_soon(self.pusher.push, state, s, child)

    def version_deadline(self, state: VersionState) -> float:
        """Seconds a version may take to arrive: ``version_timeout_s`` if set, else scaled with
        its payload bytes times the plan's busiest upload, and the plan depth (``Deadlines``)."""
        if self.version_timeout_s is not None:
            return self.version_timeout_s
        nbytes = int(state.manifest.payload_bytes * upload_copies(state.plan))
        return self.deadlines.for_bytes(nbytes, hops=state.plan.depth)

    # --- applying -------------------------------------------------------------------------------
    @property
    def result_digest(self) -> bytes:
        """SHA-256 of the newest verified version's file (what it was verified against)."""
        return self._result_digest or b""

    @property
    def result(self) -> bytes | None:
        """The newest verified version's bytes, read from its file (tests, small models; a
        large model is used through ``result_path``)."""
        return None if self.result_path is None else self.result_path.read_bytes()

    async def _apply(self, manifest: Manifest, payload: Path) -> tuple[bool, str, bool]:
        """Verify and apply a complete payload file: (ok = we hold ``manifest.version`` or
        newer, detail, new = ``self.version`` changed)."""
        async with self._apply_lock:
            if manifest.version <= self.version:
                return True, "already held", False
            before = self.version
            if manifest.kind == "delta" and manifest.base_version != self.version:
                # not at the base: relay the chunks (done) but catch up for ourselves; a holder
                # may be one version behind this one, so apply the delta if we reached its base
                await self._catch_up(None, None)
                if self.version >= manifest.version or manifest.base_version != self.version:
                    return self.version >= manifest.version, "caught up (not at delta base)", self.version != before
            try:
                await self._take(manifest, payload)
            except ProtocolError as exc:
                return False, f"verification failed: {exc}", self.version != before
            return True, "", True

    async def _take(self, manifest: Manifest, payload: Path) -> None:
        """Rebuild and verify ``manifest``'s version from its payload file, whose every chunk
        was verified before it was written (a delta: streaming over the files, in a worker
        thread) and make it ours. Raises ``ProtocolError``."""
        out = self.server.store.new_path(manifest.version, "safetensors")
        base, base_digest = self.result_path, self._result_digest
        result = await trio.to_thread.run_sync(
            lambda: rebuild_file(manifest, payload, base, out, base_digest=base_digest, chunks_verified=True)
        )
        self._set_result(manifest.version, result, manifest.result_digest)
        self.held_incarnation = manifest.incarnation
        self.server.chain.hold(manifest, payload)
        await self.server.collect()

    def _set_result(self, version: int, path: Path | None, digest: bytes | None) -> None:
        self.version, self.result_path, self._result_digest = version, path, digest
        self.server.pinned = set() if path is None else {path}

    async def _deliver(self) -> None:
        if self.on_version is None or self.result_path is None:
            return
        path = self.result_path
        with self.server.store.reading(path):  # newer versions may land meanwhile: not removed under the loader
            out = self.on_version(self.version, path)
            if inspect.isawaitable(out):
                await out

    async def adopt(self, version: int, result: bytes | Path, manifest: Manifest | None = None) -> bool:
        """Take a version obtained another way (the daemon's on-disk snapshot: a file, linked
        into the store, not copied; or bytes), already verified against its signed manifest, as
        the base for the next deltas; True if newer. With its *full* manifest the version is also
        served to peers catching up."""
        async with self._apply_lock:
            if version <= self.version:
                return False
            path = self.server.store.new_path(version, "safetensors")

            def place() -> tuple[bytes, bool]:
                if isinstance(result, Path):
                    link_or_copy(result, path)
                else:
                    write_at(path, 0, result)
                full = manifest is not None and manifest.kind == "full" and manifest.version == version
                digest = manifest.result_digest if manifest is not None else file_digest(path)
                return digest, full and chunks_match_file(manifest, path)

            digest, serve = await trio.to_thread.run_sync(place)
            self._set_result(version, path, digest)
            self.held_incarnation = None if manifest is None else manifest.incarnation
            if serve:
                self.server.chain.hold(manifest, path)  # type: ignore[arg-type]
            await self.server.collect()
            return True

    def reset(self, learner_peer_id: str) -> None:
        """Forget every version (the learner restarted from an older checkpoint, or changed)."""
        self.learner = learner_peer_id
        self._set_result(-1, None, None)
        self.held_incarnation = None
        self.server.chain.clear()
        self.server.clear_states()
        self.known_peers.clear()
        self._unreachable.clear()

    # --- catch-up -------------------------------------------------------------------------------
    async def catch_up(
        self, sources: list[str] | None = None, timeout: float | None = None, *, only: bool = False
    ) -> int:
        """Reach the newest version any holder has: its chain (newest full snapshot + deltas,
        or only the deltas after our version), page by page, chunks fetched from any holder,
        each version verified before use; ``on_version`` is called for the newest one reached.
        Returns the version held afterwards. ``sources`` are asked first, then known peers and
        the learner; with ``only``, nobody else (``[learner]``: the direct fetch from the
        learner's store). ``timeout`` caps the whole catch-up; None: every step has its own
        deadline, scaled with the bytes it moves (``Deadlines``)."""
        before = self.version
        async with self._apply_lock:
            await self._catch_up(sources, timeout, only)
        if self.version != before:
            await self._deliver()  # on_version for the newest version reached
        return self.version

    async def _catch_up(self, sources: list[str] | None, timeout: float | None, only: bool = False) -> int:
        candidates = list(sources or [])
        if not only:
            # a peer behind NAT cannot be dialled: asked only while a connection to it exists
            connected = set(self.host.connected_peers())
            candidates += [
                p for p in self.known_peers if p not in candidates and (p not in self._unreachable or p in connected)
            ] + [self.learner]
        candidates = list(dict.fromkeys(candidates))
        with trio.move_on_after(math.inf if timeout is None else timeout):
            for src in candidates:
                if await self._catch_up_from(src, [src] + [c for c in candidates if c != src]):
                    break
        return self.version

    async def _catch_up_from(self, src: str, holders: list[str]) -> bool:
        """Follow ``src``'s chain page by page to its newest version; True if reached."""
        progressed = False
        while True:
            try:
                reply = await self.host.request(
                    src,
                    CATCHUP,
                    CatchUpRequest(run_id=self.run_id, have_version=self.version),
                    expect=CatchUp,
                    timeout=self.deadlines.for_bytes(limits.MAX_FRAME_BYTES),
                )
            except (PeerUnavailable, RemoteError) as exc:
                log.info("catch-up from %s: %s", short_id(src), exc)
                return False
            assert isinstance(reply, CatchUp)
            if not reply.manifests or reply.manifests[-1].version <= self.version:
                return progressed and not reply.more
            if not await self._follow_chain(reply.manifests, holders):
                return False
            progressed = True
            if not reply.more:
                return True

    async def _follow_chain(self, manifests: list[Manifest], holders: list[str]) -> bool:
        for m in manifests:
            try:
                await trio.to_thread.run_sync(snapshot.verify_manifest, m, self.learner, self.run_id, self.incarnation)
            except ProtocolError as exc:
                log.warning("catch-up manifest v%d refused: %s", m.version, exc)
                return False
        start = self.version
        needed = sum(m.payload_bytes for m in manifests if m.version > start)
        with trio.move_on_after(self.deadlines.for_bytes(needed)):
            await self._apply_chain(manifests, holders)
        return self.version > start

    async def _apply_chain(self, manifests: list[Manifest], holders: list[str]) -> None:
        """Fetch, verify and apply each manifest newer than ours, in order; stop at a gap."""
        for m in manifests:
            if m.version <= self.version:
                continue
            if m.kind == "delta" and m.base_version != self.version:
                return
            path = self.server.store.new_path(m.version)
            self.server.pinned.add(path)  # not collected while it is being filled
            try:
                if not await fetch_payload(
                    self.host, self.server, m, path, holders, self.deadlines.for_bytes(m.chunk_bytes)
                ):
                    return
                await self._take(m, path)
            except ProtocolError as exc:
                log.warning("catch-up v%d failed verification: %s", m.version, exc)
                return
            finally:
                if path != self.result_path:
                    self.server.pinned.discard(path)
