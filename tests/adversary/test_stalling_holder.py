"""A catch-up holder that answers with the chain, then stops sending chunks: the node asks it
for one chunk, gives up at that chunk's deadline (its bytes at the floor rate), and takes every
other chunk from the learner without asking the staller again."""

from __future__ import annotations

import numpy as np
import trio
from swarm import safetensors_f32

from echorl.broadcast.broadcaster import Broadcaster
from echorl.broadcast.deadlines import Deadlines
from echorl.broadcast.relay import Relay
from echorl.net.host import open_host
from echorl.protocol.identity import Identity
from echorl.protocol.messages import CatchUp
from echorl.protocol.routes import CATCHUP, CHUNK


def test_catch_up_abandons_a_holder_that_stops_sending() -> None:
    async def main() -> None:
        li = Identity.generate()
        async with (
            open_host(li) as lh,
            open_host(Identity.generate()) as staller,
            open_host(Identity.generate()) as node,
        ):
            bc = Broadcaster(lh, li, "r", chunk_bytes=64 * 1024, direct=False)
            bc.install()
            await bc.publish(0, safetensors_f32(np.linspace(0, 1, 256 * 1024, dtype=np.float32)), [])
            chain = bc.server.chain.newest_run()
            asked: list[str] = []

            async def catch_up(msg, ctx):
                return CatchUp(run_id="r", manifests=chain, more=False)

            async def chunk(msg, ctx):  # holds the chain, never sends a chunk
                asked.append(msg.digest.hex())
                await trio.sleep_forever()

            staller.serve({CATCHUP: catch_up, CHUNK: chunk})
            relay = Relay(node, li.peer_id, "r", direct=False, deadlines=Deadlines(base_s=1.0))
            relay.install()
            for h in (lh, staller):
                await node.connect(h.addrs[0])
            with trio.fail_after(60):
                assert await relay.catch_up([staller.peer_id]) == 0
            assert len(chain[0].chunks) >= 16 and len(asked) == 1  # one chunk deadline, not one per chunk

    trio.run(main)


def test_parent_that_trickles_a_chunk_is_a_stall() -> None:
    """A plan parent whose frame starts at once and then trickles a byte at a time is cut at one
    chunk's deadline (bytes at the floor rate), not after the transport's 120 s frame timeout."""
    from types import SimpleNamespace

    import pytest
    from trio.testing import memory_stream_pair

    from echorl.net.transport import FramedStream, TcpStreamAdapter

    async def main() -> None:
        async with open_host(Identity.generate()) as node:
            relay = Relay(
                node, Identity.generate().peer_id, "r", direct=False, stall_s=5.0, deadlines=Deadlines(base_s=1.0)
            )
            child, parent = memory_stream_pair()

            async def open_source(*_: object) -> FramedStream:
                return FramedStream(TcpStreamAdapter(child), io_timeout=120.0)

            relay.feed.open_source = open_source  # type: ignore[method-assign]
            state = SimpleNamespace(manifest=SimpleNamespace(chunk_bytes=64 * 1024), stripe_complete=lambda s: False)

            async def trickle() -> None:
                await parent.send_all((70_000).to_bytes(4, "big"))
                for _ in range(600):
                    await parent.send_all(b"\x00")
                    await trio.sleep(0.2)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trickle)
                t0 = trio.current_time()
                with pytest.raises(trio.TooSlowError):
                    await relay.feed.stream("parent", state, 0)  # type: ignore[arg-type]
                assert trio.current_time() - t0 < 5.0  # the chunk deadline is ~1.2 s here
                nursery.cancel_scope.cancel()

    trio.run(main)
