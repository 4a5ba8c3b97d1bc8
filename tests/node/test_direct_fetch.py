"""A node's direct fetch reads the learner's one weight store: with nothing held, ``NodeWeights``
catches up from the learner alone (newest full snapshot + the deltas after it), loads the
version into its backend, counts it as a fetch and keeps it on disk with its signed manifest."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
from swarm import safetensors_f32

from echorl.broadcast.broadcaster import Broadcaster
from echorl.net.host import open_host
from echorl.node.state import SnapshotKeeper, load_snapshot
from echorl.node.versions import NodeWeights
from echorl.protocol.identity import Identity

pytestmark = pytest.mark.timeout(90)


class RecordingBackend:
    """The backend surface ``NodeWeights`` uses: ``load_state_dict(state, version)``."""

    def __init__(self) -> None:
        self.loaded: list[tuple[int, Any]] = []

    def load_state_dict(self, state: Any, version: int) -> None:
        self.loaded.append((version, state))


def weights(step: int) -> bytes:
    values = np.arange(50_000, dtype=np.float32)
    values[: 100 * step] += 1.0
    return safetensors_f32(values)


def test_direct_fetch_reaches_the_learners_newest_version(tmp_path):
    async def main():
        li = Identity.generate()
        async with open_host(li) as lh, open_host(Identity.generate()) as hn:
            bc = Broadcaster(lh, li, "r", chunk_bytes=16 * 1024, full_every=10, direct=False)
            bc.install()
            for v in range(3):
                await bc.publish(v, weights(v), [])
            await hn.connect(lh.addrs[0])
            backend = RecordingBackend()
            keeper = SnapshotKeeper(tmp_path, "r")
            node = NodeWeights(hn, "r", backend, keeper=keeper)
            async with trio.open_nursery() as nursery:
                await node.attach(li.peer_id, nursery)
                await node._fetch()
                assert node.version == 2 and node.loads["fetch"] == 1 and node.loads["relay"] == 0
                assert [v for v, _ in backend.loaded] == [2]
                np.testing.assert_array_equal(
                    backend.loaded[0][1]["w"].numpy(), np.frombuffer(weights(2)[-200_000:], dtype="<f4")
                )
                await node.flush()
                nursery.cancel_scope.cancel()
        snap = load_snapshot(keeper.state_dir, li.peer_id, "r")
        assert snap is not None and snap.version == 2 and snap.data == weights(2)

    trio.run(main)
