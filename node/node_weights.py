"""How a node daemon gets its weights: the broadcast relay first (versions pushed by the
learner's plan, loaded into the backend in a worker thread as they arrive), pull catch-up from
peers when a version was missed, and the direct fetch from the learner (``fetch_weights``) only
for a node with no version yet or one that could not catch up.

Generation and weight loading share one lock, so a rollout's behaviour version is exactly the
version its tokens were sampled with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from echorl.protocol import snapshot

log = logging.getLogger("echorl.node.daemon")

WAIT_FOR_BROADCAST_S = 3.0  # a refused node first waits this long for the broadcast in flight
CATCH_UP_TIMEOUT_S = 30.0
FETCH_TIMEOUT_S = 60.0


@dataclass
class NodeWeights:
    """The node's weight state: backend, the relay that feeds it, the loaded version."""

    host: Any
    run_id: str
    backend: Any
    upload_limit: Any = None
    version: int = -1  # loaded into the backend (the behaviour version of new rollouts)
    relay: Any = None
    lock: trio.Lock = field(default_factory=trio.Lock)  # held while generating or loading
    changed: trio.Event = field(default_factory=trio.Event)
    loads: dict[str, int] = field(default_factory=lambda: {"relay": 0, "fetch": 0})

    async def attach(self, learner: str, nursery: trio.Nursery) -> None:
        """The relay for ``learner`` (created and started once; reset if the learner changed)."""
        from .relay import Relay

        if self.relay is None:
            self.relay = Relay(self.host, learner, self.run_id, on_version=self._on_version,
                               upload_limit=self.upload_limit)
            self.relay.install()
            nursery.start_soon(self.relay.run)
        elif self.relay.learner != learner:
            self.forget(learner)

    def forget(self, learner: str) -> None:
        """Drop every version (the learner changed or went back to an older checkpoint)."""
        log.warning("forgetting weights v%d (learner restarted or changed)", self.version)
        self.relay.reset(learner)
        self.version = -1

    async def _on_version(self, version: int, data: bytes) -> None:
        """Relay callback: a verified version (broadcast or catch-up) → the backend."""
        await self._load(version, data, "relay")

    async def _load(self, version: int, data: bytes, how: str) -> None:
        if version <= self.version:
            return
        sd = await trio.to_thread.run_sync(snapshot.safetensors_to_state_dict, data)
        async with self.lock:
            if version <= self.version:
                return
            await trio.to_thread.run_sync(self.backend.load_state_dict, sd, version)
            self.version = version
        self.loads[how] += 1
        self.changed.set()
        self.changed = trio.Event()
        log.debug("weights v%d via %s", version, how)

    async def generate(self, *args: Any) -> tuple[int, Any]:
        """``backend.generate(*args)`` in a worker thread with no version change meanwhile;
        returns (behaviour version, groups)."""
        async with self.lock:
            version = self.version
            groups = await trio.to_thread.run_sync(self.backend.generate, *args)
        return version, groups

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
        await self.relay.catch_up(timeout=CATCH_UP_TIMEOUT_S)
        if self.version < target:
            await self._fetch()

    async def _fetch(self) -> None:
        from .weights import fetch_weights_bytes

        got = await fetch_weights_bytes(self.host, self.relay.learner, self.run_id, self.version,
                                        timeout=FETCH_TIMEOUT_S)
        if got is None:
            return
        version, data, seconds = got
        await self.relay.adopt(version, data)  # the base of the next broadcast delta
        await self._load(version, data, "fetch")
        log.info("weights v%d fetched directly in %.3f s (fallback)", version, seconds)
