"""How a node daemon gets its weights: the broadcast relay first (versions pushed by the
learner's plan, loaded into the backend in a worker thread as they arrive), pull catch-up from
peers when a version was missed, and the direct fetch (the same catch-up, from the learner's
store alone) only for a node with no version yet or one that could not catch up.

Generation and weight loading share one lock, so a rollout's behaviour version is exactly the
version its tokens were sampled with.

With a ``SnapshotKeeper`` (``node/state.py``) the newest loaded version is also kept on disk
with its signed manifest, and at start a verified on-disk snapshot becomes the node's version
(loaded into the backend and adopted by the relay as the base for deltas), so a restarted node
asks only for what is newer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from echorl.node.state import SnapshotKeeper
from echorl.protocol import snapshot
from echorl.protocol.messages import Manifest

log = logging.getLogger("echorl.node.daemon")

WAIT_FOR_BROADCAST_S = 3.0  # a refused node first waits this long for the broadcast in flight


@dataclass
class NodeWeights:
    """The node's weight state: backend, the relay that feeds it, the loaded version."""

    host: Any
    run_id: str
    backend: Any
    upload_limit: Any = None
    version: int = -1  # loaded into the backend (the behaviour version of new rollouts)
    incarnation: bytes | None = None  # the learner incarnation that signed ``version``
    relay: Any = None
    lock: trio.Lock = field(default_factory=trio.Lock)  # held while generating or loading
    changed: trio.Event = field(default_factory=trio.Event)
    loads: dict[str, int] = field(default_factory=lambda: {"relay": 0, "fetch": 0})
    keeper: SnapshotKeeper | None = None  # the newest verified version on disk
    cache_bytes: int = 64 * 1024 * 1024  # the relay's chunk cache (its weights live on disk)
    started_from: int = -1  # the on-disk version this process started from (-1: none)
    adapters: Any = None  # NodeAdapters: LoRA versions applied over this node's own base model
    _via: str = "relay"  # what ``_on_version`` counts a load as ("fetch" during a direct fetch)

    async def attach(self, learner: str, nursery: trio.Nursery) -> None:
        """The relay for ``learner`` (created and started once; reset if the learner changed)."""
        from echorl.broadcast.relay import Relay

        if self.relay is None:
            # with a keeper, the relay's files live beside the snapshot (one file system: the
            # snapshot on disk is a hard link to the store's file, not a copy)
            store_dir = None if self.keeper is None else self.keeper.state_dir / "store"
            self.relay = Relay(
                self.host,
                learner,
                self.run_id,
                on_version=self._on_version,
                upload_limit=self.upload_limit,
                store_dir=store_dir,
                cache_bytes=self.cache_bytes,
            )
            await self._resume(learner)
            self.relay.install()
            nursery.start_soon(self.relay.run)
            if self.keeper is not None:
                nursery.start_soon(self.keeper.run)
        elif self.relay.learner != learner:
            self.forget(learner)

    async def _resume(self, learner: str) -> None:
        """Start from the verified on-disk snapshot, if there is one for this learner and run."""
        if self.keeper is None:
            return
        snap = await self.keeper.load(learner)
        if snap is None:
            log.info("no usable on-disk snapshot in %s: weights come from the network", self.keeper.state_dir)
            return
        try:
            loaded = await self._load(snap.version, snap.path, "disk", snap.manifest.incarnation, snap.manifest)
        except Exception as exc:
            log.warning("on-disk snapshot v%d does not load (%s): discarding it", snap.version, exc)
            self.keeper.discard()
            return
        if loaded:
            # the base of the next broadcast delta, and (a full snapshot) served to peers catching up
            await self.relay.adopt(snap.version, snap.path, snap.manifest)
            self.started_from = snap.version
            log.info(
                "resumed from on-disk snapshot v%d (%s, %d bytes)",
                snap.version,
                snap.manifest.kind,
                snap.manifest.result_bytes,
            )

    def joined(self, learner: str, incarnation: bytes) -> None:
        """The learner accepted our join under ``incarnation``: from now on only its manifests
        are taken; a version we hold from another (the branch a learner resumed from an older
        checkpoint abandoned, or a snapshot that predates incarnations) is dropped, never
        served or leased against, and the node catches up to the new branch."""
        relay = self.relay
        stale = (relay.version >= 0 and relay.held_incarnation != incarnation) or (
            self.version >= 0 and self.incarnation != incarnation
        )
        if stale:
            log.warning("the learner restarted (new incarnation): v%d is of the branch it left", self.version)
            self.forget(learner)
        relay.incarnation = incarnation

    def forget(self, learner: str) -> None:
        """Drop every version (the learner changed or went back to an older checkpoint), on disk
        too: a learner that went back signs new weights under the same version numbers."""
        log.warning("forgetting weights v%d (learner restarted or changed)", self.version)
        self.relay.reset(learner)
        self.version = -1
        self.incarnation = None
        if self.keeper is not None:
            self.keeper.discard()

    async def flush(self) -> None:
        """Write the newest version to disk now (at shutdown)."""
        if self.keeper is not None:
            await self.keeper.flush()

    async def _on_version(self, version: int, path: Path) -> None:
        """Relay callback: a verified version (broadcast or catch-up) → the backend (and disk)."""
        manifest = self._relay_manifest(version)
        if await self._load(version, path, self._via, self.relay.held_incarnation, manifest):
            await self._keep(manifest, path)

    async def _load(
        self, version: int, path: Path, how: str, incarnation: bytes | None, manifest: Manifest | None = None
    ) -> bool:
        """Load ``version`` (its verified safetensors file, opened lazily per tensor) into the
        backend unless we hold it or newer; True if loaded. A LoRA adapter version (its manifest
        says so) is applied over this node's base, which must be the one it names."""
        if version <= self.version:
            return False
        if self.adapters is not None and not await self.adapters.fits(manifest):
            return False  # another base: never loaded (``ensure`` and ``run`` say so and end the node)
        sd = await trio.to_thread.run_sync(snapshot.safetensors_file_to_state_dict, path)
        async with self.lock:
            if version <= self.version:
                return False
            if self.adapters is not None:
                self.backend = await trio.to_thread.run_sync(self.adapters.engine, self.backend, manifest)
            await trio.to_thread.run_sync(self.backend.load_state_dict, sd, version)
            self.version, self.incarnation = version, incarnation
        self.loads[how] = self.loads.get(how, 0) + 1
        self.changed.set()
        self.changed = trio.Event()
        log.debug("weights v%d via %s", version, how)
        return True

    async def _keep(self, manifest: Manifest | None, path: Path) -> None:
        """Hand a loaded version to the keeper (which verifies the pair again before writing)."""
        if self.keeper is None or manifest is None or manifest.version != self.version:
            return
        await self.keeper.offer(manifest, path, self.relay.learner)

    def _relay_manifest(self, version: int) -> Manifest | None:
        """The manifest the relay verified ``version`` against (its held chain or the version's
        broadcast state)."""
        manifest = self.relay.server.chain.manifest(version)
        state = self.relay.server.states.get(version)
        return manifest or (None if state is None else state.manifest)

    async def generate(self, *args: Any) -> tuple[int, bytes | None, Any]:
        """``backend.generate(*args)`` in a worker thread with no version change meanwhile;
        returns (behaviour version, its incarnation, groups)."""
        return await self.run(self.backend.generate, *args)

    async def run(self, fn: Any, *args: Any) -> tuple[int, bytes | None, Any]:
        """``fn(*args)`` (sampling with ``self.backend``: completions or episodes) in a worker
        thread with no version change meanwhile; returns (behaviour version, the incarnation
        that signed it, its result)."""
        self.check_base()
        async with self.lock:
            version, incarnation = self.version, self.incarnation
            result = await trio.to_thread.run_sync(fn, *args)
        return version, incarnation, result

    async def ensure(self, target: int = 0) -> None:
        """Reach version ≥ ``target``: wait briefly for the broadcast in flight, then catch up
        from peers (the learner last), then fetch directly from the learner."""
        if self.version >= target:
            return
        if self.version >= 0:
            with trio.move_on_after(WAIT_FOR_BROADCAST_S):
                while self.version < target:
                    await self.changed.wait()
            if self.version >= target:
                return
        await self.relay.catch_up()  # deadlines scale with the bytes moved
        self.check_base()
        if self.version < target:
            await self._fetch()
            self.check_base()

    def check_base(self) -> None:
        """Raise ``BaseMismatch`` (one line) once a version for another base model was refused."""
        if self.adapters is not None:
            self.adapters.check()

    async def _fetch(self) -> None:
        """The direct fetch: a catch-up from the learner alone (its one chunk store serves the
        newest full snapshot and the deltas after it)."""
        t0, before = time.perf_counter(), self.version
        self._via = "fetch"
        try:
            await self.relay.catch_up([self.relay.learner], only=True)
        finally:
            self._via = "relay"
        if self.version > before:
            log.info("weights v%d fetched directly in %.3f s (fallback)", self.version, time.perf_counter() - t0)
