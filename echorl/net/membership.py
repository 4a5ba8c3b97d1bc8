"""DHT membership: Kademlia (py-libp2p KadDHT) holding the run's signed learner record and the
provider records of its nodes, so any peer that can reach one bootstrap peer finds the learner
and lists the nodes.

Keys: ``/echorl/learner/<run_id>`` → signed ``LearnerRecord`` (validated on every store and
read); provider key ``echorl-run/<run_id>`` → nodes serving the run. py-libp2p's DHT does not
add connected peers to its table by itself, so bootstrap peers are added explicitly, and
``find_providers`` can return duplicates, so results are de-duplicated.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import trio
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.records.validator import NamespacedValidator, Validator
from libp2p.tools.anyio_service import background_trio_service

from echorl.net.host import Host, PeerUnavailable
from echorl.protocol import limits, wire
from echorl.protocol.errors import ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import JoinAccepted, LearnerRecord

log = logging.getLogger("echorl.net.membership")


def learner_key(run_id: str) -> str:
    return f"/echorl/learner/{run_id}"


def provider_key(run_id: str) -> str:
    return f"echorl-run/{run_id}"


class _RecordValidator(Validator):
    """Which learner records a peer stores, passes on and takes. Anyone can sign a record naming
    itself, and the newest wins a DHT lookup: so a record dated beyond the clock-skew window is
    invalid (a far-future one would hide every later one for good), and once this peer knows the
    learner it pinned (``pinned``), a record signed by anyone else is invalid too: never stored
    here, never selected over the pinned learner's."""

    def __init__(self) -> None:
        self.pinned: str | None = None

    def validate(self, key: str, value: bytes) -> None:
        rec = _decode_record(value)
        if key != learner_key(rec.run_id):
            raise ValueError("learner record stored under another run's key")
        if rec.created_at > time.time() + limits.MAX_CLOCK_SKEW_S:
            raise ValueError("learner record dated in the future")
        if self.pinned is not None and rec.learner_peer_id != self.pinned:
            raise ValueError(f"learner record of {short_id(rec.learner_peer_id)}, not the pinned learner")

    def select(self, key: str, values: list[bytes]) -> int:
        def created(v: bytes) -> float:
            try:
                self.validate(key, v)
                return _decode_record(v).created_at
            except (ProtocolError, ValueError):
                return -math.inf

        return max(range(len(values)), key=lambda i: created(values[i]))


class Membership:
    def __init__(self, host: Host, run_id: str, server: bool = True) -> None:
        self.host = host
        self.run_id = run_id
        self.records = _RecordValidator()
        validator = NamespacedValidator({"echorl": self.records})
        self.dht = KadDHT(
            host.libp2p, DHTMode.SERVER if server else DHTMode.CLIENT, validator=validator, validator_changed=True
        )

    def pin(self, learner_peer_id: str) -> None:
        """From now on only records signed by this learner are stored, relayed or taken."""
        self.records.pinned = learner_peer_id

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with background_trio_service(self.dht):
            task_status.started()
            await trio.sleep_forever()

    async def add_bootstrap(self, peer_id: str) -> None:
        await self.dht.add_peer(ID.from_base58(peer_id), skip_server_mode_check=True)

    async def publish_learner_record(self, addrs: list[str], version: int = 0) -> None:
        rec = wire.sign(
            LearnerRecord(
                run_id=self.run_id,
                learner_peer_id=self.host.peer_id,
                addrs=addrs[:16],
                version=version,
                created_at=time.time(),
            ),
            self.host.identity,
        )
        with trio.move_on_after(10):
            await self.dht.put_value(learner_key(self.run_id), wire.encode(rec))

    async def find_learner_record(self, timeout: float = 10.0) -> LearnerRecord | None:
        """The learner record the DHT holds, if valid (signed by the learner it names, not dated
        in the future, and once pinned, by the pinned learner): one that is not is ignored."""
        key = learner_key(self.run_id)
        with trio.move_on_after(timeout):
            for _ in range(2):  # an invalid value in our own store hides the network's: drop it, ask again
                value = await self.dht.get_value(key)
                if value is None:
                    return None
                try:
                    self.records.validate(key, value)  # a value stored before we pinned is checked again
                    return _decode_record(value)
                except (ProtocolError, ValueError) as exc:
                    log.warning("ignoring a learner record in the DHT: %s", exc)
                    if not self.dht.value_store.remove(key.encode()):
                        return None
        return None

    async def provide(self) -> bool:
        with trio.move_on_after(10):
            return bool(await self.dht.provide(provider_key(self.run_id)))
        return False

    async def find_nodes(self, timeout: float = 10.0) -> list[str]:
        out: dict[str, None] = {}
        with trio.move_on_after(timeout):
            for info in await self.dht.find_providers(provider_key(self.run_id), count=256):
                self.host.add_peer_addrs(str(info.peer_id), [str(a) for a in info.addrs])
                out[str(info.peer_id)] = None
        return list(out)


async def find_learner(
    host: Host, bootstrap: str, run_id: str, membership: Membership | None = None, pinned: str | None = None
) -> str:
    """The learner's peer id for ``run_id``. The learner is pinned (it signs every manifest):
    ``pinned`` if given, else the bootstrap peer. The DHT's signed learner record is used only
    to find a pinned learner's addresses; a record naming any other peer is ignored, so a peer
    that publishes a record for itself cannot take over the run. Raises PeerUnavailable."""
    boot = await host.connect(bootstrap)
    expected = pinned or boot
    if membership is not None:
        membership.pin(expected)
        await membership.add_bootstrap(boot)
        rec = await membership.find_learner_record()
        if rec is not None and rec.run_id == run_id and rec.learner_peer_id == expected != boot:
            host.add_peer_addrs(expected, list(rec.addrs))
            await host.connect(rec.addrs[0] if "/p2p/" in rec.addrs[0] else f"{rec.addrs[0]}/p2p/{expected}")
        elif rec is not None and rec.learner_peer_id != expected:
            log.warning(
                "ignoring a learner record for %s: pinned learner is %s",
                short_id(rec.learner_peer_id),
                short_id(expected),
            )
    if expected != boot and not host.is_connected(expected):
        raise PeerUnavailable(f"pinned learner {short_id(expected)}… not found through {bootstrap}")
    return expected


__all__ = ["Membership", "find_learner", "learner_key", "provider_key", "JoinAccepted", "PeerUnavailable"]


def _decode_record(data: bytes) -> LearnerRecord:
    """Strict decode + signature check (signed by the learner it names). Raises ProtocolError."""
    rec = wire.decode(data, expect=LearnerRecord)
    wire.verify(rec)
    return rec
