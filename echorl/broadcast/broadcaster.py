"""Log-depth pipelined weight broadcast (architecture §5, §6): the learner side and the shared core.

Integration contract
--------------------
Learner (one per run)::

    bc = Broadcaster(host, identity, run_id, fanout=4, chunk_bytes=None,  # None: auto_chunk_bytes
                     full_every=10, upload_limit=UploadLimiter.from_mbps(mbps),  # or bytes/s, or None
                     shape="striped", direct=True, retain=S)  # keep versions ≥ newest − S rebuildable
    bc.install()                                   # routes on the learner's Host
    await nursery.start(bc.run)                    # the direct TCP chunk port (optional)
    report = await bc.publish(version, safetensors_bytes,
                              nodes=[NodeInfo(peer_id, reachable, addrs), ...],  # or (id, reachable, addrs) tuples
                              timeout=None)        # floor of the scaled wait (done_deadline)
    # -> BroadcastReport(version, seconds, bytes, kind, ...): seconds = announce → last node
    #    verified; bytes = payload bytes (delta or full); kind = "full" | "delta"
    bc.version_bytes(version)                      # a held version's safetensors file (spot checks;
                                                   # pure computation: call it in a worker thread)

``publish`` builds the payload (a delta against the previous published version, a full snapshot
every ``full_every`` versions or when the tensor layout changes), signs a manifest and a plan
announcement, announces it to every node (requests, not gossip: gossipsub drops silently,
architecture §9; the learner's to some, their stripe-0 parents' to the rest, ``announcing.py``),
serves its stripe roots, and returns when every node reported the version
verified or ``timeout`` passed. Nodes that did not answer the announce or never reported done
are in ``report.missing``; parents that nodes reported (bad chunk, stall) are in
``report.suspects`` and become leaves (if they completed) or are dropped (if they did not) in
the next plan. A node reported while alive is only demoted, for ``demote_for`` publications: a
lying child cannot evict a peer. ``BroadcastDone`` is accepted only from a member of that
version's plan, and only its own plan parents count as its suspects. Training never waits on one
member: once half of the announced nodes completed, the rest get ``straggler_factor`` × the time
that took (at least ``straggler_floor_s``, a few seconds: the next version is not published
before this wait ends, so it is what one silent member costs, also one that takes the announce
and never answers it: announces run beside this wait); a member that did not answer the
announce or has not reported is left out of the next 2^k plans (k: its misses in a row) and
fetches versions by catch-up meanwhile. A member that has never reported any version is left out
of the next 2^6 plans at its first miss: a silent newcomer has no record that would earn it the doubling.
While waiting, the learner pings pending nodes every ``liveness_every_s``; a dead one is not
waited for (and is left out of the next plan). The plan seed is fixed per Broadcaster (``seed``)
so consecutive versions use the same edges and reuse connections. Each member that may relay
carries a weight, its upload as its plan children timed it in earlier versions
(``broadcast/uplinks.py``, never its own claim): the planner gives it child slots in proportion.

Node: see ``broadcast/relay.py`` (``Relay(host, learner_peer_id, run_id, on_version=...)``,
``install()``, ``await run()`` in a nursery, ``await catch_up()``).

The learner holds each published version once, on disk, in the store both ends use
(``broadcast/store.py``: one payload file per version, ``store_dir``, a temporary directory by
default, and a chunk cache of ``cache_bytes``): the versions in flight and the held chain (newest
full snapshot + deltas, and older runs while a version within ``retain`` of the newest needs them).
The same chunks serve the plan streams, recovery, catch-up and a node's direct fetch (a catch-up
from the learner alone); ``version_bytes`` rebuilds any held version for the spot checker.

Protocols: the ``/echorl/bcast/…`` rows of ``protocol/routes.py`` (all libp2p; chunk streams
are raw framed streams, the rest request/response).

Direct path (``direct=True``, the default): chunks over a ticketed plain TCP port, verified as on
libp2p (``chunk_server.py``, ``net/transport/direct_tcp.py``); it listens while ``run()`` runs.

Serialisation, hashing, delta encoding/application run in worker threads.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from echorl.broadcast.announcing import AnnounceRound, Forwarders
from echorl.broadcast.chunk_server import ChunkServer, _as_limiter
from echorl.broadcast.deadlines import Deadlines, upload_copies
from echorl.broadcast.files import mapped, write_at
from echorl.broadcast.members import NodeInfo, announce_room, fit_addrs
from echorl.broadcast.silence import SilentMembers
from echorl.broadcast.store import DEFAULT_CACHE_BYTES, VersionState, WeightStore, plan_for
from echorl.broadcast.uplinks import UplinkMeter
from echorl.net.host import Host, PeerUnavailable, RequestContext
from echorl.net.ratelimit import RateLimit
from echorl.net.transport import UploadLimiter, listen_ip
from echorl.protocol import delta as delta_mod
from echorl.protocol import snapshot, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import (
    AdapterSpec,
    AnnounceHeard,
    BroadcastAck,
    BroadcastDone,
    Manifest,
    Message,
    PlanAnnounce,
    PlanMember,
)
from echorl.protocol.plan import BroadcastPlan, auto_chunk_bytes
from echorl.protocol.routes import DONE, HEARD

log = logging.getLogger("echorl.broadcast.broadcaster")


@dataclass
class BroadcastReport:
    version: int
    seconds: float  # announce sent → last node reported the version verified
    bytes: int  # payload bytes (the delta's, or the full snapshot's)
    kind: str  # "full" | "delta"
    result_bytes: int = 0  # size of the version's safetensors file
    build_seconds: float = 0.0  # delta encoding + hashing + signing, before the announce
    depth: int = 0
    nodes: int = 0
    completed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)
    recovered_chunks: int = 0
    node_seconds: dict[str, float] = field(default_factory=dict)
    announce_sends: int = 0  # the learner's own announce requests (the rest were forwarded)
    announce_heard: int = 0  # members that took the announcement from a plan parent
    announce_late: int = 0  # members left to a parent that got the learner's copy at their deadline


class Broadcaster:
    """The learner's publisher. ``upload_limit``: an ``UploadLimiter`` or bytes/s (None = no cap)."""

    def __init__(
        self,
        host: Host,
        identity: Identity,
        run_id: str,
        *,
        fanout: int = 4,
        chunk_bytes: int | None = None,
        full_every: int = 10,
        upload_limit: UploadLimiter | float | None = None,
        shape: str = "striped",
        announce_timeout_s: float = 10.0,
        done_timeout_s: float = 0.0,
        keep: int = 3,
        direct: bool = True,
        seed: int = 0,
        liveness_every_s: float = 2.0,
        liveness_misses: int = 2,
        retain: int = 0,
        straggler_factor: float = 3.0,
        straggler_floor_s: float = 3.0,
        demote_for: int = 8,
        deadlines: Deadlines | None = None,
        store_dir: Path | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        fetch_limit: RateLimit | None = None,
        nat_push: bool = True,
        weigh: bool = False,
        incarnation: bytes | None = None,
        admit: Callable[[str], bool] | None = None,
        adapter: AdapterSpec | None = None,
    ) -> None:
        if identity.peer_id != host.peer_id:
            raise ValueError("the broadcaster signs with the host's identity")
        self.host = host
        self.identity = identity
        # signed into every manifest: new per learner process, so a resumed learner's versions
        # are never mistaken for an abandoned branch's under the same numbers
        self.incarnation = incarnation if incarnation is not None else secrets.token_bytes(16)
        self.run_id = run_id
        self.adapter = adapter  # set: every version is a LoRA adapter over the base it names
        self.fanout = fanout
        self.chunk_bytes = chunk_bytes  # None: per version, from its size and the members (auto_chunk_bytes)
        self.full_every = max(1, full_every)
        self.shape = shape
        self.nat_push = nat_push  # NAT'd nodes relay by pushing to reachable children (broadcast/push.py)
        self.liveness_every_s = liveness_every_s
        self.liveness_misses = liveness_misses
        self.seed = seed  # fixed: the same members give the same plan, so connections are reused
        self.announce_timeout_s = announce_timeout_s  # floors: the deadlines scale up from them
        self.done_timeout_s = done_timeout_s
        self.deadlines = deadlines or Deadlines()
        self.limiter = _as_limiter(upload_limit)
        self.server = ChunkServer(
            host,
            run_id,
            self.limiter,
            keep=keep,
            retain=retain,
            direct=direct,
            deadlines=self.deadlines,
            store=WeightStore(store_dir, cache_bytes),
            fetch_limit=fetch_limit,
            admit=admit,  # the learner: catch-up and chunk requests from joined peers only
        )
        # (version, its safetensors file) last published; the file only for a delta (a full
        # snapshot's file is its payload in the chain): the next delta's base, read through
        # mmap, so no version's bytes stay in the learner's memory between publications
        self._prev: tuple[int, Path | None] | None = None
        self._since_full = 0
        self._done: dict[int, dict[str, BroadcastDone]] = {}
        self._done_changed = trio.Event()
        self.straggler_factor = straggler_factor
        self.straggler_floor_s = straggler_floor_s
        self.demote_for = demote_for
        self._plans: dict[int, Any] = {}  # version -> its BroadcastPlan (who may report, and about whom)
        self._n_pub = 0  # publications so far: demotions and exclusions count in publications
        self._demote: dict[str, int] = {}  # reported but completed: a leaf until this publication
        self.silence = SilentMembers()  # members left out of the next plans for not reporting
        self._drop: set[str] = set()  # reported and did not complete: left out next time
        self.uplinks = UplinkMeter()  # relays' uploads, timed by their children: the plan's weights
        self.weigh = weigh  # plan with them (else only measured): `echorl learner --plan-weights`
        self._rounds: dict[int, AnnounceRound] = {}  # announcements in flight (AnnounceHeard lands here)
        self.forwarders = Forwarders()  # who may pass the next announcement on (``announcing.py``)

    def install(self) -> None:
        self.server.install_serving()
        # reports are read only from members of a plan in flight (checked before the body is read)
        in_plan = self.server.in_a_plan
        self.host.serve({DONE: self._on_done, HEARD: self._on_heard}, admit={DONE: in_plan, HEARD: in_plan})

    def metrics(self) -> dict[str, int]:
        """The learner's serving refusals: chunk and catch-up requests (``ChunkServer.counters``)
        and inbound connections (libp2p's and the direct port's guards); its announce copies."""
        refused = self.host.guard.refused + self.server.direct_guard.refused
        return {**self.server.counters, **self.forwarders.counters, "connections_refused": refused}

    def version_bytes(self, version: int) -> bytes | None:
        """A held version's safetensors file (None if no longer held). Thread-safe; may apply
        deltas: call it in a worker thread."""
        prev = self._prev
        if prev is not None and prev[0] == version and prev[1] is not None:
            with self.server.store.reading(prev[1]):
                try:
                    return prev[1].read_bytes()
                except OSError:
                    return None
        return self.server.chain.version_bytes(version)

    @contextmanager
    def _base_of_next_delta(self) -> Iterator[Any]:
        """The last published version's safetensors file, memory-mapped (read by the page cache,
        not copied into this process), or None when it is not held as one file."""
        prev = self._prev
        path = None if prev is None else prev[1] or self._full_payload(prev[0])
        if path is None:
            yield None
            return
        with self.server.store.reading(path), ExitStack() as stack:
            try:
                view = stack.enter_context(mapped(path))
            except (OSError, ValueError):
                view = None
            yield view

    def _full_payload(self, version: int) -> Path | None:
        for m, path, _ in self.server.chain.entries:
            if m.version == version and m.kind == "full":
                return path
        return None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Background service (the direct TCP chunk port); ``await nursery.start(bc.run)``."""
        if not self.server.direct:
            task_status.started()
            await trio.sleep_forever()
        await self.server.serve_direct(listen_ip(self.host), task_status=task_status)

    def announce_deadline(self, manifest: Manifest, members: int) -> float:
        """Seconds one announce may take: it carries the manifest and the member list."""
        nbytes = snapshot.manifest_wire_bytes(manifest) + 1100 * members
        return max(self.announce_timeout_s, self.deadlines.for_bytes(nbytes))

    def done_deadline(self, manifest: Manifest, plan: BroadcastPlan, timeout: float | None = None) -> float:
        """Seconds to wait for every node's ``BroadcastDone``: the version's payload through the
        plan's busiest upload and depth (``Deadlines``), or longer if ``timeout`` (else
        ``done_timeout_s``) says so."""
        floor = self.done_timeout_s if timeout is None else timeout
        nbytes = int(manifest.payload_bytes * upload_copies(plan))
        return max(floor, self.deadlines.for_bytes(nbytes, hops=max(1, plan.depth)))

    async def _probe(self, pending: set[str], gone: set[str], failures: dict[str, int]) -> None:
        """Ping the nodes still pending; one that misses ``liveness_misses`` pings in a row is
        dead and not waited for (a loaded but live node answers a ping within seconds)."""

        async def one(peer: str) -> None:
            try:
                await self.host.ping(peer, timeout=max(5.0, self.liveness_every_s))
                failures.pop(peer, None)
            except PeerUnavailable:
                failures[peer] = failures.get(peer, 0) + 1
                if failures[peer] >= self.liveness_misses:
                    gone.add(peer)

        async with trio.open_nursery() as nursery:
            for peer in pending:
                nursery.start_soon(one, peer)

    async def _on_done(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, BroadcastDone)
        if msg.run_id != self.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "other run")
        per, plan = self._done.get(msg.version), self._plans.get(msg.version)
        if per is not None and plan is not None and ctx.peer_id not in plan.peers:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"not a member of the v{msg.version} plan")
        if per is not None and ctx.peer_id not in per:
            parents = {st.parent_of().get(ctx.peer_id) for st in plan.stripes} if plan is not None else set()
            per[ctx.peer_id] = msg.model_copy(update={"suspects": [p for p in msg.suspects if p in parents]})
            self._note_done_changed()
        return BroadcastAck(run_id=self.run_id, version=msg.version, have_version=self.server.chain.version)

    async def _on_heard(self, msg: Message, ctx: RequestContext) -> Message:
        assert isinstance(msg, AnnounceHeard)
        if msg.run_id != self.run_id:
            raise ProtocolError(ErrorCode.NOT_FOUND, "other run")
        round_ = self._rounds.get(msg.version)
        if round_ is not None:
            round_.heard(ctx.peer_id)
        return BroadcastAck(run_id=self.run_id, version=msg.version, have_version=self.server.chain.version)

    def _note_done_changed(self) -> None:
        """Wake the publication waiting for reports (a report came, or an announce ended)."""
        self._done_changed.set()
        self._done_changed = trio.Event()

    async def _build(self, version: int, data: bytes, n_members: int) -> tuple[Manifest, bytes]:
        prev = self._prev

        def build() -> tuple[Manifest, bytes]:
            payload, kind, base = data, "full", -1
            if prev is not None and self._since_full + 1 < self.full_every:
                with self._base_of_next_delta() as base_file:
                    try:
                        d = None if base_file is None else delta_mod.encode_delta(base_file, data)
                    except ValueError:  # layout changed: full snapshot
                        d = None
                if d is not None and len(d) < len(data):
                    payload, kind, base = d, "delta", prev[0]
            chunk_bytes = self.chunk_bytes or auto_chunk_bytes(len(payload), n_members, self.fanout)
            manifest, _ = snapshot.build_manifest(
                self.identity,
                self.run_id,
                version,
                prev[0] if prev else -1,
                payload,
                data,
                kind=kind,
                base_version=base,
                chunk_bytes=chunk_bytes,
                incarnation=self.incarnation,
                adapter=self.adapter,
            )
            return manifest, payload

        return await trio.to_thread.run_sync(build)

    async def _signed_announce(
        self, version: int, manifest: Manifest, members: list[PlanMember], shape: str | None, seed: int | None
    ) -> tuple[PlanAnnounce, bytes, BroadcastPlan, set[str]]:
        """The plan, the members left to their stripe-0 parent (``forward_flags``) and the
        announcement carrying those flags, signed and encoded once for every member, in a worker
        thread (planning, validating, signing and encoding 10,000 members is not event-loop work)."""
        learner_addrs = self.host.addrs[:16]
        shape, seed = shape or self.shape, self.seed if seed is None else seed

        def build() -> tuple[PlanAnnounce, bytes, BroadcastPlan, set[str]]:
            plan = plan_for(self.identity.peer_id, members, shape, self.fanout, seed)
            forwarded = self.forwarders.flags(plan, members, self._n_pub)
            flagged = [m.model_copy(update={"forward": True}) if m.peer_id in forwarded else m for m in members]
            ann = wire.sign(
                PlanAnnounce(
                    run_id=self.run_id,
                    learner_peer_id=self.identity.peer_id,
                    version=version,
                    manifest=manifest,
                    shape=shape,
                    fanout=self.fanout,
                    seed=seed,
                    learner_addrs=learner_addrs,
                    members=flagged,
                    created_at=time.time(),
                ),
                self.identity,
            )
            return ann, wire.encode(ann), plan, forwarded

        return await trio.to_thread.run_sync(build)

    async def publish(
        self,
        version: int,
        safetensors_bytes: bytes,
        nodes: Iterable[NodeInfo | tuple],
        *,
        timeout: float | None = None,
        shape: str | None = None,
        seed: int | None = None,
    ) -> BroadcastReport:
        """Publish ``version`` to ``nodes`` and wait until each verified it (or ``timeout``)."""
        if self._prev is not None and version <= self._prev[0]:
            raise ValueError(f"version {version} is not newer than {self._prev[0]}")
        nodes = [n if isinstance(n, NodeInfo) else NodeInfo(n[0], bool(n[1]), tuple(n[2])) for n in nodes]
        t_build = time.perf_counter()
        manifest, payload = await self._build(version, safetensors_bytes, len(nodes))
        build_seconds = time.perf_counter() - t_build
        self._since_full = 0 if manifest.kind == "full" else self._since_full + 1
        result = None
        if manifest.kind == "delta":  # its result is no payload: kept as a file, the next base
            result = self.server.store.new_path(version, "safetensors")
            await trio.to_thread.run_sync(write_at, result, 0, safetensors_bytes)
        self._prev = (version, result)
        self.server.pinned = set() if result is None else {result}

        members = []
        for n in nodes:
            if (
                n.peer_id in self._drop
                or n.peer_id == self.host.peer_id
                or self.silence.benched(n.peer_id, self._n_pub)
            ):
                continue
            demoted = n.leaf or self._demote.get(n.peer_id, -1) >= self._n_pub
            pushes = True if self.nat_push and not n.reachable and not demoted else None
            weight = self.uplinks.weight(n.peer_id) if self.weigh and (n.reachable or pushes) else None
            members.append(
                PlanMember(
                    peer_id=n.peer_id,
                    reachable=n.reachable and not demoted,
                    addrs=list(n.addrs)[:16],
                    pushes=pushes,
                    weight=None if demoted else weight,
                )
            )
            self.host.note_peer_addrs(n.peer_id, n.addrs)
        self._drop.clear()
        members = fit_addrs(members, announce_room(manifest))
        ann, encoded, plan, forwarded = await self._signed_announce(version, manifest, members, shape, seed)
        state = await trio.to_thread.run_sync(VersionState, ann, self.host.peer_id, self.server.store, plan)
        await state.fill(payload)  # the store's file: served from disk through the chunk cache
        del payload
        self.server.add_state(state)
        self.server.chain.hold(manifest, state.path)
        await self.server.collect()
        self._done[version] = {}
        self._plans[version] = state.plan
        while len(self._done) > 8:
            self._plans.pop(next(iter(self._done)), None)
            self._done.pop(next(iter(self._done)))

        t0 = time.perf_counter()
        stripe0 = plan.stripes[0]
        copies = max((len(c) for p, c in stripe0.children.items() if p != plan.learner), default=1)
        round_ = AnnounceRound(
            self.host,
            encoded,
            members,
            forwarded,
            stripe0.depth_of(plan.learner),
            timeout_s=self.announce_deadline(manifest, len(members)),
            hop_s=self.deadlines.for_forward(len(encoded), copies),
            on_change=self._note_done_changed,
        )
        self._rounds = {version: round_}  # one publication at a time: a cancelled one's round goes here
        announced, asked = round_.took, round_.asked  # settled by the round (and AnnounceHeard)
        done = self._done[version]
        gone: set[str] = set()  # announced, then found dead (no ping answer): not waited for
        failures: dict[str, int] = {}
        # the announces run beside the wait for reports, and half of those that answered count:
        # members that take the announce and never answer it (13 slow-walkers whose hosts were
        # closing) cost the straggler wait, not the announce deadline (issue 24)
        async with trio.open_nursery() as announcing:
            announcing.start_soon(round_.run)
            with trio.move_on_after(self.done_deadline(manifest, state.plan, timeout)) as whole:
                while not ((announced | asked) - gone).issubset(done):
                    wait = max(self.straggler_floor_s, self.straggler_factor * (time.perf_counter() - t0))
                    if done and 2 * len(done) >= len(announced - gone) and whole.deadline > trio.current_time() + wait:
                        whole.deadline = trio.current_time() + wait  # half are done: the rest get a bounded wait
                    with trio.move_on_after(self.liveness_every_s):
                        await self._done_changed.wait()
                        continue
                    await self._probe(announced - gone - set(done), gone, failures)
            announcing.cancel_scope.cancel()  # an announce still unanswered is a miss
        seconds = time.perf_counter() - t0
        self._rounds = {}
        self.forwarders.note(plan, announced, round_, self._n_pub)
        self._n_pub += 1
        # one that never answers the announce costs each publication its announce deadline (issue 24)
        self.silence.note(version, {m.peer_id for m in members} - gone - set(done), set(done), self._n_pub)

        completed = sorted(p for p, d in done.items() if d.ok)
        self.uplinks.note(state.plan, manifest, done, self._n_pub)
        if completed and len(completed) == len(members):
            self.deadlines.meter.add(manifest.payload_bytes, seconds)
        suspects = sorted({s for d in done.values() for s in d.suspects})
        missing = sorted(m.peer_id for m in members if m.peer_id not in completed)
        for s in suspects:
            if s in completed:
                self._demote[s] = self._n_pub + self.demote_for - 1
            else:
                self._drop.add(s)
        self._drop |= gone - set(
            completed
        )  # dead: left out of the next plan (the caller's node set may re-add them later)
        return BroadcastReport(
            version=version,
            seconds=seconds,
            bytes=manifest.payload_bytes,
            kind=manifest.kind,
            result_bytes=manifest.result_bytes,
            build_seconds=build_seconds,
            depth=state.plan.depth,
            nodes=len(members),
            completed=completed,
            missing=missing,
            suspects=suspects,
            recovered_chunks=sum(d.recovered_chunks for d in done.values()),
            node_seconds={p: d.seconds for p, d in done.items()},
            announce_sends=round_.sent,
            announce_heard=round_.heard_count,
            announce_late=len(round_.fell_back),
        )
