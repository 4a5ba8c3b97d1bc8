"""A weight file held by a reader (a chunk read from disk, a version the node is loading) is not
removed by the store's collection until the reader is done, even when newer versions land."""

from __future__ import annotations

import trio

from echorl.broadcast.store import WeightStore


def test_collect_leaves_a_file_that_is_being_read(tmp_path):
    store = WeightStore(tmp_path / "s")
    held, free = store.new_path(1), store.new_path(2)
    held.write_bytes(b"h" * 100)
    free.write_bytes(b"f" * 100)
    with store.reading(held):
        with store.reading(held):  # readers are counted
            pass
        trio.run(store.collect, set())
        assert held.exists() and not free.exists()
        assert trio.run(store.read, held, 10, 5) == b"hhhhh"
    trio.run(store.collect, set())
    assert not held.exists()


def test_a_version_being_delivered_is_not_recycled_when_newer_ones_land(tmp_path):
    """A node loads a version from its relay's file while five newer versions arrive (the relay
    keeps three in flight, so the file leaves its live set): the file is held for the delivery,
    and the loader reads the version it was given, whole."""
    from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
    from echorl.broadcast.relay import Relay
    from echorl.net.host import open_host
    from echorl.protocol.identity import Identity

    versions = [_safetensors(v) for v in range(6)]

    async def main():
        li = Identity.generate()
        async with open_host(li) as lh, open_host(Identity.generate()) as h1:
            bc = Broadcaster(lh, li, "r", fanout=1, full_every=1, direct=False, store_dir=tmp_path / "learner")
            bc.install()
            read_back: list[bytes] = []
            later = trio.Event()

            async def on_version(version, path):
                if version == 0:
                    await later.wait()  # a slow load: v1 and v2 land meanwhile
                    read_back.append(path.read_bytes())

            relay = Relay(h1, li.peer_id, "r", on_version=on_version, direct=False, store_dir=tmp_path / "relay")
            relay.install()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay.run)
                nodes = [NodeInfo(h1.peer_id, True, tuple(h1.addrs))]
                for v, data in enumerate(versions):
                    report = await bc.publish(v, data, nodes, timeout=30)
                    assert report.completed == [h1.peer_id]
                with trio.fail_after(10):
                    while relay.version != 5:
                        await trio.sleep(0.01)
                later.set()
                with trio.fail_after(10):
                    while not read_back:
                        await trio.sleep(0.01)
                assert read_back == [versions[0]]
                nursery.cancel_scope.cancel()

    trio.run(main)


def _safetensors(step: int) -> bytes:
    import numpy as np
    from safetensors.numpy import save

    return save({"w": np.random.default_rng(step).standard_normal(100_000).astype("<f4")})
