"""The one weight store: the learner holds each published version's bytes once (the frame
bodies the broadcast forwards), keeps every version within ``retain`` of the newest rebuildable
(spot checks), and serves catch-up and a node's direct fetch from those same chunks."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import trio
from plans import announce, share_a_plan
from swarm import safetensors_f32

from echorl.broadcast.broadcaster import Broadcaster
from echorl.broadcast.relay import Relay
from echorl.broadcast.store import INLINE_WRITE_BYTES, HeldChain, VersionState, WeightStore
from echorl.net.host import open_host
from echorl.protocol import delta, snapshot
from echorl.protocol.identity import Identity

pytestmark = pytest.mark.timeout(90)
CHUNK = 64 * 1024
FRAME_OVERHEAD = 64  # msgpack map, type tag and digest around each chunk's bytes


def weights(step: int, n: int = 500_000) -> bytes:
    values = np.linspace(0, 1, n, dtype=np.float32)
    values[: 1000 * step] += 1.0  # each step changes a small part: a delta is worth it
    return safetensors_f32(values)


def test_learner_holds_a_published_version_once():
    """Publishing a 2 MB full snapshot (no nodes) retains its bytes once: the store counts the
    snapshot's size plus framing, and the process keeps ~1x the bytes (the removed double path
    kept chunks, frame bodies and the fallback store's chunks: ~3x). A delta after it leaves no
    version's bytes in memory: its result is a file, the next delta's base."""

    async def main():
        li = Identity.generate()
        async with open_host(li) as lh:
            bc = Broadcaster(lh, li, "r", chunk_bytes=CHUNK, full_every=10, direct=False)
            bc.install()
            data = weights(0)
            n_chunks = -(-len(data) // CHUNK)
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            report = await bc.publish(0, data, [])
            gc.collect()
            retained = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            assert report.kind == "full" and report.result_bytes == len(data)
            held = bc.server.held_bytes()
            assert len(data) <= held <= len(data) + n_chunks * FRAME_OVERHEAD
            assert retained < 1.25 * len(data), (retained, len(data))
            assert bc._prev == (0, None)  # a full version's bytes are its chunks, not a second copy
            assert await trio.to_thread.run_sync(bc.version_bytes, 0) == data

            new = weights(1)
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            report = await bc.publish(1, new, [])
            del new
            gc.collect()
            retained = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            assert report.kind == "delta"
            # on disk: the delta's payload and its result (the next delta's base); in memory:
            # neither version's bytes (the old design kept the result, 1x, between publications)
            assert bc.server.held_bytes() - held <= report.bytes + len(data) + n_chunks * FRAME_OVERHEAD
            assert retained < 0.25 * len(data), (retained, len(data))
            assert bc._prev is not None and bc._prev[1] is not None and bc._prev[1].read_bytes() == weights(1)
            assert await trio.to_thread.run_sync(bc.version_bytes, 1) == weights(1)
            assert await trio.to_thread.run_sync(bc.version_bytes, 0) == data

    trio.run(main)


def _chain_of(kinds: str, retain: int, where: Path) -> tuple[HeldChain, list[bytes]]:
    """A chain held the way the learner holds it: version i is full ("f") or a delta ("d"),
    each payload a file in ``where``."""
    learner = Identity.generate()
    chain, files = HeldChain(retain), []
    for v, kind in enumerate(kinds):
        new = weights(v, n=20_000)
        payload = new if kind == "f" else delta.encode_delta(files[-1], new)
        manifest, chunks = snapshot.build_manifest(
            learner,
            "r",
            v,
            v - 1,
            payload,
            new,
            kind="full" if kind == "f" else "delta",
            base_version=-1 if kind == "f" else v - 1,
            chunk_bytes=4096,
        )
        path = where / f"v{v}-{retain}.payload"
        path.write_bytes(payload)
        chain.hold(manifest, path)
        files.append(new)
    return chain, files


def test_chain_keeps_versions_within_retain_and_serves_the_newest_run(tmp_path):
    chain, files = _chain_of("fdfd", retain=2, where=tmp_path)
    assert [e[0].version for e in chain.entries] == [0, 1, 2, 3]  # v1 is within 2 of v3
    assert chain.version_bytes(1) == files[1] and chain.version_bytes(3) == files[3]
    assert [m.version for m in chain.newest_run()] == [2, 3]  # catch-up: newest full + deltas

    chain, files = _chain_of("fdfdf", retain=2, where=tmp_path)
    assert [e[0].version for e in chain.entries] == [2, 3, 4]
    assert chain.version_bytes(1) is None and chain.version_bytes(3) == files[3]
    assert [m.version for m in chain.newest_run()] == [4]

    relay_chain, _ = _chain_of("fdfd", retain=0, where=tmp_path)  # a relay keeps only the newest run
    assert [e[0].version for e in relay_chain.entries] == [2, 3]


def test_catch_up_and_direct_fetch_come_from_the_learners_one_store():
    """A node with nothing catches up from the learner alone (the direct fetch: newest full
    snapshot + delta) and a second node catches up from the first; the learner's store did not
    grow for serving them."""

    async def main():
        li = Identity.generate()
        async with open_host(li) as lh, open_host(Identity.generate()) as ha, open_host(Identity.generate()) as hb:
            bc = Broadcaster(lh, li, "r", chunk_bytes=CHUNK, full_every=10, direct=False)
            bc.install()
            for v in range(3):
                await bc.publish(v, weights(v), [])
            held = bc.server.held_bytes()
            got: dict[str, list[int]] = {"a": [], "b": []}
            a = Relay(ha, li.peer_id, "r", on_version=lambda v, _: got["a"].append(v), direct=False)
            b = Relay(hb, li.peer_id, "r", on_version=lambda v, _: got["b"].append(v), direct=False)
            a.install()
            b.install()
            await ha.connect(lh.addrs[0])
            assert await a.catch_up([li.peer_id], timeout=30, only=True) == 2
            assert a.result == weights(2) and got["a"] == [2]
            share_a_plan(a, li, hb.peer_id)  # a node serves the members of its plans only
            await hb.connect(ha.addrs[0])
            assert await b.catch_up([ha.peer_id], timeout=30, only=True) == 2
            assert b.result == weights(2)
            assert bc.server.held_bytes() == held

    trio.run(main)


def test_a_dead_process_s_temporary_store_is_removed_a_live_or_recent_one_kept(tmp_path) -> None:
    """A relay SIGKILLed mid-run leaves its temporary weight files (a whole model's worth); the
    next store created on the machine removes them once their process is gone."""
    import os
    import subprocess
    import sys
    import time

    from echorl.broadcast.store import STALE_TMP_STORE_S, remove_stale_tmp_stores

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    old = time.time() - STALE_TMP_STORE_S - 60
    made = {}
    for name, pid, mtime in (
        ("dead-old", dead_pid, old),
        ("dead-recent", dead_pid, time.time()),
        ("live-old", os.getppid(), old),
    ):
        d = tmp_path / f"echorl-store-{pid}-{name}"
        d.mkdir()
        (d / "v1-0.payload").write_bytes(b"x" * 1024)
        os.utime(d, (mtime, mtime))
        made[name] = d
    other = tmp_path / "echorl-store-abc"  # not ours (no pid): never touched
    other.mkdir()
    os.utime(other, (old, old))
    assert remove_stale_tmp_stores(tmp_path) == [made["dead-old"]]
    assert not made["dead-old"].exists()
    assert made["dead-recent"].exists() and made["live-old"].exists() and other.exists()


@pytest.mark.parametrize("chunk_bytes", [INLINE_WRITE_BYTES, 4 * INLINE_WRITE_BYTES])
def test_a_small_chunk_is_written_on_the_loop_a_large_one_in_a_thread(chunk_bytes, monkeypatch) -> None:
    """The hop to a worker thread cost more than a 64 KiB page-cache write (11 % of the relays'
    samples in the 32-peer bench); a large chunk still leaves the loop. Either way the file holds
    the version, and other tasks (the relay's forwarders) run during every put: a relay that did
    not yield between chunks read ahead of its forwarders and evicted chunks before they were
    streamed on (docs/broadcast-notes.md)."""
    learner = Identity.generate()
    data = safetensors_f32(np.arange(chunk_bytes, dtype=np.float32))  # 4 chunks and a bit
    me = Identity.generate().peer_id
    state = VersionState(announce(learner, data, [me], chunk_bytes=chunk_bytes), me, WeightStore())
    hops: list[str] = []
    run_sync = trio.to_thread.run_sync

    async def counted(fn, *args, **kw):
        hops.append(fn.__name__)
        return await run_sync(fn, *args, **kw)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)

    turns: list[int] = []  # a forwarder's turns on the loop, read before each put

    async def forwarder() -> None:
        while True:
            await trio.lowlevel.checkpoint()
            turns[-1] += 1

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forwarder)
            for i, ref in enumerate(state.manifest.chunks):
                turns.append(0)
                part = data[state.offset(i) : state.offset(i) + ref.size]
                assert await state.put(ref.digest, part)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert state.path.read_bytes() == data
    assert all(turns), turns  # written on the loop or not, the forwarders run during every put
    threaded = sum(ref.size > INLINE_WRITE_BYTES for ref in state.manifest.chunks)  # the tail chunk is small
    assert hops.count("write") == threaded == (0 if chunk_bytes <= INLINE_WRITE_BYTES else 4)
