"""Weight files are recycled: a file no version uses any more becomes a spare that the next
version's file is made from (its cached pages overwritten, not new ones filled), unless it is
linked elsewhere (a node's kept snapshot) or being read; spares are bounded and never served."""

from __future__ import annotations

import os

import trio

from echorl.broadcast.files import apply_delta_file, copy_into
from echorl.broadcast.store import MAX_SPARES, WeightStore
from echorl.protocol import delta


def _file(store: WeightStore, version: int, data: bytes):
    path = store.new_path(version)
    store.claim(path, len(data))
    with open(path, "r+b") as f:
        f.write(data)
    return path


def test_a_retired_file_is_the_next_version_s_file(tmp_path):
    store = WeightStore(tmp_path / "s")
    v1 = _file(store, 1, b"a" * 10_000)
    inode = os.stat(v1).st_ino
    assert store.claims_recycled == 0
    trio.run(store.collect, set())  # v1 retired: kept as a spare, not deleted
    assert not v1.exists() and store.disk_bytes(set()) == 10_000
    v2 = store.new_path(2)
    store.claim(v2, 6_000)
    assert os.stat(v2).st_ino == inode and v2.stat().st_size == 6_000 and store.claims_recycled == 1
    assert store.disk_bytes({v2}) == 6_000  # the spare is gone: it is v2 now


def test_spares_are_bounded_and_the_largest_files_kept(tmp_path):
    store = WeightStore(tmp_path / "s")
    paths = [_file(store, v, b"x" * (1000 * (v + 1))) for v in range(MAX_SPARES + 2)]
    trio.run(store.collect, set())
    spares = sorted(p.stat().st_size for p in (tmp_path / "s").iterdir() if p.name.startswith("spare-"))
    assert spares == [1000 * (v + 1) for v in range(2, MAX_SPARES + 2)]
    assert all(not p.exists() for p in paths)
    small = store.new_path(9)
    store.claim(small, 500)  # the smallest spare that fits
    assert store.disk_bytes(set()) == 1000 * (MAX_SPARES + 2) and small.stat().st_size == 500


def test_a_file_linked_elsewhere_or_being_read_is_never_recycled(tmp_path):
    store = WeightStore(tmp_path / "s")
    kept = _file(store, 1, b"k" * 4096)
    os.link(kept, tmp_path / "snapshot.safetensors")  # what a node's SnapshotKeeper does
    read = _file(store, 2, b"r" * 4096)
    with store.reading(read):
        trio.run(store.collect, set())
        assert read.exists()  # a reader holds it: not even removed
    assert not kept.exists() and (tmp_path / "snapshot.safetensors").read_bytes() == b"k" * 4096
    new = store.new_path(3)
    store.claim(new, 4096)
    assert store.claims_recycled == 0 and new.read_bytes() == b"\0" * 4096  # a fresh file
    trio.run(store.collect, {new})
    assert not read.exists() and store.disk_bytes({new}) == 8192  # now a spare


def test_a_new_store_removes_spares_an_earlier_process_left(tmp_path):
    store = WeightStore(tmp_path / "s")
    _file(store, 1, b"z" * 100)
    trio.run(store.collect, set())
    assert any(p.name.startswith("spare-") for p in (tmp_path / "s").iterdir())
    WeightStore(tmp_path / "s")
    assert list((tmp_path / "s").iterdir()) == []


def test_a_delta_is_applied_into_a_recycled_file_in_place(tmp_path):
    from safetensors.numpy import save
    import numpy as np

    old = save({"w": np.arange(50_000, dtype="<f4")})
    new = save({"w": np.arange(50_000, dtype="<f4") * 2})
    base, dpath, out = tmp_path / "base", tmp_path / "delta", tmp_path / "out"
    base.write_bytes(old)
    dpath.write_bytes(delta.encode_delta(old, new))
    out.write_bytes(b"\xff" * (3 * len(old)))  # a larger spare with other bytes
    inode = os.stat(out).st_ino
    apply_delta_file(base, dpath, out)
    assert out.read_bytes() == new and os.stat(out).st_ino == inode
    copy_into(base, out)
    assert out.read_bytes() == old


def test_a_version_being_delivered_is_not_recycled_when_newer_ones_land(tmp_path):
    """A node loads a version from its relay's file while the next two versions arrive: the
    first retires that file, the second would be written into it. The file is held for the
    delivery, so the loader reads the version it was given, whole."""
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
