"""Weights on disk: a version is a file written chunk by chunk as each chunk is verified, read
back by offset, checked by streaming over it, and deltas are applied tensor by tensor from the
files; memory is the chunk cache, bounded by its own accounting whatever the version's size."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
import trio

from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
from echorl.broadcast.files import ChunkCache, apply_delta_file, check_layout, rebuild_file, verify_result_file
from echorl.broadcast.relay import Relay
from echorl.net.host import open_host
from echorl.protocol import delta, snapshot
from echorl.protocol.errors import ProtocolError
from echorl.protocol.identity import Identity

pytestmark = pytest.mark.timeout(180)


def model(step: int, n: int = 1_000_000) -> bytes:
    """Three tensors: one unchanged, one changed in a few places (sparse), one rewritten (dense)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n).astype("<f4")
    b = rng.standard_normal(n // 4).astype("<f4")
    c = rng.standard_normal(n // 8).astype("<f4")
    b[: 50 * step] += step
    c += step
    from safetensors.numpy import save

    return save({"a": a, "b": b, "c": c})


def test_cache_is_an_lru_bounded_by_its_bytes():
    cache = ChunkCache(max_bytes=250)
    for i in range(5):
        cache.put(bytes([i]), b"x" * 100)
        assert cache.bytes <= 250
    assert cache.get(bytes([0])) is None and cache.get(bytes([4])) == b"x" * 100
    cache.get(bytes([3]))
    cache.put(b"new", b"y" * 100)  # evicts the least recently used: 4 (3 was used since)
    assert cache.get(bytes([3])) is not None and cache.get(bytes([4])) is None
    cache.put(b"huge", b"z" * 251)  # larger than the cache: never held
    assert cache.get(b"huge") is None and cache.peak_bytes <= 250


def test_delta_applied_from_files_equals_the_in_memory_apply(tmp_path):
    learner = Identity.generate()
    old, new = model(1), model(2)
    payload = delta.encode_delta(old, new)
    modes = [e["mode"] for e in msgpack.unpackb(payload)["tensors"]]
    assert sorted(modes) == ["dense", "same", "sparse"]
    base, dpath, out = tmp_path / "base", tmp_path / "delta", tmp_path / "out"
    base.write_bytes(old)
    dpath.write_bytes(payload)
    manifest, _ = snapshot.build_manifest(learner, "r", 2, 1, payload, new, kind="delta", base_version=1)
    assert rebuild_file(manifest, dpath, base, out) == out
    assert out.read_bytes() == delta.apply_delta(old, payload) == new

    base.write_bytes(model(0))  # not the delta's base: refused, nothing left behind
    with pytest.raises(ProtocolError):
        apply_delta_file(base, dpath, out)
    assert not out.exists()
    base.write_bytes(old)
    dpath.write_bytes(payload[:-7] + b"\x00" * 7)  # a corrupt payload
    with pytest.raises(ProtocolError):
        rebuild_file(manifest, dpath, base, out)
    assert not out.exists()


def test_streaming_verification_finds_a_flipped_byte(tmp_path):
    learner = Identity.generate()
    data = model(0)
    manifest, _ = snapshot.build_manifest(learner, "r", 0, -1, data, data)
    path = tmp_path / "v0"
    path.write_bytes(data)
    verify_result_file(manifest, path)
    raw = bytearray(data)
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ProtocolError):
        verify_result_file(manifest, path)
    path.write_bytes(data[:-4])
    with pytest.raises(ProtocolError):
        verify_result_file(manifest, path)


def test_a_full_payload_of_verified_chunks_is_checked_for_its_layout_only(tmp_path):
    """Its chunks were each checked against the signed digests, so no digest pass runs again;
    a file of the wrong size or tensor layout is still refused."""
    learner = Identity.generate()
    data = model(0)
    manifest, _ = snapshot.build_manifest(learner, "r", 0, -1, data, data)
    path = tmp_path / "v0"
    path.write_bytes(data)
    assert rebuild_file(manifest, path, None, tmp_path / "out", chunks_verified=True) == path
    other = model(0, n=1_000_008)  # same names and dtypes, other shapes
    for wrong in (data[:-4], other[: len(data)]):
        path.write_bytes(wrong)
        with pytest.raises(ProtocolError):
            check_layout(manifest, path)
        with pytest.raises(ProtocolError):
            rebuild_file(manifest, path, None, tmp_path / "out", chunks_verified=True)


def test_a_version_larger_than_the_cache_moves_through_relays_and_verifies(tmp_path):
    """A 4.5 MB full version then a delta go learner → relay → relay (a chain: fanout 1) with
    a 256 KiB chunk cache at every peer: every relay rebuilds both versions bit for bit, on disk,
    and no cache ever held more than its bound (its own accounting)."""
    cache = 256 * 1024
    versions = [model(0), model(1)]

    async def main():
        li = Identity.generate()
        async with open_host(li) as lh, open_host(Identity.generate()) as h1, open_host(Identity.generate()) as h2:
            bc = Broadcaster(
                lh,
                li,
                "r",
                fanout=1,
                shape="tree",
                chunk_bytes=64 * 1024,
                full_every=10,
                direct=False,
                cache_bytes=cache,
                store_dir=tmp_path / "learner",
            )
            bc.install()
            got: dict[str, list[tuple[int, str]]] = {h1.peer_id: [], h2.peer_id: []}
            relays = []
            async with trio.open_nursery() as nursery:
                for i, h in enumerate((h1, h2)):

                    def cb(v, path, pid=h.peer_id):
                        got[pid].append((v, hashlib.sha256(path.read_bytes()).hexdigest()))

                    r = Relay(
                        h,
                        li.peer_id,
                        "r",
                        on_version=cb,
                        direct=False,
                        cache_bytes=cache,
                        store_dir=tmp_path / f"relay{i}",
                    )
                    r.install()
                    nursery.start_soon(r.run)
                    relays.append(r)
                nodes = [NodeInfo(h.peer_id, True, tuple(h.addrs)) for h in (h1, h2)]
                kinds = []
                for v, data in enumerate(versions):
                    assert len(data) > 10 * cache
                    report = await bc.publish(v, data, nodes, timeout=60)
                    kinds.append(report.kind)
                    assert sorted(report.completed) == sorted(got) and report.depth == 2, report
                    with trio.fail_after(20):
                        while any(not g or g[-1][0] != v for g in got.values()):
                            await trio.sleep(0.01)
                    assert {g[-1][1] for g in got.values()} == {hashlib.sha256(data).hexdigest()}
                assert kinds == ["full", "delta"]
                for r in relays:
                    store = r.server.store
                    assert store.cache.peak_bytes <= cache and r.server.memory_bytes() <= cache
                    assert r.result_path.parent == store.dir and r.result == versions[-1]
                    # on disk: the full snapshot's payload (= its result), the delta and its result
                    assert r.server.held_bytes() <= 2 * len(versions[-1]) + bc.server.held_bytes()
                assert bc.server.store.cache.peak_bytes <= cache
                assert bc.server.store.cache.misses > 0  # the learner serves from its file
                assert sum(r.server.store.cache.hits for r in relays) > 0  # the interior relay forwards from its cache
                nursery.cancel_scope.cancel()

    trio.run(main)
